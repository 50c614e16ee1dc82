"""Recovering from the provider's refusal for length: learn its window and ratio, re-assemble once, retry once.

When the configured or mapped window is larger than the provider's real one, or calibration had not yet
seen the provider count a mix of content as high as this one, the provider refuses the payload for its
length (``proxy.core.refusal`` reads every provider's words). Such a refusal comes before any byte of an
answer (``Provider.send`` raises it; a stream that began is never retried), so the client has received
nothing yet and the proxy still has everything it needs:

1. ``learn``: the refusal is a calibration sample (the provider's stated count over the proxy's, or the
   bound its window gives: ``proxy.store.calibration``), and it teaches the provider's real window, kept
   for the model route (``proxy.store.windows``: shared by replicas, kept over restarts) so later requests
   fit the first time. The window is the one the provider states; where it states only its count and the
   excess (Ollama), its count less the excess; where it states only the excess, the proxy's calibrated count
   of the refused payload less the excess (``estimated``); where it states no number (the Responses API's
   "Your input exceeds the context window of this model", Ollama's older wording), a documented step
   (``stepped``): ``STEP`` (3/4) of the smaller of the window in effect and what the refused request asked
   for (its input as the proxy counts it, calibrated, plus its completion reserve): the retry's payload is
   then at least a quarter smaller.
2. ``recover``: the request is assembled again (the whole pipeline: a summary, if the tightened budget
   needs one, follows the normal path) and sent once more, never more than once per request. A retry that
   would send no fewer tokens (a request whose history the provider holds: ``previous_response_id``) is not
   made, nor one in observe mode (the client's payload is forwarded as sent: the refusal is learned from,
   so enforce's budget would fit, and relayed). The client then gets the answer with a warning in ``x-ctxproxy-warning`` and the retry's figures in
   the other ``x-ctxproxy-*`` headers; or, when the retry is refused again or fails, its error.

Every refusal is counted (``ctxproxy_overflow_recovered_total`` / ``ctxproxy_overflow_failed_total``,
tenant and model) and logged (one warning line, and ``overflow`` in the request's log line).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from proxy.core.errors import UpstreamStatus
from proxy.core.refusal import Refusal, length_refusal
from proxy.pipeline import Assembly
from proxy.store.calibration import hidden_input
from proxy.store.windows import MIN_WINDOW

if TYPE_CHECKING:
    from proxy.policy import ModelRoute
    from proxy.serve.scope import Scope
    from proxy.upstream.base import Answer

log = logging.getLogger("ctxproxy")

STEP = 0.75  # where a refusal states no number: the window is taken as 3/4 of what the refused request asked for


@dataclass(frozen=True)
class Lesson:
    """What one refusal taught: the provider's window now in effect for the route and how it was found
    (``stated``, ``estimated``, ``stepped``; None: nothing new about the window)."""

    window: int
    source: str | None
    detail: str  # the refusal's numbers, in words, for the warning and the log


def refusal_of(exc: UpstreamStatus) -> Refusal | None:
    """The refusal for length in an upstream's error: read from its own body, else from the OpenAI-shaped one."""
    return length_refusal(exc.status, exc.raw) or length_refusal(exc.status, exc.body)


def learn(scope: Scope, route: ModelRoute, assembly: Assembly, refusal: Refusal) -> Lesson:
    """Take one refusal as a calibration sample and as the provider's window for the route."""
    st, report = scope.state, assembly.report
    hidden = hidden_input(assembly.body)
    window_in_effect = report.window or route.window
    sent = assembly.forwarded_tokens  # the refused payload as the proxy counts it (observe: the client's)
    sample = st.shared.calibration.refused(scope.tenant_name, route.upstream, route.upstream_model,
                                           refusal.input_tokens, refusal.limit or window_in_effect, sent, hidden)
    st.metrics.calibration_sample(route.upstream_model, sample, None, sent, report.calibration)
    scope.record.refusal = refusal
    limit, source = _window(refusal, sent, report.calibration, report.reserve, window_in_effect)
    if limit < MIN_WINDOW or (source != "stated" and (hidden is not None or report.unmanaged is not None)):
        # not believed; or the proxy's count of a payload whose history the provider holds, which says nothing
        # about the provider's window
        return Lesson(window_in_effect, None, _detail(refusal))
    window = st.shared.calibration.learn_window(route.upstream, route.upstream_model, limit, route.window, source)
    return Lesson(window, source, _detail(refusal))


