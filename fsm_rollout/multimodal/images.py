"""Images as URLs vLLM's render accepts, and the content hashes that stand for them in traces.

Every image becomes a render URL before any request is sent: a PIL image (PNG data URL), a ``data:`` URL (Geo3K's
``image/None`` fixed to ``image/png``; the payload must be base64 of an image), an ``http(s)://`` URL (passed
through) or a local path (``~`` expanded; must be an image file). Anything else is an
:class:`~fsm_rollout.errors.ImageInputError` naming the sample and the image index.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import re
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsm_rollout.errors import ImageInputError
from fsm_rollout.multimodal._prefix import sample_prefix

_HASH_HEX_CHARS = 16
_URL_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_BASE64_TEXT = re.compile(r"[A-Za-z0-9+/_-]+={0,2}")
# Base64 of the magic bytes of PNG, JPEG, GIF and WebP files.
_IMAGE_BASE64_PREFIXES = ("iVBORw0KGgo", "/9j/", "R0lGOD", "UklGR")
_MIN_BARE_BASE64_CHARS = 64
_PNG_PROBE_ROWS = 32
_PNG_STORE_RATIO = 0.9
_EXIF_ORIENTATION = 0x0112


@dataclass(frozen=True, slots=True)
class RenderMessages:
    """Chat messages ready for the render request, and one content hash per image in them, in order.

    A hash is ``sha256:<16 hex>`` of the image bytes sent (PNG bytes for PIL images, the file's bytes or its PNG
    re-encoding for files, the decoded payload for ``data:`` URLs), or ``url-sha256:<16 hex>`` of the URL text
    for ``http(s)`` URLs, whose content the rollout never sees.
    """

    messages: list[dict[str, Any]]
    image_hashes: tuple[str, ...]


def encode_pil_image(image: Any, *, fast: bool = False) -> str:
    """A PIL image as a ``data:image/png;base64,...`` URL (converted to RGB first when needed); ``fast`` encodes
    it as an observation's image is (:func:`fast_png`)."""
    return _pil_image_url(image, fast)[0]


def image_to_render_url(image: Any) -> str:
    """An image as a URL vLLM's render accepts: PIL image, ``data:`` URL, ``http(s)://`` URL or local path.

    Raises :class:`~fsm_rollout.errors.ImageInputError` with the reason for anything else.
    """
    return _render_url_and_hash(image)[0]


def image_content_hash(url: str) -> str:
    """The trace hash of an image URL: of the decoded bytes of a ``data:`` URL, else of the URL text."""
    if url.startswith("data:"):
        _, _, payload = url.partition(",")
        try:
            return _content_hash(base64.b64decode(payload, validate=True))
        except (binascii.Error, ValueError):
            pass
    return "url-" + _content_hash(url.encode("utf-8"))


def prepare_render_messages(
    messages: Sequence[dict[str, Any]], *, sample_id: Any = None, fast: bool = False
) -> RenderMessages:
    """Copy messages for the render request, turning ``image`` parts into ``image_url`` parts, and hash images.

    Parts whose ``image`` is None, and all other parts, are copied as they are. Errors name the sample, the
    image's index among the image parts (for a string prompt, its index in ``multimodal_inputs["images"]``)
    and its place in the messages.

    ``fast`` (observations) encodes a PIL image as a PNG without filters and with zlib's fastest level, and sends
    a PNG or JPEG file in RGB without EXIF rotation as its own bytes; the pixels the engine decodes are the same
    as without it. Prompts keep PIL's default PNG encoding, which the seed's image URLs are compared against.
    """
    rendered: list[dict[str, Any]] = []
    hashes: list[str] = []
    image_index = 0
    for message_index, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            rendered.append(dict(message))
            continue
        parts: list[dict[str, Any]] = []
        for part_index, part in enumerate(content):
            where = f"messages[{message_index}].content[{part_index}]"
            if not isinstance(part, dict):
                raise ImageInputError(f"{sample_prefix(sample_id)}{where} must be a dict, got {type(part).__name__}")
            if part.get("type") == "image":
                index, image_index = image_index, image_index + 1
                if part.get("image") is not None:
                    try:
                        url, digest = _render_url_and_hash(part["image"], fast)
                    except ImageInputError as error:
                        raise ImageInputError(f"{sample_prefix(sample_id)}image {index} ({where}): {error}") from error
                    parts.append({"type": "image_url", "image_url": {"url": url}})
                    hashes.append(digest)
                    continue
            elif part.get("type") == "image_url":
                image_index += 1
                given_url = _image_url_of_part(part)
                if given_url is not None:
                    hashes.append(image_content_hash(given_url))
            parts.append(dict(part))
        rendered.append({**message, "content": parts})
    return RenderMessages(messages=rendered, image_hashes=tuple(hashes))


