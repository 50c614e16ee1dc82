"""proxy.core.media: billed-token estimates for images (by size), audio and files (PDFs by page), never base64 text."""

from __future__ import annotations

import base64

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.core import media
from proxy.core.tokens import TokenCounter
from tests import media_files as mf
from tests.conftest import StartProxy, base_config
from tests.fake_upstream import FakeUpstream
from tests.outside import chat_body, post


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter("o200k_base")


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
def test_an_image_of_unknown_size(detail: object, tokens: int) -> None:
    """An image by URL or file id: OpenAI's documented default (1024² at high detail), 85 at low detail."""
    assert media.image_tokens(None, detail) == tokens
    assert media.image_tokens("https://example.com/cat.png", detail) == tokens


@pytest.mark.parametrize(("size", "tokens"), [
    ((1, 1), 85 + 170),  # one tile
    ((512, 512), 85 + 170),
    ((513, 512), 85 + 170 * 2),
    ((1024, 1024), 765),  # scaled to 768²: 2×2 tiles (OpenAI's worked example)
    ((2048, 4096), 85 + 170 * 6),  # fit in 2048² (1024×2048), short side to 768 (768×1536): 2×3 tiles
    ((4000, 3000), 765),  # 1024×768 after scaling: 2×2
    ((100, 5000), 85 + 170 * 4),  # 41×2048: the short side stays, 1×4 tiles
])
def test_openai_images_by_their_tiles(size: tuple[int, int], tokens: int) -> None:
    data = "data:image/png;base64," + mf.b64(mf.png(*size))
    assert media.image_tokens(data) == media.image_tokens(data, "high") == tokens
    assert media.image_tokens(data, "low") == 85


@pytest.mark.parametrize(("size", "tokens"), [
    ((1, 1), 1),  # no longer 1,600
    ((200, 200), 54),  # 40,000 / 750
    ((1000, 1000), 1334),
    ((1092, 1092), 1590),  # Anthropic's table: 1:1 at the largest unresized size
    ((4000, 4000), 1600),  # scaled down: at most 1,600
    ((3136, 1568), 1600),
    ((100, 5000), 66),  # long side to 1568: 31×1568
])
def test_claude_images_by_their_pixels(size: tuple[int, int], tokens: int) -> None:
    assert media.claude_image_tokens(mf.b64(mf.png(*size))) == tokens


@pytest.mark.parametrize("data", [None, "", "garbage", "iVBORw0KGgo=", "data:image/png;base64,"])
def test_an_image_whose_size_cannot_be_read_keeps_the_default(data: str | None) -> None:
    assert media.image_tokens(data) == media.IMAGE_TOKENS
    assert media.claude_image_tokens(data) == media.CLAUDE_IMAGE_TOKENS


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
    (b64(10), 1_500),  # not a PDF, not text: by size
    (b64(30_000), 1_500),
    (b64(30_003), 3_000),
    ("data:application/pdf;base64," + b64(90_000), 4_500),
    ("data:application/pdf;base64," + mf.b64(b"%PDF-1.7\n garbage without pages"), 1_500),
])
def test_files_that_are_not_readable_pdfs_count_by_size(counter: TokenCounter, data: str | None, tokens: int) -> None:
    assert media.file_tokens(counter, data) == tokens


def test_a_text_file_counts_as_its_text(counter: TokenCounter) -> None:
    text = mf.prose(400)
    assert media.file_tokens(counter, "data:text/plain;base64," + mf.b64(text.encode())) == counter.text(text)


