"""The report's stylesheet and script are files of their own, checked as CSS and JavaScript."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from fsm_rollout.report import assets

REQUIRED_IN_CI = os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def test_the_page_inlines_the_package_files_verbatim() -> None:
    css = (assets.STATIC / "report.css").read_text(encoding="utf-8")
    script = (assets.STATIC / "report.js").read_text(encoding="utf-8")
    views = (assets.STATIC / "report_views.js").read_text(encoding="utf-8")
    assert assets.CSS.strip() == css.strip()
    assert assets.SCRIPT.strip() == script.strip()
    assert assets.VIEWS_SCRIPT.strip() == views.strip()


@pytest.mark.parametrize("name", ["report.js", "report_views.js"])
def test_the_script_parses_as_javascript(tmp_path: pytest.TempPathFactory, name: str) -> None:
    node = shutil.which("node")
    if node is None:
        if REQUIRED_IN_CI:
            pytest.fail("node is needed in CI to check the report's script")
        pytest.skip("node is not installed")
    script = assets.STATIC / name
    result = subprocess.run([node, "--check", str(script)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("script", [assets.SCRIPT, assets.VIEWS_SCRIPT], ids=["report", "views"])
def test_the_script_stays_strict_and_never_writes_markup(script: str) -> None:
    # the page's safety rests on these: every text reaches the DOM as a text node
    assert script.lstrip().startswith('"use strict";')
    assert "innerHTML" not in script and "outerHTML" not in script
    assert re.search(r"\beval\s*\(", script) is None
    assert "document.write" not in script


def _css_blocks(css: str) -> list[tuple[str, str]]:
    """(prelude, body) of each innermost block; raises on unbalanced braces."""
    blocks: list[tuple[str, str]] = []
    depth, start, prelude_start = 0, 0, 0
    for position, char in enumerate(css):
        if char == "{":
            depth += 1
            start = position + 1
            blocks.append((css[prelude_start:position].strip(), ""))
        elif char == "}":
            if depth == 0:
                raise ValueError(f"unbalanced '}}' at offset {position}")
            depth -= 1
            if blocks and blocks[-1][1] == "":
                blocks[-1] = (blocks[-1][0], css[start:position])
            prelude_start = position + 1
    if depth:
        raise ValueError("unclosed '{'")
    return blocks


def _css_problems(css: str) -> list[str]:
    problems = []
    for prelude, body in _css_blocks(re.sub(r"/\*.*?\*/", "", css, flags=re.S)):
        if not prelude:
            problems.append(f"a block without a selector: {body[:60]!r}")
        for declaration in filter(None, (part.strip() for part in body.split(";"))):
            name, colon, value = declaration.partition(":")
            if not colon or not value.strip():
                problems.append(f"in {prelude!r}: {declaration!r} is not a declaration")
            elif re.fullmatch(r"-{0,2}[a-zA-Z][\w-]*", name.strip()) is None:
                problems.append(f"in {prelude!r}: bad property {name!r}")
    return problems


def test_the_stylesheet_is_well_formed() -> None:
    assert _css_blocks(assets.CSS), "no rules"
    assert _css_problems(assets.CSS) == []


def test_the_stylesheet_check_finds_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="unclosed"):
        _css_blocks("a{color:red")
    assert _css_problems("a{color red}") == ["in 'a': 'color red' is not a declaration"]
    assert _css_problems("{color:red}") == ["a block without a selector: 'color:red'"]
