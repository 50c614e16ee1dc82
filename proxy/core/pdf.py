"""A PDF's page count and the text its pages show, read from its bytes with bounded work and no dependency.

What providers bill for a PDF is per page (``proxy.core.media``), so two figures matter:

- **pages**: the page objects (``/Type /Page``) in the file and in its compressed object streams,
  checked against the page tree's ``/Count``: the smaller of the two when both are found (a
  rewritten page of an incrementally updated file is found twice; a ``/Count`` larger than the pages
  present is not believed).
- **text**: the strings the content streams show (``Tj``, ``TJ``, ``'``, ``"`` inside ``BT``…``ET``),
  from unfiltered and FlateDecode streams (the two that carry nearly every PDF's text). Literal strings
  are read as PDFDocEncoding/Latin-1 (UTF-16 with a byte-order mark); a hex string that is not text (the
  glyph ids of a two-byte font, which only the font's own map turns into characters) counts as
  ``len / 2`` glyphs, which the caller prices at a few characters a token.

The work is bounded whatever the input: at most ``MAX_STREAMS`` streams and ``MAX_INFLATED`` bytes
inflated in all (a zip bomb stops there), regular expressions only (no recursion, no per-byte Python
loop), and at most ``MAX_TEXT`` characters handed on for tokenizing (beyond them only their number). A file that is
not a PDF, or whose pages cannot be found, is None: the caller keeps its size-based
default.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

MAX_STREAMS = 10_000
MAX_INFLATED = 32 * 1024 * 1024
MAX_TEXT = 2_000_000  # characters of text kept for the tokenizer; beyond them only their number
HEADER_WINDOW = 1024  # "%PDF-" must start within the first KiB, as readers accept it
DICT_WINDOW = 2048  # how far before "stream" its dictionary is looked for

_STREAM = re.compile(rb"\bstream(?:\r\n|\n|\r)")
_OBJ = re.compile(rb"\d+\s+\d+\s+obj\b")
_PAGE = re.compile(rb"/Type\s*/Page(?![A-Za-z0-9_])")
_PAGES_COUNT = re.compile(
    rb"/Type\s*/Pages\b[^>]{0,1024}?/Count\s+(\d{1,9})|/Count\s+(\d{1,9})[^>]{0,1024}?/Type\s*/Pages\b"
)
_TEXT_MARK = re.compile(rb"\b[BE]T\b")
_NEW_LINE = re.compile(rb"T\*|\bT[dDm]\b|['\"]")
_LIT = rb"\((?:[^()\\]|\\.|\((?:[^()\\]|\\.)*\))*\)"
_HEX = rb"<[0-9A-Fa-f\s]*>"
_NUM = rb"[-+]?(?:\d+\.?\d*|\.\d+)"
_SHOWN = re.compile(rb"\[((?:" + _LIT + rb"|" + _HEX + rb"|[^\[\]()<>])*)\]|(" + _LIT + rb"|" + _HEX + rb")", re.S)
_IN_ARRAY = re.compile(rb"(" + _LIT + rb"|" + _HEX + rb")|(" + _NUM + rb")", re.S)
_ESCAPE = re.compile(rb"\\(?:([0-7]{1,3})|(\r\n|\r|\n)|(.))", re.S)
_ESCAPES = {b"n": b"\n", b"r": b"\r", b"t": b"\t", b"b": b"\b", b"f": b"\f"}
_SKIP = re.compile(rb"/Subtype\s*/(?!Form\b)|/Type\s*/(?:XRef|Metadata|EmbeddedFile)\b|/Length[123]\b")
_OBJSTM = re.compile(rb"/Type\s*/ObjStm\b")
_FILTER = re.compile(rb"/Filter\s*(\[[^\]]*\]|/[A-Za-z0-9]+)")
_FLATE = (b"/FlateDecode", b"/Fl")
WORD_GAP = -200  # a TJ adjustment this negative (thousandths of an em) stands for a space


@dataclass(frozen=True)
class PdfText:
    """What a PDF shows: its page count, its text, and glyphs shown without a text encoding."""

    pages: int
    text: str
    glyphs: int
    more_chars: int = 0  # characters shown beyond the first MAX_TEXT (counted, not kept)


def is_pdf(raw: bytes) -> bool:
    return b"%PDF-" in raw[:HEADER_WINDOW]


def read_pdf(raw: bytes) -> PdfText | None:
    """The pages and text of a PDF, or None (not a PDF, or no page found)."""
    if not is_pdf(raw):
        return None
    objects = [raw]
    texts: list[str] = []
    glyphs = 0
    budget = MAX_INFLATED
    pos = 0
    for _ in range(MAX_STREAMS):
        match = _STREAM.search(raw, pos)
        if match is None:
            break
        start = match.end()
        end = raw.find(b"endstream", start)
        if end < 0:
            end = len(raw)
        pos = end + 9
        head = _dictionary(raw, match.start())
        if head is None or _SKIP.search(head):
            continue
        data = _decoded(head, raw[start:end], budget)
        if data is None:
            continue
        budget -= len(data)
        if _OBJSTM.search(head):
            objects.append(data)
            continue
        found, unknown = _shown_text(data)
        if found:
            texts.append(found)
        glyphs += unknown
        if budget <= 0:
            break
    pages = _pages(objects)
    if pages is None:
        return None
    text = "".join(texts)
    return PdfText(pages, text[:MAX_TEXT], glyphs, max(0, len(text) - MAX_TEXT))


def _dictionary(raw: bytes, stream_at: int) -> bytes | None:
    """The bytes from the object's ``N G obj`` to its ``stream`` keyword (None: no object header nearby)."""
    lo = max(0, stream_at - DICT_WINDOW)
    ends = [found.end() for found in _OBJ.finditer(raw, lo, stream_at)]
    return raw[ends[-1]:stream_at] if ends else None


