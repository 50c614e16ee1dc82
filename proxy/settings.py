"""The configuration file: pydantic models for every key, and ``load_config``.

``load_config`` reads YAML, substitutes ``${VAR}`` / ``${VAR:-default}`` from the
environment, validates every key (unknown keys are errors), resolves every
plugin binding, and raises ``ConfigError`` with one line per problem, each
naming its key path. ``ctxproxy validate`` and ``ctxproxy serve`` both call it,
before any port is bound. After load, nothing reads raw config dicts.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
import socket
import time
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from plugins.registry import Binding, Registry, default_registry
from proxy.core.budget import TrimmerParams
from proxy.core.errors import BindingError, ConfigError
from proxy.core.tokens import BUNDLED_ENCODINGS


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


Mode = Literal["observe", "enforce"]
MODE_DOC = ("observe: forward each request as the client sent it (output caps, the model allow-list and the "
            "upstream model name still apply) and report what enforce would have done; enforce: manage the context")


class ServerSettings(Strict):
    host: str = Field("127.0.0.1", description="Address to bind.")
    port: int = Field(8080, ge=0, le=65535, description="Port to bind.")
    workers: int = Field(1, ge=1, le=64, description="Worker processes sharing the port (SO_REUSEPORT).")
    max_body_mb: float = Field(64, gt=0, description="Largest request body accepted (413 above).")
    connect_timeout: float = Field(10, gt=0, description="Seconds to connect to an upstream (504 after).")
    first_byte_timeout: float = Field(300, gt=0, description="Seconds to wait for the upstream's headers.")
    idle_timeout: float = Field(300, gt=0, description="Seconds allowed between two chunks of a response.")
    drain_timeout: float = Field(30, ge=0, description="Seconds in-flight requests get to finish on SIGTERM.")
    header_timeout: float = Field(
        75, gt=0, description="Seconds a connection may sit without a complete request head (idle keep-alive or "
        "partial headers) before it is closed; keep it above a load balancer's upstream keep-alive (nginx: 60).")
    body_timeout: float = Field(60, gt=0, description="Seconds a client gets to send a request body (then 408).")
    offload_bytes: int = Field(262_144, ge=0, description="Bodies larger than this are assembled off the event loop.")
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="A second listener that serves only GET /metrics, with no key (a "
        "Prometheus that has none); omit for none. With tenants configured, /metrics on the main port needs an "
        "admin key (it names every tenant with its traffic and cost).")
    metrics_host: str = Field(
        "127.0.0.1", description="Address of the metrics_port listener: loopback unless the scraper is elsewhere "
        "(in a container network, 0.0.0.0 with the port left unpublished).")

    @field_validator("metrics_port")
    @classmethod
    def _two_ports(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and value == info.data.get("port"):
            raise ValueError("must differ from server.port")
        return value


class UpstreamSettings(Strict):
    base_url: str = Field(..., description="OpenAI-compatible base URL, e.g. https://api.openai.com/v1; for "
                          "api: anthropic the API root, e.g. https://api.anthropic.com.")
    api: Literal["openai", "anthropic"] = Field(
        "openai", description="openai: an OpenAI-compatible API (Authorization: Bearer); anthropic: Anthropic's API "
        "(requests go to {base_url}/v1/messages with x-api-key).")
    context_management: Literal["forward", "emulate"] | None = Field(
        None, description="A Messages request's context_management: forwarded to the upstream (default for api: "
        "anthropic) or emulated by the proxy (default for any other upstream).")
    api_key: str | None = Field(None, description="Key sent upstream; empty = forward the client's (no tenants).")
    headers: dict[str, str] = Field(default_factory=dict, description="Extra headers sent upstream.")
    max_connections: int = Field(256, ge=1, description="Pooled connections to this upstream.")
    keepalive_seconds: float = Field(
        4, gt=0, description="How long an idle pooled connection is kept: below the upstream's own idle timeout "
        "(uvicorn-based servers: 5 s), so a connection it is closing is never reused.")
    responses_compact: Literal["relay", "emulate", "auto"] = Field(
        "auto", description="POST /v1/responses/compact: relay it here, answer it with ctxproxy's own summariser "
        "(emulate), or relay and emulate when this upstream answers 404 (auto).")
    models: list[str] = Field(
        default_factory=list, description="Model names this upstream serves, as shell patterns (claude-*): a model "
        "that models: does not route to an upstream goes to the first upstream with a matching pattern (matched on "
        "the name sent upstream), else to the default upstream.")

    @field_validator("models")
    @classmethod
    def _patterns(cls, patterns: list[str]) -> list[str]:
        for pattern in patterns:
            if not pattern.strip():
                raise ValueError("a model pattern is empty")
            if pattern != pattern.strip():
                raise ValueError(f"{pattern!r}: a model pattern may not start or end with a space")
        return patterns

    @field_validator("base_url")
    @classmethod
    def _url(cls, value: str) -> str:
        if not re.match(r"^https?://[^/\s]+", value):
            raise ValueError(f"must be an http(s) URL, got {value!r}")
        return value.rstrip("/")

    @field_validator("api_key")
    @classmethod
    def _empty_key(cls, value: str | None) -> str | None:
        return value or None

    @property
    def emulates_context_management(self) -> bool:
        """Whether Messages ``context_management`` edits are applied by the proxy rather than by this upstream."""
        if self.context_management is not None:
            return self.context_management == "emulate"
        return self.api != "anthropic"


class ModelSettings(Strict):
    name: str = Field(..., min_length=1, description="The model name clients send.")
    upstream: str | None = Field(None, description="Upstream to use (default: the first whose models: patterns "
                                 "match the model sent upstream, else the default upstream).")
    model: str | None = Field(None, description="Model name sent upstream (default: name).")
    provider: Literal["openai", "litellm"] = Field(
        "openai", description="openai = pass-through to an OpenAI-compatible upstream; litellm = litellm.acompletion."
    )
    context_window: int | None = Field(None, ge=1, description="Input window (default: litellm's model map); "
                                       "narrowed to the provider's real one where it refuses a request for length.")
    max_output_tokens: int | None = Field(None, ge=1, description="Model's max output (default: litellm's map).")
    tokenizer: str | None = Field(None, description="tiktoken encoding name (default by model family).")
    mode: Mode | None = Field(None, description=f"This route's mode ({MODE_DOC}); a tenant's own mode wins over "
                              "it; default: the top-level mode.")
    calibration: Literal["auto", "off"] | float = Field(
        "auto", description="Token-count calibration (proxy.store.calibration): auto = learn the provider's count "
        "over ctxproxy's from usage, per tenant (starting from the family default), off = 1.0, a number = "
        "pinned factor.")
    input_cost_per_token: float | None = Field(None, ge=0, description="USD per input token (default: litellm's map).")
    output_cost_per_token: float | None = Field(None, ge=0,
                                                description="USD per output token (default: litellm's map).")
    cache_read_input_token_cost: float | None = Field(
        None, ge=0, description="USD per input token read from the provider's prompt cache (default: litellm's map).")
    cache_creation_input_token_cost: float | None = Field(
        None, ge=0, description="USD per input token written to the provider's prompt cache (default: litellm's map).")

    @field_validator("calibration", mode="before")
    @classmethod
    def _calibration(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() in ("auto", "off"):
            return value.strip().lower()
        if isinstance(value, bool):  # YAML's `off` is False: the switch, not a number
            return "auto" if value else "off"
        return value

    @field_validator("calibration")
    @classmethod
    def _pinned(cls, value: str | float) -> str | float:
        if isinstance(value, float) and not 0.25 <= value <= 4.0:
            raise ValueError(f"a pinned calibration factor must be within [0.25, 4.0], got {value}")
        return value

    @field_validator("tokenizer")
    @classmethod
    def _bundled(cls, value: str | None) -> str | None:
        if value is not None and value not in BUNDLED_ENCODINGS:
            raise ValueError(f"{value!r} is not an encoding available offline (one of {sorted(BUNDLED_ENCODINGS)})")
        return value

    @property
    def upstream_model(self) -> str:
        return self.model or self.name

    def prices(self) -> tuple[float | None, float | None, float | None, float | None]:
        """The config's own prices (None: from litellm's map)."""
        return (self.input_cost_per_token, self.output_cost_per_token, self.cache_read_input_token_cost,
                self.cache_creation_input_token_cost)


class CacheSettings(Strict):
    backend: Literal["disk", "redis", "memory"] = "disk"
    path: str = Field("~/.cache/ctxproxy", description="diskcache directory (created 0700).")
    url: str | None = Field(None, description="redis://host:port/db for backend: redis.")
    ttl_seconds: float | None = Field(7 * 24 * 3600, gt=0, description="Summary lifetime.")
    size_limit_mb: int = Field(
        1024, ge=1, description="diskcache size limit (summaries and calibration; the cost ledger is not counted "
        "in it and never evicted: <path>/ledger.db, or Redis keys without a TTL).")
    timeout_seconds: float = Field(
        1.0, gt=0, le=30, description="A cache operation still unanswered after this long has timed out: it counts "
        "toward the breaker (also Redis's socket timeout, for the cache and the cost ledger).")
    budget_seconds: float = Field(
        1.0, gt=0, le=60, description="The most one request may wait on slow cache operations in all (each "
        "operation's first 50 ms are free); past it the request goes on without the cache. A summary being made "
        "has a budget of its own (several requests may wait for it): a request that waits for one may so wait "
        "twice this.")
    breaker_timeouts: int = Field(
        2, ge=1, description="Consecutive timed-out cache operations that open the breaker: the cache is then "
        "bypassed (every operation a miss, at once) until a background probe answers.")
    breaker_cooldown_seconds: float = Field(
        10, gt=0, description="How long an open breaker bypasses the cache before it probes the backend again.")
    local_summaries: int = Field(
        1000, ge=0, description="Summaries this process also keeps in memory, in front of the shared cache "
        "(reused while the shared cache is slow or down; 0: none).")

    @field_validator("url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value:
            problem = redis_url_problem(value)
            if problem is not None:
                raise ValueError(problem)
        return value or None

    @model_validator(mode="after")
    def _redis_url(self) -> CacheSettings:
        if self.backend == "redis" and not self.url:
            raise ValueError("backend redis needs cache.url (redis://host:port/db)")
        return self


LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})
WILDCARDS = frozenset({"", "0.0.0.0", "::"})


def is_own_address(url: str, server: ServerSettings) -> bool:
    """Whether ``url`` reaches this proxy's own listener (same port, on an address the proxy listens on)."""
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return False
    host = (parts.hostname or "").lower()
    if not server.port or port != server.port:
        return False
    bound = server.host.strip("[]").lower()
    return host == bound or (_is_loopback(host) and (bound in WILDCARDS or _is_loopback(bound)))


