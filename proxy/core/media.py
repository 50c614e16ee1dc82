"""Token estimates for images, audio and files, as providers bill them (never their base64 text).

Two billing formulas, chosen by the wire: Chat Completions and Responses bodies follow OpenAI's
(``OPENAI``), Messages bodies Anthropic's (``ANTHROPIC``). A provider behind a wire that bills otherwise
(a Claude model behind an OpenAI-compatible gateway, a local vision model) is corrected by the usage
calibration (``proxy.store.calibration``), like its text.

- **image** (its width and height read from the header of its base64, ``proxy.core.imagesize``):
  - OpenAI (GPT-4o/4.1/o-series "Calculating costs"): ``detail: low`` is 85; otherwise the image is
    scaled to fit 2048×2048, then its shorter side to 768, and costs 85 + 170 per 512-px tile. A size
    that cannot be read (an image by URL or file id, an unknown format) counts ``IMAGE_TOKENS`` (765, a
    1024×1024 image at high detail; ``auto`` is priced as high).
  - Anthropic (vision guide, "Calculate image costs"): about width×height / 750 after scaling to fit
    1568 px on the long side and ~1.15-1.19 megapixels, so at most ``CLAUDE_IMAGE_TOKENS`` (1,600), which
    is also the count of an image whose size cannot be read. A 1×1 image is 1 token.
- **audio**: ``AUDIO_TOKENS_PER_SECOND`` (10; OpenAI bills audio input at ~600 tokens a minute), the
  duration estimated from the decoded size at ``AUDIO_BYTES_PER_SECOND`` (16 kB/s, a 128 kbit/s MP3;
  WAV at 32 kB/s). Smaller byte rates mean longer clips: the estimate errs high.
- **PDF** (its pages and text read by ``proxy.core.pdf``): both providers put the extracted text and
  an image of every page in the model's context (OpenAI "File inputs": "both the extracted text and an
  image of each page"; Anthropic "PDF support": text plus each page converted to an image, priced as an
  image). So: the extracted text's tokens (glyphs without a text encoding, and text beyond the first 2 M
  characters, at ``GLYPHS_PER_TOKEN`` a token) plus,
  per page, a page image: OpenAI ``OPENAI_PAGE_TOKENS`` (765, a letter page at high detail: 2×2 tiles
  after the 768-px scaling; 85 with ``detail: low``), Anthropic ``CLAUDE_PAGE_TOKENS`` (1,600: a rendered
  page reaches the image cap; a one-page scan bills ~1,600 on Claude).
- **other files**: a file that decodes as UTF-8 text is counted as its text (Responses extracts the
  text of text documents); any other (an Office document, a PDF whose pages cannot be found) is
  ``FILE_PAGE_TOKENS`` (1,500) per ``FILE_PAGE_BYTES`` (30 kB) of decoded file, at least one page; a file
  sent by id or URL (content unknown) counts ``FILE_UNKNOWN_TOKENS``.

Every figure is computed once per item: the wires' counts are cached per content key
(``proxy.core.tokens.TokenCounter.cached``).
"""

from __future__ import annotations

import binascii
import math

from proxy.core import imagesize, pdf
from proxy.core.tokens import TokenCounter

OPENAI, ANTHROPIC = "openai", "anthropic"

IMAGE_TOKENS = 765
IMAGE_TOKENS_LOW = 85
OPENAI_BASE_TOKENS, OPENAI_TILE_TOKENS, OPENAI_TILE = 85, 170, 512
OPENAI_FIT, OPENAI_SHORT_SIDE = 2048, 768
CLAUDE_IMAGE_TOKENS = 1_600
CLAUDE_PIXELS_PER_TOKEN, CLAUDE_LONG_SIDE = 750, 1568

AUDIO_TOKENS_PER_SECOND = 10
AUDIO_BYTES_PER_SECOND = {"wav": 32_000, "pcm16": 48_000}
AUDIO_DEFAULT_BYTES_PER_SECOND = 16_000

