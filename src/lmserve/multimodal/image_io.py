"""One image as every layer above sees it: decoded once from its bytes, checked, and named by its content hash.

The hash (sha256 of the bytes as sent) keys the encoder cache and joins the prefix cache's block hashes, so the same
image is encoded once and the same text with another image never shares blocks. Decoding refuses what would harm the
server before any pixel is decoded: formats outside IMAGE_FORMATS and declared sizes past `max_pixels` (a
decompression bomb declares huge dimensions in a few bytes).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
from dataclasses import dataclass, field

# What Pillow may open: the formats clients send (OpenAI, Anthropic and Ollama accept these four).
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
MAX_PIXELS = 64_000_000  # declared width x height; a 8000x8000 photo passes, a bomb's 100k x 100k does not


class ImageError(ValueError):
    """An image the server refuses (a 400 in the asking API's shape); the message says why."""


@dataclass(frozen=True)
class ImageData:
    """A decoded RGB image and the sha256 of the bytes it came from."""

    image: object = field(repr=False, compare=False)  # PIL.Image.Image, mode RGB, fully loaded
    digest: str  # sha256 hex of the source bytes
    detail: str = "auto"  # OpenAI's `detail` ("auto", "low", "high"), as asked: no family reads it (docs/api.md)


def probe_image_bytes(data: bytes, *, max_pixels: int = MAX_PIXELS) -> tuple[str, int, int]:
    """The format, width and height `data` declares, read from its header alone (no pixel decoded); ImageError
    for what load_image_bytes would refuse before decoding: empty, not one of IMAGE_FORMATS, too many pixels."""
    with _opened(data, max_pixels, "read") as (img, header):
        return header


def load_image_bytes(data: bytes, *, detail: str = "auto", max_pixels: int = MAX_PIXELS) -> ImageData:
    """Decode `data` into an ImageData, or raise ImageError saying why not."""
    with _opened(data, max_pixels, "decoded") as (img, _):
        img.load()
        rgb = img.convert("RGB")
    return ImageData(image=rgb, digest=hashlib.sha256(data).hexdigest(), detail=detail)


@contextlib.contextmanager
def _opened(data: bytes, max_pixels: int, verb: str):
    """Pillow's image of `data` with its checked header (format, width, height); every failure inside, Pillow's
    many error types included, comes out as one ImageError saying the image could not be `verb`."""
    from PIL import Image  # Pillow loads only where images are used

    if not data:
        raise ImageError("the image is empty")
    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as img:
            width, height = img.size  # read from the header, before any pixel is decoded
            if width * height > max_pixels:
                raise ImageError(f"the image declares {width}x{height} pixels, more than the {max_pixels} allowed")
            yield img, (img.format, width, height)
    except ImageError:
        raise
    except Image.DecompressionBombError as e:
        raise ImageError(f"the image is too large to decode: {e}") from None
    except Exception as e:  # noqa: BLE001 - Pillow raises many types for corrupt or unknown data
        raise ImageError(f"the image could not be {verb} (supported: {', '.join(IMAGE_FORMATS)}): "
                         f"{type(e).__name__}") from None
