"""Encoded images as request inputs: a CBOR byte string holding a JPEG or a PNG.

Read from the request's bytes before anything is decoded: the image's kind and its declared
size come from the file's own header (PNG's IHDR, JPEG's SOF segment), so an image bomb (a
PNG declaring 50000 x 50000) is refused by ``limits.max_image_pixels`` before a pixel is
allocated. A file that does not end where its format says it ends (no PNG ``IEND``, no JPEG
end-of-image marker after the scan) is refused too: decoders fill a truncated JPEG with grey
and return it as if nothing happened.

The bytes travel on as :class:`EncodedImage`, a read-only ``uint8`` array over the payload's
own bytes (no copy) that also knows the declared size; the runner decodes it on a worker
(`agent.inference.images`).

Hand-written rather than a library: the two header walks are a few dozen lines, and the
libraries that read headers (Pillow, imagesize) are not dependencies of the agent.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

import numpy as np

from agent.protocol.errors import Limits, WireError

__all__ = ["EncodedImage", "ImageHeader", "encoded_image", "read_image_header"]

_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_PNG_IEND = b"IEND\xaeB`\x82"
_JPEG_SOI = b"\xff\xd8"
_JPEG_EOI = b"\xff\xd9"
# Start-of-frame markers (baseline, progressive, lossless, arithmetic); not DHT (C4),
# JPG (C8) or DAC (CC), which share the range.
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_JPEG_SOS = 0xDA
_JPEG_STANDALONE = frozenset(range(0xD0, 0xD8)) | {0x01}  # RSTn, TEM: no length field


class ImageHeader(NamedTuple):
    """What the file declares: its kind ("png" or "jpeg") and size."""

    kind: str
    height: int
    width: int


class EncodedImage(np.ndarray):
    """The bytes of a JPEG or PNG input (a 1-D ``uint8`` view, read-only) with its header."""

    header: ImageHeader

    def __array_finalize__(self, obj: Any) -> None:
        self.header = getattr(obj, "header", ImageHeader("", 0, 0))


def read_image_header(data: bytes) -> ImageHeader | str:
    """The header of a PNG or JPEG in `data`, or why it is not one (one line)."""
    if data.startswith(_PNG_MAGIC):
        return _png_header(data)
    if data.startswith(_JPEG_SOI):
        return _jpeg_header(data)
    return "a byte string input must hold a JPEG or a PNG image (no such signature)"


def _png_header(data: bytes) -> ImageHeader | str:
    # Signature, then the first chunk must be IHDR: length 13, width and height big-endian.
    if len(data) < 33 or data[12:16] != b"IHDR":
        return "a PNG without its IHDR header"
    width, height = struct.unpack(">II", data[16:24])
    if data.rfind(_PNG_IEND, 33) < 0:
        return "a truncated PNG (no IEND chunk)"
    return ImageHeader("png", height, width)


def _jpeg_header(data: bytes) -> ImageHeader | str:
    """Walks the segments after SOI up to the first start-of-frame (its size) and checks
    that an end-of-image marker follows the first scan."""
    at, size = 2, len(data)
    found: ImageHeader | None = None
    while at + 4 <= size:
        if data[at] != 0xFF:
            return "a corrupt JPEG (segment marker expected)"
        marker = data[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        if marker in _JPEG_STANDALONE:
            at += 2
            continue
        length = int.from_bytes(data[at + 2 : at + 4], "big")
        if length < 2:
            return "a corrupt JPEG (segment length)"
        if marker in _JPEG_SOF and found is None:
            if at + 9 > size or length < 7:
                return "a truncated JPEG (frame header)"
            height, width = struct.unpack(">HH", data[at + 5 : at + 9])
            found = ImageHeader("jpeg", height, width)
        if marker == _JPEG_SOS:
            if found is None:
                return "a corrupt JPEG (scan before frame header)"
            if data.rfind(_JPEG_EOI, at + 2 + length) < 0:
                return "a truncated JPEG (no end-of-image marker after the scan)"
            return found
        at += 2 + length
    return "a truncated JPEG (no scan)"


def encoded_image(data: bytes, limits: Limits, name: str, request_id: str | None) -> EncodedImage:
    """A request input's byte string as an :class:`EncodedImage`, its header checked
    against `limits` (`bad_request`: not an image; `too_large`: over max_image_pixels)."""
    where = f"input {name!r}"
    header = read_image_header(data)
    if isinstance(header, str):
        raise WireError("bad_request", f"{where}: {header}", request_id)
    if header.height < 1 or header.width < 1:
        raise WireError("bad_request", f"{where}: the {header.kind} declares no pixels", request_id)
    pixels = header.height * header.width
    if pixels > limits.max_image_pixels:
        raise WireError(
            "too_large",
            f"{where}: a {header.width}x{header.height} {header.kind} has {pixels} pixels, "
            f"over limits.max_image_pixels ({limits.max_image_pixels})",
            request_id,
        )
    image = np.frombuffer(data, dtype=np.uint8).view(EncodedImage)
    image.header = header
    return image