def _is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        address: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.ip_address(host)
    except ValueError:
        try:  # the shorthands a resolver accepts too: 127.1, 2130706433
            address = ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback or address.is_unspecified  # a connection to 0.0.0.0 reaches this host


def redis_url_problem(url: str) -> str | None:
    """Why ``url`` is not a URL redis-py can connect with (its own parser decides), or None."""
    from redis.connection import parse_url

    scheme, _, rest = url.partition("://")
    if scheme not in ("redis", "rediss", "unix") or not rest:
        return f"expected redis://host:port/db, rediss://... or unix:///path, got {_cut(url)!r}"
    try:
        parse_url(url)  # type: ignore[no-untyped-call]
    except ValueError as exc:
        return f"not a Redis URL ({exc}): {_cut(url)!r}"
    db = urlsplit(url).path.strip("/")
    if scheme != "unix" and db and not db.isdigit():
        return f"the database must be a number (redis://host:port/0), got {db[:40]!r}"
    return None


def _cut(text: str) -> str:
    """A URL as shown in a problem: its password blanked (a cache URL may carry one), cut short."""
    try:
        password = urlsplit(text).password
    except ValueError:
        password = None
    if password:
        text = text.replace(f":{password}@", ":***@", 1)
    return text[:100]


class SummarizerSettings(Strict):
    timeout_seconds: float = Field(60, gt=0, description="Deadline for one summariser call.")
    max_summary_tokens: int = Field(1024, ge=64, description="Answer cap of a summariser call.")
    max_values_tokens: int = Field(
        1024, ge=0, description="Cap on a summary's values section: the values its turns acted on that the "
        "summary's text leaves out, appended to it (past the cap the oldest are left out; 0: no section).")
    retry_backoff_seconds: float = Field(10, ge=0, description="First back-off after a failure (doubles).")
    max_backoff_seconds: float = Field(300, ge=0, description="Longest back-off.")
    lock_wait_seconds: float = Field(
        90, ge=0, description="How often a request waiting for another's summary re-checks; it keeps waiting "
        "while the other holder is alive (up to timeout_seconds x max_calls_per_summary).")
    max_calls_per_summary: int = Field(
        8, ge=1, description="Chunks one summary may take; older aged turns beyond are dropped unsummarised."
    )
    background_summaries: int = Field(
        4, ge=0, description="Summaries this process makes in the background at once, before requests need "
        "them (summary_prefetch_ratio); 0: none, the request that needs a summary makes it and waits.")
    background_queue: int = Field(
        64, ge=0, description="Background summaries that may wait for a place; past it one is skipped (counted), "
        "never waited for.")
    background_unused_seconds: float = Field(
        3600, gt=0, description="A summary made in the background and used by no request of this process within "
        "this long (or before it stops) counts as wasted.")


