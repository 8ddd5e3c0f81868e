"""The report's HTML: a fixed skeleton, the CSS and script inline, and the data as inert JSON elements.

Nothing from the run is written as markup. The data goes into ``<script type="application/json">`` elements (a
type the browser never runs), with every ``<``, ``>`` and ``&`` written as a JSON ``\\u`` escape, so no value can
end the element or open another; ``JSON.parse`` gives the exact text back, and the script shows it with
``textContent``. The page is deterministic: the same inputs give the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from fsm_rollout.report.assets import CSS, SCRIPT, VIEWS_SCRIPT


def json_for_script(value: Any) -> str:
    """``value`` as JSON that is safe inside a ``<script type="application/json">`` element."""
    # three replaces rather than one str.translate: translate to several characters is a slow per-character path
    text = orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_page(index: dict[str, Any], details: Sequence[dict[str, Any]], *, title: str = "fsm-rollout report") -> str:
    """The whole page: ``index`` parsed on load, each of ``details`` (one per row) only when its sample is opened."""
    parts = [
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n',
        # the page may load nothing from anywhere: images are data URLs, everything else is inline
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; img-src data:; '
        "style-src 'unsafe-inline'; script-src 'unsafe-inline'\">\n",
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n',
        f"<title>{_escape_text(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n",
        '<div id="app"><p class="loading">loading…</p></div>\n',
        f'<script type="application/json" id="report-index">{json_for_script(index)}</script>\n',
    ]
    # the script comes before the samples' data: the page is drawn while the parser still reads that data
    parts.append(f"<script>{VIEWS_SCRIPT}</script>\n<script>{SCRIPT}</script>\n")
    parts.extend(
        f'<script type="application/json" id="d{position}">{json_for_script(page)}</script>\n'
        for position, page in enumerate(details)
    )
    parts.append("</body>\n</html>\n")
    return "".join(parts)


def _escape_text(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
