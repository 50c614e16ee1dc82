"""Where to point a client at a config about to be served (``ctxproxy where``; ``make run`` prints it first).

Read from the config alone, so it says what ``ctxproxy serve --config`` of the same file will listen on:
the base URL of each wire family, every upstream with the models it takes and whose key goes to it, and
whether the proxy runs open or keyed by tenants. It never prints a key.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

from proxy.settings import Config, UpstreamSettings

# a wildcard bind is reached locally on loopback
LOCAL = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}
# the client families: their base URL variable, the path it ends with, and who reads it
FAMILIES = (
    ("OPENAI_BASE_URL", "/v1", "Chat Completions and Responses: openai SDK, Codex CLI, LangChain"),
    ("ANTHROPIC_BASE_URL", "", "Messages: anthropic SDK, Claude Code"),
)


def where(config: Config) -> list[str]:
    """The lines ``ctxproxy where`` prints."""
    s = config.settings
    bound = s.server.host
    host = LOCAL.get(bound, bound)
    host = f"[{host}]" if ":" in host else host
    port = str(s.server.port) if s.server.port else "<a free port, chosen at start>"
    root = f"http://{host}:{port}"
    elsewhere = (
        "" if bound == host else f" (bound to {bound or 'all interfaces'}: from elsewhere, use this host's address)"
    )
    lines = [f"ctxproxy: point a client at {root}{elsewhere}"]
    width = max(len(variable) for variable, _, _ in FAMILIES) + len(root) + 4
    for variable, path, readers in FAMILIES:
        lines.append(f"  {f'{variable}={root}{path}':<{width}}  {readers}")
    lines.append(f"  config    {config.source}")
    for name, upstream in s.upstreams.items():
        lines.append(f"  upstream  {name}: {_shown(upstream.base_url)} ({_takes(config, name, upstream)}; "
                     f"{_key(config, upstream)})")
    lines.append(f"  access    {_access(config)}")
    return lines


def _takes(config: Config, name: str, upstream: UpstreamSettings) -> str:
    """Which models reach an upstream: its patterns, the routes naming it, and every other name if it is the default."""
    named = [m.name for m in config.settings.models if m.upstream == name]
    takes = "models " + ", ".join([*upstream.models, *named]) if upstream.models or named else ""
    if name != config.default_upstream:
        return takes or "no model routes here"
    if not takes and len(config.settings.upstreams) == 1:
        return "every model"
    return f"{takes} and every other model" if takes else "the default: every other model"


def _key(config: Config, upstream: UpstreamSettings) -> str:
    if upstream.api_key:
        return "the configured key is sent"
    if config.forwards_client_auth(upstream):
        return "the client's own key is forwarded"
    return "no key is configured: the upstream will refuse"


def _access(config: Config) -> str:
    if config.tenants:
        names = ", ".join(t.name for t in config.tenants)
        return (f"keyed: {len(config.tenants)} tenant(s) ({names}); a client sends its tenant's proxy key as its "
                "API key, never sent upstream")
    return "open: no tenants; any client may call, with its own key where no upstream key is configured"


def _shown(url: str) -> str:
    """A URL as printed: its credentials, if it carries any, blanked."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    netloc = "***@" + parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=netloc))