class CompactionSettings(Strict):
    strategy: Literal["keep_recent", "sliding_window", "summarize"]
    max_messages: int | None = None
    window_size: int | None = None
    summary_threshold: int | None = None
    keep_turns: int | None = None


class WorkingMemorySettings(Strict):
    persistent: bool | None = None
    compaction: CompactionSettings | None = None


class TenantSettings(Strict):
    name: str = Field(..., min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    keys: list[str] = Field(..., min_length=1, description="Proxy keys: plain, or sha256:<hex>.")
    context_manager: Any = None
    max_context_tokens: int | None = Field(None, ge=1, description="Hard cap on forwarded input tokens, on every "
                                           "path (where the provider holds part of the history, on the part "
                                           "ctxproxy can see; /responses/compact too).")
    max_output_tokens: int | None = Field(None, ge=1, description="Cap on max_tokens/max_completion_tokens.")
    max_output_policy: Literal["clamp", "refuse"] = Field(
        "clamp", description="Requests above max_output_tokens are clamped, or refused."
    )
    models: list[str] | None = Field(None, description="Allowed model names (omit = all).")
    summarizer_model: str | None = None
    pairing: Literal["repair", "strict"] | None = None
    mode: Mode | None = Field(None, description=f"This tenant's mode ({MODE_DOC}); it wins over a model route's "
                              "and the top-level mode; default: the route's, else the top-level mode.")

    @field_validator("keys")
    @classmethod
    def _keys(cls, keys: list[str]) -> list[str]:
        for key in keys:
            if not key:
                raise ValueError("a key is empty (is its environment variable set?)")
            if key.startswith("sha256:") and not re.fullmatch(r"sha256:[0-9a-fA-F]{64}", key):
                raise ValueError("sha256 keys are written sha256:<64 hex digits>")
        return keys


# What tenants may reach through the relay with the operator's key. Listings and reads of stored objects
# (stored chat completions, files, batches, vector stores, responses by id ...) are left out: the
# operator's key would show one tenant everything the organisation stored.
DEFAULT_RELAY_ALLOW = (
    "POST /v1/embeddings",
    "POST /v1/completions",
    "POST /v1/moderations",
    "POST /v1/audio/transcriptions",
    "POST /v1/audio/translations",
    "POST /v1/audio/speech",
    "POST /v1/images/generations",
    "POST /v1/images/edits",
    "POST /v1/images/variations",
    "POST /v1/messages",
    "POST /v1/messages/count_tokens",
)


class RelaySettings(Strict):
    allow: list[str] | None = Field(
        None, description="With tenants: the 'METHOD /v1/path' entries (shell patterns: *) relayed with the "
        "operator's key; omit for the default list (no stored-object listings). Without tenants every "
        "/v1 path is relayed with the client's own credentials.")

    @field_validator("allow")
    @classmethod
    def _entries(cls, allow: list[str] | None) -> list[str] | None:
        for entry in allow or []:
            method, _, path = entry.partition(" ")
            if method.upper() not in ("GET", "POST", "PUT", "PATCH", "DELETE", "*") or not path.startswith("/v1/"):
                raise ValueError(f"{entry!r}: expected 'METHOD /v1/path' (METHOD: GET, POST, PUT, PATCH, DELETE or *)")
        return allow

    def allowed(self) -> tuple[str, ...]:
        return tuple(self.allow) if self.allow is not None else DEFAULT_RELAY_ALLOW


class AdminSettings(Strict):
    keys: list[str] = Field(default_factory=list, description="Keys for /admin/* (plain or sha256:<hex>).")


LOG_QUEUE_LINES = 10_000  # log lines held while stderr is not read (about 5 MB of request lines)


class LoggingSettings(Strict):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    requests: bool = Field(True, description="One JSON line per request.")
    queue_lines: int = Field(
        LOG_QUEUE_LINES, ge=1, le=1_000_000, description="Log lines held in memory while stderr is not read as "
        "fast as they come (read at start). When they are all waiting, new lines are dropped and counted "
        "(ctxproxy_log_lines_dropped_total) rather than slowing the proxy down.")


class Settings(Strict):
    server: ServerSettings = Field(default_factory=ServerSettings)
    upstreams: dict[str, UpstreamSettings] = Field(..., min_length=1)
    default_upstream: str | None = Field(None, description="Name of the default upstream (default: the first).")
    models: list[ModelSettings] = Field(default_factory=list)
    allow_unknown_models: bool = True
    mode: Mode = Field("enforce", description=f"The default mode ({MODE_DOC}); a model route's or a tenant's own "
                       "mode wins over it.")
    context_manager: Any = None
    working_memory: WorkingMemorySettings | None = None
    trimmer: TrimmerParams | None = None
    pairing: Literal["repair", "strict"] = "repair"
    summarizer_model: str | None = None
    summarizer: SummarizerSettings = Field(default_factory=SummarizerSettings)
    on_summarizer_error: Literal["serve", "fail"] = "serve"
    cache: CacheSettings = Field(default_factory=CacheSettings)
    tenants: list[TenantSettings] = Field(default_factory=list)
    relay: RelaySettings = Field(default_factory=RelaySettings)
    admin: AdminSettings = Field(default_factory=AdminSettings)
    logging: LoggingSettings = Field(default_factory=LoggingSettings)

    @model_validator(mode="after")
    def _references(self) -> Settings:
        names = [m.name for m in self.models]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"models: duplicate name(s) {sorted(dup)}")
        if self.default_upstream is not None and self.default_upstream not in self.upstreams:
            raise ValueError(f"default_upstream: no upstream named {self.default_upstream!r}")
        claimed: dict[str, str] = {}
        for name, upstream in self.upstreams.items():
            for pattern in upstream.models:
                if claimed.setdefault(pattern, name) != name:
                    raise ValueError(f"upstreams.{name}.models: {pattern!r} is also upstream {claimed[pattern]!r}'s "
                                     "(a model goes to one upstream)")
            if is_own_address(upstream.base_url, self.server):
                raise ValueError(f"upstreams.{name}.base_url: {_cut(upstream.base_url)!r} is this proxy's own address "
                                 f"(server.port {self.server.port}): every request would come back to it (is a "
                                 "client's base URL variable, such as OPENAI_BASE_URL, set where the proxy starts?)")
        priced: dict[str, tuple[int, tuple[float | None, ...]]] = {}
        for i, m in enumerate(self.models):
            if m.upstream is not None and m.upstream not in self.upstreams:
                raise ValueError(f"models[{i}].upstream: no upstream named {m.upstream!r}")
            if any(p is not None for p in m.prices()):
                # prices are keyed by the model the provider runs: two routes to it must agree
                first = priced.setdefault(m.upstream_model, (i, m.prices()))
                if first[1] != m.prices():
                    raise ValueError(f"models[{i}]: its prices for upstream model {m.upstream_model!r} differ from "
                                     f"models[{first[0]}]'s")
        tenant_names = [t.name for t in self.tenants]
        if len(set(tenant_names)) != len(tenant_names):
            raise ValueError("tenants: duplicate tenant names")
        return self