def _decoded(head: bytes, data: bytes, budget: int) -> bytes | None:
    """A stream's data, unfiltered or inflated (at most ``budget`` bytes); None for any other filter."""
    if budget <= 0:
        return None
    found = _FILTER.search(head)
    if found is None:
        return data[:budget]
    names = re.findall(rb"/[A-Za-z0-9]+", found.group(1))
    if len(names) != 1 or names[0] not in _FLATE:
        return None
    inflater = zlib.decompressobj()
    try:
        return inflater.decompress(data, budget)
    except zlib.error:
        return None


def _pages(objects: list[bytes]) -> int | None:
    found = sum(len(_PAGE.findall(chunk)) for chunk in objects)
    counts = [int(a or b) for chunk in objects for a, b in _PAGES_COUNT.findall(chunk)]
    declared = max(counts, default=0)
    if found and declared:
        return min(found, declared)
    return found or None


def _shown_text(content: bytes) -> tuple[str, int]:
    """The text a content stream shows, and the count of glyphs shown without a text encoding."""
    if b"BT" not in content:
        return "", 0
    pieces: list[str] = []
    glyphs = 0
    for block in _text_blocks(content):
        end = 0
        for shown in _SHOWN.finditer(block):
            if pieces and pieces[-1] != "\n":  # what moved the text position between two strings: a new line?
                pieces.append("\n" if _NEW_LINE.search(block, end, shown.start()) else " ")
            end = shown.end()
            if shown.group(1) is not None:  # a TJ array: strings with kerning between them
                word: list[str] = []
                for part in _IN_ARRAY.finditer(shown.group(1)):
                    if part.group(1) is not None:
                        text, unknown = _string(part.group(1))
                        word.append(text)
                        glyphs += unknown
                    elif float(part.group(2)) <= WORD_GAP:
                        word.append(" ")
                pieces.append("".join(word))
            else:
                text, unknown = _string(shown.group(2))
                pieces.append(text)
                glyphs += unknown
        pieces.append("\n")
    return "".join(pieces), glyphs


def _text_blocks(content: bytes) -> list[bytes]:
    """The bytes between each ``BT`` and the ``ET`` after it (one linear pass: no search per ``BT``)."""
    blocks: list[bytes] = []
    opened = -1
    for mark in _TEXT_MARK.finditer(content):
        if content[mark.start()] == 0x42:  # B
            opened = mark.end()
        elif opened >= 0:
            blocks.append(content[opened:mark.start()])
            opened = -1
    return blocks


def _string(token: bytes) -> tuple[str, int]:
    if token.startswith(b"("):
        return _text(_ESCAPE.sub(_unescape, token[1:-1])), 0
    digits = re.sub(rb"\s+", b"", token[1:-1])
    data = bytes.fromhex((digits + b"0" * (len(digits) % 2)).decode())
    if data.startswith(b"\xfe\xff") or all(32 <= b < 127 or b >= 160 or b in (9, 10, 13) for b in data):
        return _text(data), 0
    return "", len(data) // 2 or 1


def _text(data: bytes) -> str:
    if data.startswith(b"\xfe\xff"):
        return data[2:].decode("utf-16-be", "replace")
    return data.decode("latin-1")


def _unescape(m: re.Match[bytes]) -> bytes:
    octal, newline, char = m.groups()
    if octal is not None:
        return bytes([int(octal, 8) & 0xFF])
    if newline is not None:
        return b""
    return _ESCAPES.get(char, char)
