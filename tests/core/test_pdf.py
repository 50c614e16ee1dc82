"""proxy.core.pdf: a PDF's page count and shown text, from real hand-made PDFs, and bounded work on garbage."""

from __future__ import annotations

import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core import pdf
from tests import media_files as mf


@pytest.mark.parametrize("options", [{}, {"compress": False}, {"object_streams": True}])
@pytest.mark.parametrize("n", [1, 3, 28])
def test_pages_and_text(options: dict[str, bool], n: int) -> None:
    pages = [mf.prose(50, i) for i in range(n)]
    got = pdf.read_pdf(mf.pdf(pages, **options))
    assert got is not None and got.pages == n and got.glyphs == 0
    assert got.text == "\n".join(pages) + "\n"  # each Tj line on its own line, each page's block ended


def test_escapes_kerning_hex_and_unicode_strings() -> None:
    content = (b"BT /F1 11 Tf (a \\(b\\) c\\\\ \\101\\n) Tj T* [(Hel) -20 (lo) -400 (world)] TJ "
               b"<48692021> Tj <FEFF00E9> Tj <0012003400560078> Tj ET")
    got = pdf.read_pdf(_one_stream(zlib.compress(content), b"/Filter /FlateDecode"))
    assert got is not None
    assert got.text == "a (b) c\\ A\n\nHello world Hi ! \u00e9 \n"
    assert got.glyphs == 4  # a two-byte font's glyph ids: counted, not read as text


def test_a_page_count_larger_than_the_pages_is_not_believed() -> None:
    raw = mf.pdf([mf.prose(20)] * 2).replace(b"/Count 2", b"/Count 999999")
    got = pdf.read_pdf(raw)
    assert got is not None and got.pages == 2


def test_a_page_rewritten_by_an_incremental_update_counts_once() -> None:
    raw = mf.pdf([mf.prose(20)] * 2)
    update = b"4 0 obj\n<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] >>\nendobj\n"
    got = pdf.read_pdf(raw + update)
    assert got is not None and got.pages == 2  # three page objects, the page tree says 2


@pytest.mark.parametrize("raw", [
    b"", b"not a pdf", b"%PDF-1.7\n", b"%PDF-1.7\nstream\n\x00\x01endstream",
    b"%PDF-1.4\n1 0 obj << /Filter /FlateDecode >> stream\n" + b"\x00" * 100 + b"\nendstream",
])
def test_no_pages_is_none(raw: bytes) -> None:
    assert pdf.read_pdf(raw) is None


def test_other_filters_and_images_are_skipped() -> None:
    raw = mf.pdf([mf.prose(10)])
    image = b"9 0 obj\n<< /Type /XObject /Subtype /Image /Length 9 >>\nstream\nBT (x) Tj ET\nendstream\nendobj\n"
    lzw = b"10 0 obj\n<< /Length 9 /Filter /LZWDecode >>\nstream\nBT (y) Tj ET\nendstream\nendobj\n"
    got = pdf.read_pdf(raw + image + lzw)
    assert got is not None and got.text == mf.prose(10) + "\n"


def test_a_zip_bomb_is_inflated_no_further_than_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pdf, "MAX_INFLATED", 1_000_000)
    bomb = zlib.compress(b"BT " + b"(a) Tj " * 5_000_000 + b"ET", 9)  # 35 MB inflated, ~35 kB compressed
    raw = mf.pdf([mf.prose(10)]) + b"20 0 obj\n<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(bomb) \
        + bomb + b"\nendstream\nendobj\n"
    got = pdf.read_pdf(raw)
    assert got is not None and got.pages == 1
    assert len(got.text) < 1_000_000


def test_text_beyond_the_bound_is_counted_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pdf, "MAX_TEXT", 100)
    got = pdf.read_pdf(mf.pdf([mf.prose(50)]))
    assert got is not None and len(got.text) == 100 and got.more_chars == len(mf.prose(50)) + 1 - 100


def test_unbalanced_text_operators_stay_linear() -> None:
    """BT without ET, strings without their closing parenthesis: one pass, not one search per mark."""
    content = b"BT " * 200_000 + b"(" * 200_000 + b"[" * 200_000 + b"ET"
    got = pdf.read_pdf(_one_stream(content, b""))
    assert got is not None and got.pages == 1


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=2000))
def test_any_bytes_after_a_header_are_safe(tail: bytes) -> None:
    got = pdf.read_pdf(b"%PDF-1.7\n" + tail)
    assert got is None or got.pages > 0


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=0, max_value=4000), st.binary(min_size=1, max_size=50))
def test_a_damaged_pdf_is_safe(at: int, junk: bytes) -> None:
    raw = mf.pdf([mf.prose(40, i) for i in range(3)])
    damaged = raw[:at] + junk + raw[at + len(junk):]
    got = pdf.read_pdf(damaged)
    assert got is None or 0 < got.pages <= 3 + damaged.count(b"/Type /Page")


def _one_stream(data: bytes, filters: bytes) -> bytes:
    """A one-page PDF whose page's content is ``data``."""
    return (b"%PDF-1.4\n1 0 obj\n<< /Type /Catalog /Pages 2 0 R >>\nendobj\n"
            b"2 0 obj\n<< /Type /Pages /Kids [3 0 R] /Count 1 >>\nendobj\n"
            b"3 0 obj\n<< /Type /Page /Parent 2 0 R /Contents 4 0 R >>\nendobj\n"
            + b"4 0 obj\n<< /Length %d " % len(data) + filters + b" >>\nstream\n" + data + b"\nendstream\nendobj\n")