@dataclass
class Tenant:
    """A tenant after load: its settings and resolved context-manager binding."""

    settings: TenantSettings
    context_manager: Binding | None

    @property
    def name(self) -> str:
        return self.settings.name


@dataclass
class Config:
    """A validated, resolved configuration."""

    settings: Settings
    context_manager: Binding
    tenants: list[Tenant]
    registry: Registry
    source: str = "<memory>"
    keys: dict[str, Tenant] = field(default_factory=dict)  # sha256 hex of key -> tenant
    admin_keys: frozenset[str] = frozenset()
    read_at: float = 0.0  # time.monotonic() when the file was read (a worker reports it: proxy.serve.workers)

    @property
    def default_upstream(self) -> str:
        return self.settings.default_upstream or next(iter(self.settings.upstreams))

    def upstream_for(self, upstream_model: str) -> str:
        """The upstream of a model no route names one for: the first whose ``models`` patterns match, else the
        default."""
        for name, upstream in self.settings.upstreams.items():
            if any(fnmatchcase(upstream_model, pattern) for pattern in upstream.models):
                return name
        return self.default_upstream

    def model(self, name: str) -> ModelSettings | None:
        for m in self.settings.models:
            if m.name == name:
                return m
        return None

    def forwards_client_auth(self, upstream: UpstreamSettings) -> bool:
        """Whether a client's own credentials go upstream: only with no tenants and no configured key."""
        return not self.tenants and upstream.api_key is None

    def tenant_for_key(self, key: str) -> Tenant | None:
        return self.keys.get(hash_key(key))

    def is_admin_key(self, key: str) -> bool:
        return hash_key(key) in self.admin_keys