def messages_for_render(messages: Sequence[dict[str, Any]], *, sample_id: Any = None) -> list[dict[str, Any]]:
    """The messages of :func:`prepare_render_messages` (without the image hashes)."""
    return prepare_render_messages(messages, sample_id=sample_id).messages


def without_image_data(value: Any) -> Any:
    """JSON data with each image ``data:`` URL shown as ``<image>`` (for text views of recorded messages)."""
    if isinstance(value, list):
        return [without_image_data(item) for item in value]
    if isinstance(value, dict):
        return {key: without_image_data(item) for key, item in value.items()}
    if isinstance(value, str) and value.startswith("data:image/"):
        return "<image>"
    return value


def _image_url_of_part(part: dict[str, Any]) -> str | None:
    value = part.get("image_url")
    if isinstance(value, dict):
        value = value.get("url")
    return value if isinstance(value, str) else None


def _render_url_and_hash(image: Any, fast: bool = False) -> tuple[str, str]:
    if isinstance(image, str):
        return _string_image_url(image, fast)
    if isinstance(image, os.PathLike):
        return _file_image_url(Path(os.fspath(image)).expanduser(), str(image), fast)
    if isinstance(image, bytes | bytearray | memoryview):
        raise ImageInputError(
            f"raw bytes ({len(image)} bytes) are not an accepted image; pass PIL.Image.open(io.BytesIO(data)) "
            "or a 'data:image/png;base64,...' URL"
        )
    if hasattr(image, "mode") and hasattr(image, "save"):
        return _pil_image_url(image, fast)
    if isinstance(image, dict) and ("bytes" in image or "path" in image):
        raise ImageInputError(
            "an undecoded dataset image ({'bytes', 'path'} dict) is not accepted; decode it to a PIL image "
            "(datasets.Image(decode=True)) or pass its path"
        )
    hint = "; convert it with PIL.Image.fromarray" if hasattr(image, "__array_interface__") else ""
    raise ImageInputError(
        f"unsupported image type {type(image).__name__}: expected a PIL image, a data: URL, an http(s) URL or a "
        f"local path{hint}"
    )


def _pil_image_url(image: Any, fast: bool = False) -> tuple[str, str]:
    if not hasattr(image, "mode") or not hasattr(image, "save"):
        raise ImageInputError(f"expected a PIL image, got {type(image).__name__}")
    try:
        if image.mode != "RGB":
            image = image.convert("RGB")
        if fast:
            data = fast_png(image)
        else:
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
            data = buffer.getvalue()
    except (OSError, ValueError) as error:
        raise ImageInputError(f"cannot encode the PIL image as PNG: {error}") from error
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii"), _content_hash(data)


def fast_png(image: Any) -> bytes:
    """An RGB PIL image as PNG bytes, fast: rows unfiltered, deflated at zlib's fastest level, or stored when a
    probe of the first rows shows they barely compress (a photo, noise).

    PIL's encoder tries every row filter and compresses at level 6, several times slower on a 448x448 board; the
    decoded pixels are the same either way.
    """
    import numpy as np

    width, height = image.size
    raw = image.tobytes()
    stride = width * 3
    if len(raw) != stride * height:
        raise ValueError(f"expected an RGB image of {width}x{height}, got {len(raw)} bytes of pixels")
    # Each row after its filter byte (0: none), in one copy; zlib reads the array's buffer as it would the bytes.
    rows = np.empty((height, stride + 1), dtype=np.uint8)
    rows[:, 0] = 0
    rows[:, 1:] = np.frombuffer(raw, dtype=np.uint8).reshape(height, stride)
    pixels = rows.reshape(-1).data
    probe = pixels[: (stride + 1) * _PNG_PROBE_ROWS]
    level = 1 if len(zlib.compress(probe, 1)) < len(probe) * _PNG_STORE_RATIO else 0
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, deflate, no interlace
    return b"".join(
        (b"\x89PNG\r\n\x1a\n", _png_chunk(b"IHDR", header), _png_chunk(b"IDAT", zlib.compress(pixels, level)),
         _png_chunk(b"IEND", b""))
    )  # fmt: skip


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return b"".join((struct.pack(">I", len(data)), kind, data, struct.pack(">I", zlib.crc32(data, zlib.crc32(kind)))))


