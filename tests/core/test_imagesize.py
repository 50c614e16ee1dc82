"""proxy.core.imagesize: an image's size from the first bytes of its base64, and nothing on garbage."""

from __future__ import annotations

import base64

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.core.imagesize import Base64Reader, dimensions
from tests import media_files as mf

SIZES = [(1, 1), (17, 3), (1024, 768), (4000, 3000), (100, 5000), (16383, 2)]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("make", [mf.png, mf.gif, mf.jpeg, mf.webp,
                                  lambda w, h: mf.webp(w, h, "VP8L"), lambda w, h: mf.webp(w, h, "VP8 ")])
def test_each_format_states_its_size(size: tuple[int, int], make: object) -> None:
    raw = make(*size)  # type: ignore[operator]
    assert dimensions(mf.b64(raw)) == size
    assert dimensions("data:image/x;base64," + mf.b64(raw)) == size


def test_a_jpeg_frame_after_large_segments_is_found_by_skipping_them() -> None:
    """EXIF or ICC segments come before the frame header: skipped by their lengths, never decoded."""
    assert dimensions(mf.b64(mf.jpeg(640, 480, app_bytes=60_000))) == (640, 480)


def test_wrapped_base64_is_read_too() -> None:
    wrapped = base64.encodebytes(mf.jpeg(640, 480, app_bytes=3000)).decode()  # MIME: 76 characters a line
    assert "\n" in wrapped[:80]
    assert dimensions(wrapped) == (640, 480)


@pytest.mark.parametrize("data", [
    "", "garbage!!", "data:image/png;base64,", "data:nocomma", "iVBORw0KGgo=",  # a bare PNG signature
    mf.b64(mf.png(1, 1))[:20],  # truncated before IHDR's size
    mf.b64(b"\xff\xd8\xff\xe0\x00\x01"),  # a JPEG segment length below 2
    mf.b64(b"\xff\xd8" + b"\xff\xe1\xff\xff" * 3),  # segments pointing past the end
    mf.b64(mf.gif(0, 10)), mf.b64(mf.png(1, 1)).replace("A", "-", 3),  # zero side; not base64
    mf.b64(b"\x89PNG\r\n\x1a\n" + b"\x00\x00\x00\x0dIHDR" + b"\xff" * 8),  # a side beyond any provider's
])
def test_garbage_is_none(data: str) -> None:
    assert dimensions(data) is None


@given(st.binary(max_size=200))
def test_any_bytes_are_safe(raw: bytes) -> None:
    size = dimensions(mf.b64(raw))
    assert size is None or (size[0] > 0 and size[1] > 0)


def test_only_the_header_is_decoded() -> None:
    """What follows the header is never decoded: a tail that is not base64 at all changes nothing."""
    assert dimensions(mf.b64(mf.png(3000, 2000)) + "!" * 1_000_000) == (3000, 2000)
    assert dimensions(mf.b64(mf.jpeg(3000, 2000, app_bytes=5000)) + "!" * 1_000_000) == (3000, 2000)


def test_random_access_reads() -> None:
    raw = bytes(range(256)) * 4
    reader = Base64Reader(mf.b64(raw))
    for offset, n in [(0, 5), (1, 7), (2, 2), (500, 30), (1020, 10), (2000, 4)]:
        assert reader.read(offset, n) == raw[offset:offset + n]
