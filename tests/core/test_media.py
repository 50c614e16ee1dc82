"""proxy.core.media: billed-token estimates for images, audio and files (never their base64 text)."""

from __future__ import annotations

import base64

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.core import media


def b64(n: int) -> str:
    """Unpadded base64 text that decodes to ``n`` bytes."""
    return "A" * -(-4 * n // 3)


@pytest.mark.parametrize(("data", "size"), [
    (b64(3), 3),
    (base64.b64encode(b"x").decode(), 3),  # padding counts: the estimate errs high
    (b64(30_000), 30_000),
    ("data:audio/wav;base64," + b64(300), 300),
    ("", 0),
    ("data:nocomma", len("data:nocomma") * 3 // 4),
])
def test_decoded_size(data: str, size: int) -> None:
    assert media.decoded_size(data) == size


@given(st.binary(max_size=3000))
def test_decoded_size_matches_real_decoding_within_padding(raw: bytes) -> None:
    encoded = base64.b64encode(raw).decode()
    assert len(raw) <= media.decoded_size(encoded) <= len(raw) + 2


@pytest.mark.parametrize(("detail", "tokens"), [
    ("low", 85), ("high", 765), ("auto", 765), (None, 765), ("LOW", 765), (0, 765), (["low"], 765),
])
def test_image_tokens(detail: object, tokens: int) -> None:
    assert media.image_tokens(detail) == tokens


@pytest.mark.parametrize(("size", "fmt", "tokens"), [
    (16_000, "mp3", 10),  # one second at the default 16 kB/s
    (32_000, "wav", 10),  # WAV: 32 kB/s
    (48_000, "pcm16", 10),
    (160_000, None, 100),
    (16_000, 7, 10),  # a non-string format: the default rate
    (1, "mp3", 1),  # at least one token
    (0, "wav", 1),
    (16_001, "mp3", 11),  # rounded up
])
def test_audio_tokens(size: int, fmt: object, tokens: int) -> None:
    assert media.audio_tokens(b64(size), fmt) == tokens


def test_audio_is_billed_by_duration_not_by_its_base64_text() -> None:
    minute = b64(16_000 * 60)
    assert media.audio_tokens(minute, "mp3") == 600  # OpenAI bills about 600 tokens a minute
    assert media.audio_tokens("data:audio/mp3;base64," + minute, "mp3") == 600


@pytest.mark.parametrize(("data", "tokens"), [
    (None, media.FILE_UNKNOWN_TOKENS),
    ("", media.FILE_UNKNOWN_TOKENS),
    (b64(10), 1_500),
    (b64(30_000), 1_500),
    (b64(30_003), 3_000),
    ("data:application/pdf;base64," + b64(90_000), 4_500),
])
def test_file_tokens(data: str | None, tokens: int) -> None:
    assert media.file_tokens(data) == tokens


def test_constants_are_the_documented_ones() -> None:
    assert (media.IMAGE_TOKENS, media.IMAGE_TOKENS_LOW) == (765, 85)
    assert media.AUDIO_TOKENS_PER_SECOND == 10
    assert media.FILE_UNKNOWN_TOKENS == 4 * media.FILE_PAGE_TOKENS == 6_000
