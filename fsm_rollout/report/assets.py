"""The report page's CSS and script, inline in every report (a report is one file that needs nothing else).

They are package data files (``static/report.css``, ``static/report.js`` and ``static/report_views.js``), so they
are edited and checked as what they are (``node --check`` parses the script in the tests), and read once, at import.

The script reads the JSON elements :mod:`fsm_rollout.report.page` writes and builds the page with DOM calls.
Every text from the run reaches the page through ``textContent`` (the ``h`` helper turns strings into text nodes),
attributes through ``setAttribute`` / properties, and images only as ``data:image/`` URLs; the script never assigns
``innerHTML`` or calls ``eval``. The sample table is virtual (only the rows in view exist), and a sample's data is
parsed when the sample is opened.
"""

from __future__ import annotations

from importlib import resources

STATIC = resources.files("fsm_rollout.report") / "static"
"""Where the page's stylesheet and script live in the installed package."""

CSS = "\n" + (STATIC / "report.css").read_text(encoding="utf-8")
SCRIPT = "\n" + (STATIC / "report.js").read_text(encoding="utf-8")
VIEWS_SCRIPT = "\n" + (STATIC / "report_views.js").read_text(encoding="utf-8")
"""The training views (token trees, mismatch), a script of their own that runs before :data:`SCRIPT` calls it."""
