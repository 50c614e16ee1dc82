"""Real media files made by hand for the tests: images of a given size (PNG, GIF, WebP, JPEG) and multi-page PDFs.

No imaging or PDF library: each writer emits the format's own structure, so the proxy's readers are
tested against files any viewer opens (the PNG is a complete, valid image; the PDF has a cross-reference
table, a page tree and content streams, plain or FlateDecode, optionally in object streams).
"""

from __future__ import annotations

import base64
import struct
import zlib


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def png(width: int, height: int) -> bytes:
    """A valid grey PNG of ``width`` × ``height`` pixels."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\x00" + b"\x80" * width for _ in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def gif(width: int, height: int) -> bytes:
    """A GIF header and an empty logical screen of the given size (what a reader's size check reads)."""
    return b"GIF89a" + struct.pack("<HHBBB", width, height, 0, 0, 0) + b";"


def webp(width: int, height: int, kind: str = "VP8X") -> bytes:
    """A WebP header of the given size: extended (VP8X), lossless (VP8L) or lossy (VP8 )."""
    if kind == "VP8X":
        body = b"VP8X" + struct.pack("<I", 10) + b"\x00\x00\x00\x00" \
            + (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    elif kind == "VP8L":
        bits = (width - 1) | ((height - 1) << 14)
        body = b"VP8L" + struct.pack("<I", 5) + b"\x2f" + bits.to_bytes(4, "little")
    else:
        body = b"VP8 " + struct.pack("<I", 10) + b"\x00\x00\x00\x9d\x01\x2a" + struct.pack("<HH", width, height)
    return b"RIFF" + struct.pack("<I", 4 + len(body)) + b"WEBP" + body + b"\x00" * 8


def jpeg(width: int, height: int, app_bytes: int = 0) -> bytes:
    """A JPEG's markers up to its frame header: SOI, APP0 (JFIF), an APP1 of ``app_bytes``, SOF0, then EOI."""
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"
    app1 = b"\xff\xe1" + struct.pack(">H", app_bytes + 2) + b"\x00" * app_bytes if app_bytes else b""
    sof = b"\xff\xc0" + struct.pack(">HBHHB", 11, 8, height, width, 1) + b"\x01\x11\x00"
    return b"\xff\xd8" + app0 + app1 + sof + b"\xff\xd9"


def pdf_escape(text: str) -> bytes:
    return text.encode("latin-1").replace(b"\\", b"\\\\").replace(b"(", b"\\(").replace(b")", b"\\)")


def page_content(text: str) -> bytes:
    """A page's content stream: each line of ``text`` shown with Tj, 14 pt leading, in one BT…ET block."""
    lines = [b"BT /F1 11 Tf 72 720 Td 14 TL"]
    for line in text.split("\n"):
        lines.append(b"(" + pdf_escape(line) + b") Tj T*")
    lines.append(b"ET")
    return b"\n".join(lines)


def pdf(pages: list[str], *, compress: bool = True, object_streams: bool = False) -> bytes:
    """A valid PDF with one page per text: a catalog, a page tree (/Count), a Helvetica font, content streams.

    ``compress``: FlateDecode content streams; ``object_streams``: the page objects and the page tree sit
    in a compressed object stream, indexed by a cross-reference stream (PDF 1.5), as most producers write
    them today.
    """
    n = len(pages)
    font, tree = 3, 2
    page_ids = [4 + i for i in range(n)]
    content_ids = [4 + n + i for i in range(n)]
    objects: dict[int, bytes] = {1: b"<< /Type /Catalog /Pages 2 0 R >>",
                                 font: b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"}
    kids = b" ".join(b"%d 0 R" % i for i in page_ids)
    objects[tree] = b"<< /Type /Pages /Kids [" + kids + b"] /Count %d >>" % n
    for pid, cid in zip(page_ids, content_ids):
        objects[pid] = (b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
                        b"/Resources << /Font << /F1 3 0 R >> >> /Contents %d 0 R >>" % cid)
    streams: dict[int, bytes] = {}
    for cid, text in zip(content_ids, pages):
        data = page_content(text)
        if compress:
            streams[cid] = b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(zlib.compress(data)) \
                + zlib.compress(data) + b"\nendstream"
        else:
            streams[cid] = b"<< /Length %d >>\nstream\n" % len(data) + data + b"\nendstream"
    packed = [tree, *page_ids]
    objstm = 4 + 2 * n
    if object_streams:
        body = b""
        offsets = []
        for num in packed:
            offsets.append(b"%d %d" % (num, len(body)))
            body += objects.pop(num) + b"\n"
        header = b" ".join(offsets) + b"\n"
        data = zlib.compress(header + body)
        streams[objstm] = (b"<< /Type /ObjStm /N %d /First %d /Length %d /Filter /FlateDecode >>\nstream\n"
                           % (len(packed), len(header), len(data)) + data + b"\nendstream")
    out = b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n"
    xref: dict[int, int] = {}
    for num in sorted({**objects, **streams}):
        xref[num] = len(out)
        out += b"%d 0 obj\n" % num + (objects.get(num) or streams[num]) + b"\nendobj\n"
    start = len(out)
    if not object_streams:
        size = max(xref) + 1
        out += b"xref\n0 %d\n0000000000 65535 f \n" % size
        for num in range(1, size):
            out += b"%010d 00000 n \n" % xref[num]
        return out + b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (size, start)
    # a cross-reference stream: type 1 (offset) for top-level objects, type 2 (stream, index) for packed ones
    xref_id = max(xref) + 1
    xref[xref_id] = start
    rows = [struct.pack(">BIH", 0, 0, 65535)]
    for num in range(1, xref_id + 1):
        if num in xref:
            rows.append(struct.pack(">BIH", 1, xref[num], 0))
        else:
            rows.append(struct.pack(">BIH", 2, objstm, packed.index(num)))
    data = zlib.compress(b"".join(rows))
    out += (b"%d 0 obj\n<< /Type /XRef /Size %d /W [1 4 2] /Root 1 0 R /Length %d /Filter /FlateDecode >>\nstream\n"
            % (xref_id, xref_id + 1, len(data)) + data + b"\nendstream\nendobj\n")
    return out + b"startxref\n%d\n%%%%EOF\n" % start


PROSE = ("the quarterly report shows revenue growth across every region while costs fell slightly "
         "because the new supplier contract and automation reduced overhead for manufacturing teams")


def prose(words: int, seed: int = 0) -> str:
    """English-like text of ``words`` words, in lines of 12 words."""
    vocab = PROSE.split()
    chosen = [vocab[(i * 7 + seed * 13 + i // 5) % len(vocab)] for i in range(words)]
    return "\n".join(" ".join(chosen[i:i + 12]) for i in range(0, len(chosen), 12))