OPENAI_PAGE_TOKENS, OPENAI_PAGE_TOKENS_LOW = 765, 85
CLAUDE_PAGE_TOKENS = 1_600
GLYPHS_PER_TOKEN = 4
FILE_PAGE_BYTES = 30_000
FILE_PAGE_TOKENS = 1_500
FILE_UNKNOWN_TOKENS = 4 * FILE_PAGE_TOKENS


def decoded_size(data: str) -> int:
    """Bytes a base64 string (or a data URL) decodes to."""
    if data.startswith("data:") and "," in data:
        data = data.split(",", 1)[1]
    return len(data) * 3 // 4


def decoded(data: str) -> bytes:
    """The bytes of a base64 string or data URL (characters outside the alphabet skipped; garbage: b"")."""
    if data.startswith("data:"):
        data = data.split(",", 1)[1] if "," in data else ""
    for text in (data, "".join(data.split())):  # the second try: base64 wrapped in lines
        text = text.rstrip("=")
        try:
            return binascii.a2b_base64(text + "=" * (-len(text) % 4))
        except (binascii.Error, ValueError):
            continue
    return b""


# -- images --------------------------------------------------------------------------------------------


def image_tokens(data: str | None = None, detail: object = None) -> int:
    """An image on the OpenAI wires: tiles of its scaled size, 85 at ``detail: low``, 765 when its size is unknown."""
    if detail == "low":
        return IMAGE_TOKENS_LOW
    size = imagesize.dimensions(data) if data else None
    if size is None:
        return IMAGE_TOKENS
    width, height = (float(side) for side in size)
    fit = min(1.0, OPENAI_FIT / max(width, height))
    width, height = width * fit, height * fit
    short = min(1.0, OPENAI_SHORT_SIDE / min(width, height))
    width, height = width * short, height * short
    tiles = math.ceil(width / OPENAI_TILE) * math.ceil(height / OPENAI_TILE)
    return OPENAI_BASE_TOKENS + OPENAI_TILE_TOKENS * tiles


def claude_image_tokens(data: str | None = None) -> int:
    """An image on the Messages wire: width×height/750 after Claude's resizing, at most 1,600; 1,600 when unknown."""
    size = imagesize.dimensions(data) if data else None
    if size is None:
        return CLAUDE_IMAGE_TOKENS
    width, height = size
    scale = min(1.0, CLAUDE_LONG_SIDE / max(width, height))
    pixels = (width * scale) * (height * scale)
    return max(1, min(CLAUDE_IMAGE_TOKENS, math.ceil(pixels / CLAUDE_PIXELS_PER_TOKEN)))


# -- audio ---------------------------------------------------------------------------------------------


def audio_tokens(data: str, audio_format: object = None) -> int:
    rate = AUDIO_BYTES_PER_SECOND.get(audio_format, AUDIO_DEFAULT_BYTES_PER_SECOND) \
        if isinstance(audio_format, str) else AUDIO_DEFAULT_BYTES_PER_SECOND
    return max(1, math.ceil(decoded_size(data) / rate * AUDIO_TOKENS_PER_SECOND))


# -- files ---------------------------------------------------------------------------------------------


def file_tokens(counter: TokenCounter, data: str | None, provider: str = OPENAI, detail: object = None) -> int:
    """A file sent inline (base64 or a data URL): a PDF per page, a text file as its text, else by size."""
    if not data:
        return FILE_UNKNOWN_TOKENS
    raw = decoded(data)
    if pdf.is_pdf(raw):
        shown = pdf.read_pdf(raw)
        if shown is not None:
            page = CLAUDE_PAGE_TOKENS if provider == ANTHROPIC \
                else OPENAI_PAGE_TOKENS_LOW if detail == "low" else OPENAI_PAGE_TOKENS
            text = counter.text(shown.text) if shown.text else 0
            unread = math.ceil((shown.glyphs + shown.more_chars) / GLYPHS_PER_TOKEN)
            return text + unread + shown.pages * page
    elif raw and b"\x00" not in raw:
        try:
            return max(1, counter.text(raw.decode("utf-8")))
        except UnicodeDecodeError:
            pass
    return max(1, math.ceil(decoded_size(data) / FILE_PAGE_BYTES)) * FILE_PAGE_TOKENS
