"""Token estimates for images, audio and files, as providers bill them (never their base64 text).

These are documented estimates, the same on every wire:

- image: ``IMAGE_TOKENS`` (765, a 1024×1024 high-detail image on OpenAI; Claude bills
  about (w×h)/750, ~1,400 for 1024²) unless ``detail: low`` (``IMAGE_TOKENS_LOW``, 85).
- audio: ``AUDIO_TOKENS_PER_SECOND`` (10; OpenAI bills audio input at ~600 tokens a minute),
  the duration estimated from the decoded size at ``AUDIO_BYTES_PER_SECOND`` (16 kB/s, a
  128 kbit/s MP3; WAV at 32 kB/s). Smaller byte rates mean longer clips: the estimate errs high.
- file (PDF and other documents): ``FILE_PAGE_TOKENS`` (1,500: a page's text plus its page
  image) per ``FILE_PAGE_BYTES`` (30 kB) of decoded file, at least one page; a file sent by id
  (size unknown) counts ``FILE_UNKNOWN_TOKENS``.

The usage calibration (``proxy.store.calibration``) corrects the rest from the
provider's own counts.
"""

from __future__ import annotations

import math

IMAGE_TOKENS = 765
IMAGE_TOKENS_LOW = 85
AUDIO_TOKENS_PER_SECOND = 10
AUDIO_BYTES_PER_SECOND = {"wav": 32_000, "pcm16": 48_000}
AUDIO_DEFAULT_BYTES_PER_SECOND = 16_000
FILE_PAGE_BYTES = 30_000
FILE_PAGE_TOKENS = 1_500
FILE_UNKNOWN_TOKENS = 4 * FILE_PAGE_TOKENS


def decoded_size(data: str) -> int:
    """Bytes a base64 string (or a data URL) decodes to."""
    if data.startswith("data:") and "," in data:
        data = data.split(",", 1)[1]
    return len(data) * 3 // 4


def image_tokens(detail: object) -> int:
    return IMAGE_TOKENS_LOW if detail == "low" else IMAGE_TOKENS


def audio_tokens(data: str, audio_format: object = None) -> int:
    rate = AUDIO_BYTES_PER_SECOND.get(audio_format, AUDIO_DEFAULT_BYTES_PER_SECOND) \
        if isinstance(audio_format, str) else AUDIO_DEFAULT_BYTES_PER_SECOND
    return max(1, math.ceil(decoded_size(data) / rate * AUDIO_TOKENS_PER_SECOND))


def file_tokens(data: str | None) -> int:
    if not data:
        return FILE_UNKNOWN_TOKENS
    return max(1, math.ceil(decoded_size(data) / FILE_PAGE_BYTES)) * FILE_PAGE_TOKENS