def hash_key(key: str) -> str:
    # a header that is not UTF-8 arrives with surrogates (aiohttp): such a key is wrong, never a 500
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def _key_hash(key: str) -> str:
    return key[len("sha256:") :].lower() if key.startswith("sha256:") else hash_key(key)


_PATHED = re.compile(r"^[A-Za-z_][\w.\[\]]*: ")
_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def interpolate(node: Any, env: dict[str, str], path: str, problems: list[str]) -> Any:
    """Substitute ``${VAR}`` and ``${VAR:-default}`` in every string of a YAML tree."""
    if isinstance(node, dict):
        return {k: interpolate(v, env, _join(path, str(k)), problems) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate(v, env, f"{path}[{i}]", problems) for i, v in enumerate(node)]
    if isinstance(node, str) and "${" in node:

        def sub(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(2)
            if name in env:
                return env[name]
            if default is not None:
                return default
            problems.append(f"{path}: environment variable {name} is not set (write ${{{name}:-default}})")
            return ""

        return _ENV.sub(sub, node)
    return node


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out = f"{out}[{part}]" if isinstance(part, int) else _join(out, str(part))
    return out


def compaction_binding(wm: WorkingMemorySettings | None) -> dict[str, Any] | None:
    """``working_memory.compaction`` sugar -> a context_manager binding."""
    if wm is None or wm.compaction is None:
        return None
    c = wm.compaction
    if c.strategy == "keep_recent":
        return {"type": "stack", "params": {"max_messages": c.max_messages} if c.max_messages is not None else {}}
    if c.strategy == "sliding_window":
        return {"type": "sliding-window",
                "params": {"window_size": c.window_size} if c.window_size is not None else {}}
    params: dict[str, Any] = {}
    if c.summary_threshold is not None:
        params["summary_threshold"] = c.summary_threshold
    if c.keep_turns is not None:
        params["keep_turns"] = c.keep_turns
    return {"type": "summarising", "params": params}


def read_yaml(text: str, name: str) -> tuple[Any, list[str]]:
    """One YAML document, and a problem per key written twice in one mapping (YAML would keep the last)."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, []
        duplicates = duplicate_keys(loader, node)
        return loader.construct_document(node), duplicates
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ConfigError([f"{name}: not valid YAML{where}: {getattr(exc, 'problem', exc)}"]) from None
    except RecursionError:
        raise ConfigError([f"{name}: nested too deeply to be a config"]) from None
    finally:
        loader.dispose()


def duplicate_keys(loader: yaml.SafeLoader, root: yaml.Node) -> list[str]:
    """One problem per key that appears twice in the same mapping, named by its key path and lines."""
    problems: list[tuple[int, str]] = []
    seen_nodes: set[int] = set()  # an alias repeats a node (or nests it in itself): walk each node once
    todo: list[tuple[str, yaml.Node]] = [("", root)]
    while todo:
        path, node = todo.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            todo.extend((f"{path}[{i}]", item) for i, item in enumerate(node.value))
        elif isinstance(node, yaml.MappingNode):
            first: dict[Any, int] = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: overriding merged keys is allowed
                    continue
                line = key_node.start_mark.line + 1
                if not isinstance(key_node, yaml.ScalarNode):  # a mapping as a key: the constructor refuses it
                    todo.append((_join(path, f"<key at line {line}>"), value_node))
                    continue
                key = loader.construct_object(key_node, deep=True)
                key_path = _join(path, str(key))
                if key in first:
                    problems.append((line, f"{key_path}: written twice (lines {first[key]} and {line}); "
                                           "YAML would silently keep the last"))
                else:
                    first[key] = line
                todo.append((key_path, value_node))
    return [problem for _, problem in sorted(problems)]


def unrouted_summarizer_models(
    settings: Settings, bindings: list[tuple[str, Binding | None]], tenant: TenantSettings | None = None,
    where: str = "",
) -> list[str]:
    """Summariser models that name no route: with ``allow_unknown_models: false`` every summary would fail."""
    if settings.allow_unknown_models:
        return []
    routes = {m.name for m in settings.models}
    named: list[tuple[str, str | None]] = [(_join(where, "summarizer_model"),
                                            (tenant or settings).summarizer_model)]
    for path, binding in bindings:
        summarizer = binding.summarizer if binding is not None else None
        if summarizer is not None and summarizer.type == "llm":
            named.append((f"{path}.params.summarizer.params.model", getattr(summarizer.params, "model", None)))
    return [f"{path}: {model!r} is not a configured model, and allow_unknown_models is false: "
            "every summary would fail" for path, model in named if model is not None and model not in routes]


def load_config(
    source: str | Path | dict[str, Any],
    env: dict[str, str] | None = None,
    registry: Registry | None = None,
) -> Config:
    """Read, substitute, validate and resolve a config file (or an already-parsed mapping)."""
    read_at = time.monotonic()
    env = dict(os.environ) if env is None else env
    registry = registry or default_registry()
    problems: list[str] = []
    name = "<memory>"
    if isinstance(source, dict):
        raw: Any = source
    else:
        name = str(source)
        try:
            text = Path(source).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError([f"{name}: cannot read: {exc.strerror or exc}"]) from None
        raw, problems = read_yaml(text, name)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError([f"{name}: the top level must be a mapping, got {type(raw).__name__}"])
    try:
        raw = interpolate(raw, env, "", problems)
    except RecursionError:  # an alias that contains itself
        raise ConfigError([f"{name}: nested too deeply to be a config (does an alias contain itself?)"]) from None
    try:
        settings = Settings.model_validate(raw)
    except ValidationError as exc:
        for err in exc.errors():
            path = _loc(tuple(err["loc"])) or "(top level)"
            msg = err["msg"].removeprefix("Value error, ")
            if not err["loc"] and _PATHED.match(msg):  # a cross-key check already names its key path
                problems.append(msg)
                continue
            problems.append(f"{path}: {msg}")
        raise ConfigError(problems) from None
    if problems:
        raise ConfigError(problems)

    def resolve(value: Any, path: str) -> Binding | None:
        try:
            return registry.resolve("context_manager", value, path)
        except BindingError as exc:
            problems.extend(f"{p}: {m}" for p, m in exc.problems)
            return None

    if settings.context_manager is not None:
        top = resolve(settings.context_manager, "context_manager")
        top_path = "context_manager"
    else:
        sugar = compaction_binding(settings.working_memory)
        top_path = "working_memory.compaction" if sugar else "context_manager"
        top = resolve(sugar or "summarising", top_path)
    problems.extend(unrouted_summarizer_models(settings, [(top_path, top)]))
    tenants = []
    keys: dict[str, Tenant] = {}
    for i, ts in enumerate(settings.tenants):
        binding = resolve(ts.context_manager, f"tenants[{i}].context_manager") if ts.context_manager else None
        tenant = Tenant(ts, binding)
        tenants.append(tenant)
        for key in ts.keys:
            h = _key_hash(key)
            if h in keys:
                problems.append(f"tenants[{i}].keys: a key is also used by tenant {keys[h].name!r}")
            keys[h] = tenant
        for m in ts.models or []:
            if not settings.allow_unknown_models and all(x.name != m for x in settings.models):
                problems.append(f"tenants[{i}].models: {m!r} is not a configured model")
        problems.extend(unrouted_summarizer_models(settings, [(f"tenants[{i}].context_manager", binding)], ts,
                                                   f"tenants[{i}]"))
    if problems or top is None:
        raise ConfigError(problems or ["context_manager: could not be resolved"])
    admin = frozenset(_key_hash(k) for k in settings.admin.keys)
    for i, key in enumerate(settings.admin.keys):
        if _key_hash(key) in keys:
            problems.append(f"admin.keys[{i}]: the same key is also a tenant's key ({keys[_key_hash(key)].name!r}); "
                            "an admin key must be separate")
    if problems:
        raise ConfigError(problems)
    return Config(settings, top, tenants, registry, name, keys, admin, read_at)
