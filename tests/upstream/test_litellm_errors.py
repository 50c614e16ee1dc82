"""proxy.upstream.litellm_errors: litellm's exceptions mapped by what happened, not by the status litellm chose.

litellm calls a refused connection and a missing key "InternalServerError" with status 500; the exceptions
it was raised from tell them apart. These are litellm's own exception types, built as litellm builds them.
"""

from __future__ import annotations

from typing import Any

import pytest

from proxy.core.errors import UpstreamError, UpstreamStatus, UpstreamTimeout, UpstreamUnreachable
from proxy.settings import UpstreamSettings
from proxy.upstream.litellm_errors import answer_headers, upstream_error

litellm = pytest.importorskip("litellm")
pytestmark = pytest.mark.filterwarnings("ignore:.*ReadOnly.*:UserWarning")

UPSTREAM = UpstreamSettings(base_url="https://api.example.com/v1", api_key="sk-operator-key")


def raised_from(exc: BaseException, cause: BaseException | None) -> BaseException:
    exc.__cause__ = cause
    return exc


def server_error(message: str) -> Any:
    return litellm.InternalServerError(message, llm_provider="openai", model="gpt-4o-mini")


def test_a_refused_connection_is_unreachable_whatever_status_litellm_gave_it() -> None:
    exc = raised_from(server_error("Connection error."), ConnectionRefusedError(111, "Connection refused"))
    err = upstream_error(exc, UPSTREAM)
    assert isinstance(err, UpstreamUnreachable) and err.status == 502
    assert "ConnectionRefusedError" in err.message


def test_a_timeout_anywhere_in_the_chain_is_a_504() -> None:
    assert isinstance(upstream_error(litellm.Timeout("Request timed out", model="m", llm_provider="openai"), None),
                      UpstreamTimeout)
    wrapped = raised_from(server_error("boom"), TimeoutError())
    assert upstream_error(wrapped, None).status == 504


def test_a_500_the_provider_never_sent_is_the_gateways_502() -> None:
    """litellm answers 500 for a call it could not even make (here: no key); the provider answered nothing."""
    err = upstream_error(server_error("Missing credentials. Please pass an `api_key`"), None)
    assert type(err) is UpstreamError and err.status == 502 and err.code == "upstream_error"


def test_a_provider_answer_keeps_its_status_message_and_rate_limit_headers_only() -> None:
    exc = litellm.RateLimitError("AnthropicException - " + '{"type":"error","error":{"type":"rate_limit_error",'
                                 '"message":"slow down, sk-operator-key"}}', llm_provider="anthropic", model="c")
    exc.litellm_response_headers = {"retry-after": "7", "anthropic-ratelimit-tokens-remaining": "0",
                                    "content-type": "application/json", "content-length": "80",
                                    "set-cookie": "a=b", "connection": "close"}
    err = upstream_error(exc, UPSTREAM)
    assert isinstance(err, UpstreamStatus) and err.status == 429
    assert err.headers == {"retry-after": "7", "anthropic-ratelimit-tokens-remaining": "0"}
    assert err.body["error"] == {"message": "slow down, [redacted]", "type": "rate_limit_error", "param": None,
                                 "code": None}


def test_anything_else_is_a_502_without_its_traceback() -> None:
    err = upstream_error(RuntimeError("Traceback (most recent call last):\n  File x"), UPSTREAM)
    assert err.status == 502 and "Traceback" not in err.message


def test_a_results_provider_headers_are_read_from_litellms_hidden_params() -> None:
    class Result:
        def __init__(self) -> None:
            self._hidden_params = {"additional_headers": {"llm_provider-x-ratelimit-remaining-requests": "9",
                                                          "llm_provider-content-type": "application/json",
                                                          "x-litellm-own": "1"}}

    assert dict(answer_headers(Result())) == {"x-ratelimit-remaining-requests": "9"}
    assert dict(answer_headers(object())) == {}


def test_a_context_window_refusal_is_one_whatever_the_providers_words() -> None:
    """Bedrock says "Input is too long for requested model"; litellm knows it is a context-window refusal."""
    from proxy.core.refusal import length_refusal

    exc = litellm.ContextWindowExceededError("Input is too long for requested model.", model="m",
                                             llm_provider="bedrock")
    err = upstream_error(exc, UPSTREAM)
    assert isinstance(err, UpstreamStatus) and err.status == 400
    assert err.body["error"]["code"] == "context_length_exceeded"
    assert length_refusal(err.status, err.body) is not None
