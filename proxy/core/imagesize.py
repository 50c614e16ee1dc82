"""An image's width and height from the first bytes of its base64 (PNG, JPEG, GIF, WebP), or None.

Only the header is decoded: a PNG, GIF or WebP states its size in its first 30 bytes; a JPEG in its
first SOF segment, reached by skipping the segments before it (each states its length), so at most
``JPEG_MAX_SEGMENTS`` short reads. Anything else (another format, a truncated or garbled header, a size
of 0 or beyond ``MAX_SIDE``) is None, and the caller keeps its documented default.
"""

from __future__ import annotations

import binascii
import re
import struct

MAX_SIDE = 1 << 16  # no provider takes a larger side; a header claiming more is garbage
JPEG_MAX_SEGMENTS = 64
# JPEG start-of-frame markers (baseline, progressive, lossless, arithmetic ...): not DHT, JPG, DAC
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")
_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})


class Base64Reader:
    """Random access to the bytes a base64 string encodes, decoding only the 4-character groups asked for."""

    def __init__(self, data: str) -> None:
        if data.startswith("data:"):
            comma = data.find(",", 0, 256)
            data = data[comma + 1:] if comma >= 0 else ""
        if "\n" in data[:80] or "\r" in data[:80]:  # MIME-style wrapped lines: offsets need the bare text
            data = "".join(data.split())
        self.data = data

    def read(self, offset: int, n: int) -> bytes:
        """``n`` bytes at ``offset`` (fewer at the end, or on garbage: none)."""
        start = offset // 3 * 4
        stop = -(-(offset + n) // 3) * 4
        chunk = self.data[start:stop]
        if not chunk or not _BASE64.fullmatch(chunk):
            return b""
        try:
            raw = binascii.a2b_base64(chunk + "=" * (-len(chunk) % 4))
        except (binascii.Error, ValueError):
            return b""
        skip = offset - start // 4 * 3
        return raw[skip:skip + n]


def dimensions(data: str) -> tuple[int, int] | None:
    """(width, height) of a base64 image (a data URL or bare base64), or None."""
    reader = Base64Reader(data)
    head = reader.read(0, 32)
    size: tuple[int, int] | None = None
    if head.startswith(b"\x89PNG\r\n\x1a\n") and head[12:16] == b"IHDR":
        size = struct.unpack(">II", head[16:24]) if len(head) >= 24 else None
    elif head[:6] in (b"GIF87a", b"GIF89a") and len(head) >= 10:
        size = struct.unpack("<HH", head[6:10])
    elif head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        size = _webp(head)
    elif head[:3] == b"\xff\xd8\xff":
        size = _jpeg(reader)
    if size is None or not (0 < size[0] <= MAX_SIDE and 0 < size[1] <= MAX_SIDE):
        return None
    return size


def _webp(head: bytes) -> tuple[int, int] | None:
    if len(head) < 30:
        return None
    chunk = head[12:16]
    if chunk == b"VP8 " and head[23:26] == b"\x9d\x01\x2a":
        w, h = struct.unpack("<HH", head[26:30])
        return w & 0x3FFF, h & 0x3FFF
    if chunk == b"VP8L" and head[20] == 0x2F:
        bits = int.from_bytes(head[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X":
        return int.from_bytes(head[24:27], "little") + 1, int.from_bytes(head[27:30], "little") + 1
    return None


def _jpeg(reader: Base64Reader) -> tuple[int, int] | None:
    offset = 2
    for _ in range(JPEG_MAX_SEGMENTS):
        head = reader.read(offset, 9)
        if len(head) < 4 or head[0] != 0xFF:
            return None
        marker = head[1]
        if marker == 0xFF:  # fill byte before a marker
            offset += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # markers without a length
            offset += 2
            continue
        length = int.from_bytes(head[2:4], "big")
        if length < 2:
            return None
        if marker in _SOF:
            if len(head) < 9:
                return None
            height, width = struct.unpack(">HH", head[5:9])
            return width, height
        if marker in (0xD9, 0xDA):  # end of image, start of scan: no frame header before it
            return None
        offset += 2 + length
    return None