def _window(refusal: Refusal, tokens: int, factor: float, reserve: int, in_effect: int) -> tuple[int, str]:
    """The provider's window as a refusal gives it, and how it was found."""
    if refusal.limit is not None:
        return refusal.limit, "stated"
    if refusal.excess is not None and refusal.input_tokens is not None:
        return refusal.input_tokens - refusal.excess, "stated"
    asked = math.ceil(tokens * max(factor, 0.0)) + reserve
    if refusal.excess is not None:
        return asked - reserve - refusal.excess, "estimated"
    return int(STEP * min(in_effect, asked)), "stepped"


def _detail(refusal: Refusal) -> str:
    said = [f"its window: {refusal.limit} tokens" if refusal.limit is not None else "",
            f"its count of the input: {refusal.input_tokens}" if refusal.input_tokens is not None else "",
            f"{refusal.excess} tokens over" if refusal.excess is not None else ""]
    return ", ".join(s for s in said if s) or "no numbers given"


Reassemble = Callable[[], Awaitable[Assembly]]
Send = Callable[[Assembly], Awaitable["Answer"]]


async def recover(scope: Scope, exc: UpstreamStatus, route: ModelRoute, refused: Assembly, reassemble: Reassemble,
                  send: Send) -> tuple[Assembly, Answer]:
    """After the provider refused ``refused`` (``exc``, raised again when it is not a refusal for length or the
    request cannot be recovered): learn, assemble again within what the refusal taught, and send once more."""
    refusal = refusal_of(exc)
    if refusal is None:
        raise exc
    lesson = learn(scope, route, refused, refusal)
    tenant = scope.tenant_name
    retry = await _reassembled(scope, route, refused, reassemble, lesson)
    if retry is None:
        _failed(scope, route, lesson, "observe mode forwards the client's payload as sent"
                if refused.report.mode == "observe" else "nothing smaller to send")
        raise exc
    retry.report.warnings.append(
        f"the provider refused the request for its length ({lesson.detail}); it was assembled again within "
        f"{retry.report.hard_budget} tokens (window {retry.report.window}) and sent once more")
    try:
        answer = await send(retry)
    except UpstreamStatus as again:
        second = refusal_of(again)
        if second is not None:
            learn(scope, route, retry, second)  # evidence all the same, for the next request
        _failed(scope, route, lesson, "refused again" if second is not None else f"the retry failed ({again.status})")
        raise
    except asyncio.CancelledError:
        raise  # the client went away: nothing failed
    except Exception:
        _failed(scope, route, lesson, "the retry failed")
        raise
    scope.state.metrics.overflow(tenant, route.name, recovered=True)
    scope.record.overflow, scope.record.refusal = "recovered", None  # the answer's usage is the next sample
    log.warning("request %s: the provider refused %d tokens of %s for length (%s); recovered with %d tokens "
                "(window %d, %s)", scope.request_id, refused.report.tokens_after, route.name[:100], lesson.detail,
                retry.report.tokens_after, retry.report.window, lesson.source or "unchanged")
    return retry, answer


async def _reassembled(scope: Scope, route: ModelRoute, refused: Assembly, reassemble: Reassemble,
                       lesson: Lesson) -> Assembly | None:
    """The request assembled again, or None when that would not send fewer tokens."""
    if refused.report.unmanaged is not None or refused.report.mode == "observe":
        return None  # forwarded as sent (observe mode never changes the client's payload): nothing smaller to send
    try:
        retry = await reassemble()
    except Exception:
        _failed(scope, route, lesson, "it does not fit the provider's window")
        raise
    return retry if retry.forwarded_tokens < refused.forwarded_tokens else None


def _failed(scope: Scope, route: ModelRoute, lesson: Lesson, why: str) -> None:
    scope.state.metrics.overflow(scope.tenant_name, route.name, recovered=False)
    scope.record.overflow = "failed"
    log.warning("request %s: the provider refused it for length (%s); not recovered: %s", scope.request_id,
                lesson.detail, why)
