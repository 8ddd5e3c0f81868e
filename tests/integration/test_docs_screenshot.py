"""The README's screenshot (docs/report.png, written by the maintainers' ``python -m tools.docs``) shows the page
today's code writes for the kept demo run, and goes stale when that page changes."""

from __future__ import annotations

import shutil
from pathlib import Path

from tools.screenshot import SCREENSHOT, SOURCE_DIR, screenshot_problem, text_chunk, with_text_chunk

REPO = Path(__file__).resolve().parents[2]


def test_the_readme_screenshot_is_of_todays_report() -> None:
    """docs/report.png carries the fingerprint of the page it shows; `python -m tools.docs` shoots it again."""
    assert screenshot_problem(REPO) is None, "run `python -m tools.docs` and commit docs/report.png"


def test_a_screenshot_of_another_page_is_stale(tmp_path: Path) -> None:
    shutil.copytree(REPO / SOURCE_DIR, tmp_path / SOURCE_DIR)
    assert screenshot_problem(tmp_path) == f"{SCREENSHOT} is missing"
    png = (REPO / SCREENSHOT).read_bytes()
    stripped = png.replace(b"fsm-rollout-report\0", b"fsm-rollout-other!\0")
    (tmp_path / SCREENSHOT).write_bytes(with_text_chunk(stripped, "0" * 64))
    assert text_chunk((tmp_path / SCREENSHOT).read_bytes()) == "0" * 64
    assert "shows another report" in str(screenshot_problem(tmp_path))
    (tmp_path / SCREENSHOT).write_bytes(png)
    assert screenshot_problem(tmp_path) is None
    results = tmp_path / SOURCE_DIR / "results.jsonl"  # a changed reward changes the page
    results.write_text(results.read_text().replace('"reward":1.0', '"reward":0.5', 1))
    assert "shows another report" in str(screenshot_problem(tmp_path))