@pytest.mark.parametrize("options", [{}, {"compress": False}, {"object_streams": True}])
def test_a_pdf_counts_its_text_and_a_page_image_per_page(counter: TokenCounter, options: dict[str, bool]) -> None:
    """28 pages of ~330 words: text plus 765 per page (OpenAI, high), 85 (low), 1,600 (Anthropic)."""
    pages = [mf.prose(330, i) for i in range(28)]
    data = "data:application/pdf;base64," + mf.b64(mf.pdf(pages, **options))
    text = counter.text("\n".join(pages) + "\n")
    assert media.file_tokens(counter, data) == text + 28 * 765
    assert media.file_tokens(counter, data, media.OPENAI, "low") == text + 28 * 85
    assert media.file_tokens(counter, data.split(",", 1)[1], media.ANTHROPIC) == text + 28 * 1_600
    # the reviewer's 28-page, 27 KB PDF counted 1,512: by its size, one page
    assert media.file_tokens(counter, data) > 10 * 1_512


def test_constants_are_the_documented_ones() -> None:
    assert (media.IMAGE_TOKENS, media.IMAGE_TOKENS_LOW, media.CLAUDE_IMAGE_TOKENS) == (765, 85, 1_600)
    assert (media.OPENAI_PAGE_TOKENS, media.OPENAI_PAGE_TOKENS_LOW, media.CLAUDE_PAGE_TOKENS) == (765, 85, 1_600)
    assert media.AUDIO_TOKENS_PER_SECOND == 10
    assert media.FILE_UNKNOWN_TOKENS == 4 * media.FILE_PAGE_TOKENS == 6_000


def noise_b64(n_bytes: int, seed: int) -> str:
    """Base64 of ``n_bytes`` that do not compress (the size a client really sends)."""
    return base64.b64encode(bytes((i * 131 + seed * 7 + (i >> 8) * 17) % 256 for i in range(n_bytes))).decode()


AUDIO_MODEL = {"name": "gpt-4o-audio-preview", "context_window": 128000, "max_output_tokens": 16384}


@pytest.mark.usefixtures("shared_model_map")
async def test_audio_part_counted_as_billed_not_as_base64(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """A 320 KB input_audio part is forwarded and counted as audio (well below its base64 text)."""
    proxy = await start_proxy(base_config(upstream.base_url, models=[AUDIO_MODEL]))
    data = noise_b64(240_000, 7)  # 320 KB of base64: ~5 s of 24 kHz 16-bit mono audio
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "What is said here?"},
        {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}]}]
    status, headers, body = await post(proxy, chat_body(messages, "gpt-4o-audio-preview"))
    assert status == 200, body
    # providers bill audio by duration (OpenAI: on the order of 10 tokens per second), never by its base64:
    # whatever documented estimate the fix picks, it is far below the ~290k tokens of the base64 text
    assert int(headers["x-ctxproxy-tokens-in"]) < 20_000
    # and it is counted, at the documented estimate (proxy/core/media.py): 240 kB of WAV at 32 kB/s is
    # 7.5 s, at 10 tokens a second 75 tokens, plus the text
    assert 75 <= int(headers["x-ctxproxy-tokens-in"]) < 200


@pytest.mark.usefixtures("shared_model_map")
async def test_file_part_counted_as_billed_not_as_base64(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """A 300 KB file (PDF) part is forwarded and counted well below its base64 text."""
    proxy = await start_proxy(base_config(upstream.base_url, models=[AUDIO_MODEL]))
    data = noise_b64(225_000, 8)  # 300 KB of base64
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "Summarise the attached report."},
        {"type": "file", "file": {"filename": "report.pdf", "file_data": "data:application/pdf;base64," + data}}]}]
    status, headers, body = await post(proxy, chat_body(messages, "gpt-4o-audio-preview"))
    assert status == 200, body
    # a PDF is billed as its extracted text plus an image per page; any documented estimate from its size or
    # pages stays far below the ~273k tokens its base64 text would count (intent: < a quarter of that)
    assert int(headers["x-ctxproxy-tokens-in"]) < 60_000
    # and it is counted, at the documented estimate: 225 kB decoded is 8 pages of 30 kB at 1,500 tokens each
    assert 12_000 <= int(headers["x-ctxproxy-tokens-in"]) < 12_200
