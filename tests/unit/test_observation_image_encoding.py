"""How an observation's images become render URLs: a fast PNG for PIL images, a file's own bytes when they decode to
the same pixels on every engine; prompts keep PIL's default PNG."""

from __future__ import annotations

import base64
import hashlib
import io
import random
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest
from PIL import Image, ImageDraw

from fsm_rollout.multimodal import encode_pil_image, fast_png, prepare_render_messages


def _board(side: int = 96) -> Image.Image:
    image = Image.new("RGB", (side, side), (240, 240, 240))
    draw = ImageDraw.Draw(image)
    for row in range(0, side, 4):
        draw.line([(0, row), (side, row)], fill=(row * 3 % 256, row % 256, 120))
    draw.ellipse([10, 10, 40, 40], fill=(200, 30, 30))
    return image


def _noise(side: int = 96) -> Image.Image:
    generator = random.Random(7)
    return Image.frombytes("RGB", (side, side), bytes(generator.getrandbits(8) for _ in range(side * side * 3)))


def _payload(url: str) -> bytes:
    header, _, payload = url.partition(",")
    assert header.endswith(";base64")
    return base64.b64decode(payload)


def _sent(image: Any, *, fast: bool) -> tuple[str, str]:
    prepared = prepare_render_messages([{"role": "user", "content": [{"type": "image", "image": image}]}], fast=fast)
    return prepared.messages[0]["content"][0]["image_url"]["url"], prepared.image_hashes[0]


@pytest.mark.parametrize("make", [_board, _noise], ids=["board", "noise"])
def test_fast_png_decodes_to_the_same_pixels(make: Any) -> None:
    image = make()
    data = fast_png(image)
    with Image.open(io.BytesIO(data)) as decoded:
        assert decoded.format == "PNG" and decoded.mode == "RGB"
        assert decoded.tobytes() == image.tobytes()


@pytest.mark.parametrize(("make", "level"), [(_board, 1), (_noise, 0)], ids=["board", "noise"])
def test_fast_png_bytes_are_zlib_of_unfiltered_rows(make: Any, level: int) -> None:
    """The exact bytes are what tapes hold and what image hashes are of: unfiltered rows, one IDAT, zlib's
    ``compress`` at level 1 (0 when stored)."""
    image = make()
    width, height = image.size
    raw = image.tobytes()
    rows = b"".join(b"\x00" + raw[row * width * 3 : (row + 1) * width * 3] for row in range(height))
    data = fast_png(image)
    chunks = []
    position = 8
    while position < len(data):
        (length,) = struct.unpack(">I", data[position : position + 4])
        kind, body = data[position + 4 : position + 8], data[position + 8 : position + 8 + length]
        (crc,) = struct.unpack(">I", data[position + 8 + length : position + 12 + length])
        assert crc == zlib.crc32(kind + body)
        chunks.append((kind, body))
        position += 12 + length
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert [kind for kind, _ in chunks] == [b"IHDR", b"IDAT", b"IEND"]
    assert chunks[0][1] == struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    assert chunks[1][1] == zlib.compress(rows, level)


def test_fast_png_compresses_a_board_and_stores_noise() -> None:
    raw = 96 * 96 * 3
    assert len(fast_png(_board())) < raw // 10
    assert len(fast_png(_noise())) > raw  # stored: deflating noise costs time and saves nothing


def test_an_observation_pil_image_is_sent_as_a_fast_png_and_hashed_by_those_bytes() -> None:
    image = _board()
    url, digest = _sent(image, fast=True)
    assert url.startswith("data:image/png;base64,")
    assert _payload(url) == fast_png(image)
    assert digest == "sha256:" + hashlib.sha256(fast_png(image)).hexdigest()[:16]
    assert url == encode_pil_image(image, fast=True)


def test_a_prompt_pil_image_keeps_pils_default_png() -> None:
    image = _board()
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url, _ = _sent(image, fast=False)
    assert _payload(url) == buffer.getvalue() == _payload(encode_pil_image(image))


@pytest.mark.parametrize("kind", ["PNG", "JPEG"])
def test_an_rgb_png_or_jpeg_file_is_sent_as_its_own_bytes(tmp_path: Path, kind: str) -> None:
    path = tmp_path / f"board.{kind.lower()}"
    _board().save(path, format=kind)
    url, digest = _sent(str(path), fast=True)
    assert url.startswith(f"data:image/{kind.lower()};base64,")
    assert _payload(url) == path.read_bytes()
    assert digest == "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()[:16]


@pytest.mark.parametrize("kind", ["rgba", "rotated jpeg", "gif"])
def test_other_files_are_re_encoded_from_their_rgb_pixels(tmp_path: Path, kind: str) -> None:
    board = _board()
    if kind == "rgba":
        path = tmp_path / "board.png"
        board.convert("RGBA").save(path)
    elif kind == "rotated jpeg":
        path = tmp_path / "board.jpg"
        exif = Image.Exif()
        exif[0x0112] = 6  # rotated: the embedded engine would turn it, vLLM would not
        board.save(path, format="JPEG", exif=exif)
    else:
        path = tmp_path / "board.gif"
        board.save(path, format="GIF")
    url, _ = _sent(path, fast=True)
    with Image.open(path) as opened:
        expected = opened.convert("RGB")
    assert _payload(url) != path.read_bytes()
    assert _payload(url) == fast_png(expected)


def test_files_in_prompts_are_re_encoded_as_before(tmp_path: Path) -> None:
    path = tmp_path / "board.png"
    _board().save(path)
    url, _ = _sent(path, fast=False)
    with Image.open(path) as opened:
        assert url == encode_pil_image(opened)
