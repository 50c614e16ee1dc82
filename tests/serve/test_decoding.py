"""proxy.serve.decoding: a request body's Content-Encoding, decoded within the body limit or refused."""

from __future__ import annotations

import gzip
import zlib

import pytest

from proxy.core.errors import BadRequest, BodyTooLarge, UnsupportedEncoding
from proxy.serve.decoding import ACCEPTED, content_codings, decode_body

BODY = b'{"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "' + b"hello " * 500 + b'"}]}'


def raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return packer.compress(data) + packer.flush()


@pytest.mark.parametrize(("values", "codings"), [
    ([], []),
    (["identity"], []),
    (["gzip"], ["gzip"]),
    (["GZip "], ["gzip"]),
    (["x-gzip"], ["x-gzip"]),
    (["deflate, gzip"], ["deflate", "gzip"]),
    (["deflate", "gzip"], ["deflate", "gzip"]),
    (["identity, gzip"], ["gzip"]),
    ([""], []),
])
def test_content_codings(values: list[str], codings: list[str]) -> None:
    assert content_codings(values) == codings


@pytest.mark.parametrize("value", ["br", "zstd", "compress", "x-compress", "gzip, br", "snappy", "deflate, zstd"])
def test_codings_it_does_not_decode_are_415_with_accept_encoding(value: str) -> None:
    with pytest.raises(UnsupportedEncoding) as caught:
        content_codings([value])
    assert caught.value.status == 415 and caught.value.code == "unsupported_content_encoding"
    assert caught.value.headers == {"Accept-Encoding": ACCEPTED}


@pytest.mark.parametrize(("encoded", "codings"), [
    (gzip.compress(BODY), ["gzip"]),
    (gzip.compress(BODY[:100]) + gzip.compress(BODY[100:]), ["gzip"]),  # two members back to back
    (zlib.compress(BODY), ["deflate"]),
    (raw_deflate(BODY), ["deflate"]),
    (gzip.compress(zlib.compress(BODY)), ["deflate", "gzip"]),
    (BODY, []),
    (b"", ["gzip"]),
])
def test_decode_body(encoded: bytes, codings: list[str]) -> None:
    assert decode_body(encoded, codings, len(BODY)) == (BODY if encoded else b"")


def test_a_body_over_the_limit_once_decoded_is_too_large_without_inflating_it_all() -> None:
    bomb = gzip.compress(b"0" * (4 << 20)) * 64  # 256 MiB inflated
    with pytest.raises(BodyTooLarge):
        decode_body(bomb, ["gzip"], 1 << 20)
    with pytest.raises(BodyTooLarge):
        decode_body(gzip.compress(BODY), ["gzip"], len(BODY) - 1)
    assert decode_body(gzip.compress(BODY), ["gzip"], len(BODY)) == BODY


@pytest.mark.parametrize(("encoded", "coding"), [
    (b"not compressed at all", "gzip"),
    (gzip.compress(BODY)[:-20], "gzip"),  # cut short
    (gzip.compress(BODY) + b"trailing", "gzip"),
    (zlib.compress(BODY) + b"trailing", "deflate"),
    (b"\x78\x9c garbage", "deflate"),
])
def test_invalid_compressed_bodies_are_400(encoded: bytes, coding: str) -> None:
    with pytest.raises(BadRequest) as caught:
        decode_body(encoded, [coding], 1 << 20)
    assert caught.value.code == "invalid_content_encoding"
