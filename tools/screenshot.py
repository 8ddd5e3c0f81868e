"""The README's screenshot of a report, kept in step with the code that draws it.

``docs/report.png`` is headless Chromium's picture of the page ``fsm-rollout report`` writes for the small demo
run kept in ``docs/report-run/`` (trace, tape and results of ``fsm-rollout run --limit 3 --seed 0 --record``).
A PNG's pixels depend on the machine's fonts, so it is not compared byte for byte: it carries, in a ``tEXt``
chunk, the fingerprint of the page it shows (the SHA-256 of the page, with the lifecycle picture, which depends on
the Graphviz version, standing in as the SHA-256 of its DOT text). :func:`screenshot_problem` rebuilds the page
and compares fingerprints, so a change to the report's data, script or style makes the screenshot stale until
``python -m tools.docs`` shoots it again.
"""

from __future__ import annotations

import asyncio
import hashlib
import struct
import tempfile
import zlib
from pathlib import Path
from typing import Any

SOURCE_DIR = Path("docs") / "report-run"
SCREENSHOT = Path("docs") / "report.png"
CHUNK_KEY = b"fsm-rollout-report"
VIEWPORT = (1400, 1000)


def kept_by(root: Path | None) -> Path | None:
    """``root`` when it is a checkout that keeps the run the screenshot shows, else None."""
    return root if root is not None and (root / SOURCE_DIR).is_dir() else None


def build_docs_report(root: Path) -> Any:
    """The report of the kept demo run, decoded with the Qwen tokenizer the project ships for tests (the demo
    model's vocabulary), so it builds the same on any machine."""
    from fsm_rollout.engine.local.vocab import load_qwen_tokenizer
    from fsm_rollout.report import build_report

    source = root / SOURCE_DIR
    return build_report(source / "trace.jsonl", results=source / "results.jsonl", tokenizer=load_qwen_tokenizer())


def fingerprint(data: Any) -> str:
    """The SHA-256 of the page, with the lifecycle picture replaced by the hash of its DOT text."""
    from fsm_rollout.report.page import render_page

    index = dict(data.index)
    index["lifecycle"] = {**index["lifecycle"], "svg": None, "svg_error": None}
    return hashlib.sha256(render_page(index, data.details).encode()).hexdigest()


def _chunks(png: bytes) -> list[tuple[bytes, bytes]]:
    if not png.startswith(b"\x89PNG\r\n\x1a\n"):
        raise ValueError("not a PNG")
    chunks, position = [], 8
    while position < len(png):
        (length,) = struct.unpack(">I", png[position : position + 4])
        kind = png[position + 4 : position + 8]
        chunks.append((kind, png[position + 8 : position + 8 + length]))
        position += 12 + length
    return chunks


def text_chunk(png: bytes, key: bytes = CHUNK_KEY) -> str | None:
    """The value of a PNG's ``tEXt`` chunk named ``key``, or None."""
    for kind, body in _chunks(png):
        if kind == b"tEXt" and body.startswith(key + b"\0"):
            return body[len(key) + 1 :].decode("latin-1")
    return None


def with_text_chunk(png: bytes, value: str, key: bytes = CHUNK_KEY) -> bytes:
    """The PNG with a ``tEXt`` chunk ``key`` = ``value`` right after its header."""
    body = key + b"\0" + value.encode("latin-1")
    chunk = struct.pack(">I", len(body)) + b"tEXt" + body + struct.pack(">I", zlib.crc32(b"tEXt" + body))
    (header_length,) = struct.unpack(">I", png[8:12])
    cut = 8 + 12 + header_length
    return png[:cut] + chunk + png[cut:]


def screenshot_problem(root: Path) -> str | None:
    """Why ``docs/report.png`` is not the picture of today's report of the kept run, or None when it is."""
    path = root / SCREENSHOT
    if not path.is_file():
        return f"{SCREENSHOT} is missing"
    recorded = text_chunk(path.read_bytes())
    if recorded != fingerprint(build_docs_report(root)):
        return f"{SCREENSHOT} shows another report than today's code writes for {SOURCE_DIR}"
    return None


async def _shoot(page: Path, output: Path) -> None:
    from tools.chromium import Chromium

    async with Chromium(width=VIEWPORT[0], height=VIEWPORT[1]) as browser:
        await browser.open(page.as_uri())
        await browser.wait_for("document.body.dataset.ready")
        await browser.screenshot(output)


def write_screenshot(root: Path) -> Path:
    """Shoot ``docs/report.png`` again (needs Chromium) and stamp it with the page's fingerprint."""
    from fsm_rollout.report import write_report

    data = build_docs_report(root)
    target = root / SCREENSHOT
    with tempfile.TemporaryDirectory(prefix="fsm-rollout-report-shot-") as scratch:
        page = write_report(data, Path(scratch) / "report.html")
        shot = Path(scratch) / "report.png"
        asyncio.run(_shoot(page, shot))
        target.write_bytes(with_text_chunk(shot.read_bytes(), fingerprint(data)))
    return target