def _string_image_url(image: str, fast: bool = False) -> tuple[str, str]:
    if image.startswith("data:"):
        return _data_url(image)
    if image.startswith(("http://", "https://")):
        return image, "url-" + _content_hash(image.encode("utf-8"))
    if not image.strip():
        raise ImageInputError("the image string is empty")
    scheme = _URL_SCHEME.match(image)
    if scheme is not None:
        hint = "; pass the local path itself" if scheme.group(1).lower() == "file" else ""
        raise ImageInputError(
            f"unsupported URL scheme {scheme.group(1)!r} in {image[:80]!r}: only data: and http(s) URLs are "
            f"accepted{hint}"
        )
    return _file_image_url(Path(image).expanduser(), image, fast)


def _data_url(url: str) -> tuple[str, str]:
    url = url.replace("data:image/None;", "data:image/png;", 1)
    header, separator, payload = url[len("data:") :].partition(",")
    if not separator:
        raise ImageInputError(f"the data: URL has no ',' before its payload: {url[:60]!r}")
    if header.rpartition(";")[2] != "base64":
        raise ImageInputError(f"only base64 data: URLs are accepted (like vLLM), got {('data:' + header)[:60]!r}")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise ImageInputError(f"the data: URL payload is not valid base64: {error}") from error
    _check_image_bytes(data, "the data: URL payload")
    return url, _content_hash(data)


def _file_image_url(path: Path, given: str, fast: bool = False) -> tuple[str, str]:
    try:
        is_file = path.is_file()
        exists = is_file or path.exists()
    except OSError:  # e.g. a file name too long: a long base64 string, most likely
        is_file = exists = False
    if not is_file:
        if exists:
            raise ImageInputError(f"{given[:80]!r} is not a file")
        if _looks_like_bare_base64(given):
            raise ImageInputError(
                f"{given[:40]!r}... looks like raw base64 without a data: prefix; pass "
                "'data:image/png;base64,' + the base64 text"
            )
        raise ImageInputError(
            f"unsupported image string {given[:80]!r}: not a data: URL, an http(s) URL, or an existing file"
        )
    from PIL import Image, UnidentifiedImageError

    try:
        data = path.read_bytes() if fast else None  # read once: the bytes checked are the bytes sent
        with Image.open(path if data is None else io.BytesIO(data)) as loaded:
            if data is not None and _sendable_as_is(loaded):
                mime = "image/png" if loaded.format == "PNG" else "image/jpeg"
                return f"data:{mime};base64," + base64.b64encode(data).decode("ascii"), _content_hash(data)
            return _pil_image_url(loaded, fast)
    except UnidentifiedImageError as error:
        raise ImageInputError(f"{str(path)!r} is not an image file PIL can read") from error
    except (OSError, ValueError, Image.DecompressionBombError) as error:
        raise ImageInputError(f"cannot read image file {str(path)!r}: {error}") from error


def _sendable_as_is(opened: Any) -> bool:
    """Whether an opened image file decodes to the pixels its PIL RGB conversion has, on every engine: a single
    RGB frame of PNG or JPEG with no EXIF rotation (the embedded engine applies one, vLLM does not)."""
    return (
        opened.format in ("PNG", "JPEG")
        and opened.mode == "RGB"
        and getattr(opened, "n_frames", 1) == 1
        and opened.getexif().get(_EXIF_ORIENTATION, 1) == 1
    )


def _check_image_bytes(data: bytes, what: str) -> None:
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise ImageInputError(f"{what} is empty")
    try:
        with Image.open(io.BytesIO(data)):
            pass
    except UnidentifiedImageError as error:
        raise ImageInputError(f"{what} is not an image PIL can read") from error
    except (OSError, ValueError, Image.DecompressionBombError) as error:
        raise ImageInputError(f"{what} cannot be read as an image: {error}") from error


def _looks_like_bare_base64(text: str) -> bool:
    compact = "".join(text.split())
    if compact.startswith(_IMAGE_BASE64_PREFIXES):
        return True
    return len(compact) >= _MIN_BARE_BASE64_CHARS and _BASE64_TEXT.fullmatch(compact) is not None


def _content_hash(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()[:_HASH_HEX_CHARS]
