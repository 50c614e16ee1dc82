"""A request body's ``Content-Encoding``, decoded here rather than by aiohttp.

aiohttp decodes gzip and deflate itself, brotli and zstd only with optional libraries, and
answers any coding it cannot decode with its own plain-text 400 before a handler runs. The
server's runner turns its decoding off (``proxy.serve.server.make_runner``), so every body
comes through ``decode_body``: gzip (several members too) and deflate (zlib-wrapped or raw)
are inflated, never past the body limit (a small bomb is refused as too large, without
inflating it); any other coding is refused with 415 and ``Accept-Encoding`` in the
request's wire shape, the same on every install.
"""

from __future__ import annotations

import zlib

from proxy.core.errors import BadRequest, BodyTooLarge, UnsupportedEncoding

ACCEPTED = "gzip, deflate"
_GZIP = 16 + zlib.MAX_WBITS
_ZLIB = zlib.MAX_WBITS
_RAW_DEFLATE = -zlib.MAX_WBITS


def content_codings(values: list[str]) -> list[str]:
    """The codings of every ``Content-Encoding`` header, in the order they were applied; 415 for one not decoded."""
    codings = [c.strip().lower() for value in values for c in value.split(",")]
    out = [c for c in codings if c and c != "identity"]
    for coding in out:
        if coding not in ("gzip", "x-gzip", "deflate"):
            raise UnsupportedEncoding(
                f"The request body's Content-Encoding {coding[:40]!r} is not supported; send it uncompressed, or "
                f"with one of: {ACCEPTED}.", param="Content-Encoding", accepted=ACCEPTED)
    return out


def decode_body(raw: bytes, codings: list[str], limit: int) -> bytes:
    """``raw`` with its content codings undone (the last applied first), at most ``limit`` bytes (413 beyond)."""
    for coding in reversed(codings):
        if not raw:
            break
        raw = _inflate(raw, coding, limit)
    return raw


def _inflate(data: bytes, coding: str, limit: int) -> bytes:
    wbits = _GZIP if coding != "deflate" else _deflate_wbits(data)
    out = bytearray()
    try:
        while True:
            inflater = zlib.decompressobj(wbits)
            out += inflater.decompress(data, limit + 1 - len(out))
            if len(out) > limit or inflater.unconsumed_tail:
                raise BodyTooLarge(f"The request body is larger than the limit of {limit} bytes once decoded.")
            if not inflater.eof:
                raise _invalid(coding, "it ends before its compressed stream does")
            data = inflater.unused_data
            if not data or wbits != _GZIP:  # only gzip has members back to back
                break
    except zlib.error as exc:
        raise _invalid(coding, str(exc)) from None
    if data and wbits != _GZIP:
        raise _invalid(coding, "bytes follow its compressed stream")
    return bytes(out)


def _deflate_wbits(data: bytes) -> int:
    """RFC 9110's deflate is zlib-wrapped; some clients send raw deflate (aiohttp reads both, and so does this)."""
    return _ZLIB if data[0] & 0x0F == 8 else _RAW_DEFLATE


def _invalid(coding: str, why: str) -> BadRequest:
    return BadRequest(f"The request body is not valid {coding} ({why[:100]}).", param="Content-Encoding",
                      code="invalid_content_encoding")
