"""A recorded run as one self-contained web page: ``fsm-rollout report``.

The page is one HTML file with its CSS and script inline; it loads nothing from anywhere (images are data URLs)
and works from ``file://``. It shows the run summary, where time went, the lifecycle with the run's counts on its
edges, a table of sample runs (filtered, sorted, virtual: only the visible rows exist), and one sample's page on
click: its timeline, conversation, token strip and replay divergence.

Safe by construction: every text from the run (model output, environment text, tool arguments, prompts) is data.
It is put in the page as JSON inside ``<script type="application/json">`` elements with ``<``, ``>`` and ``&``
escaped, so no text can close the element, and the page's script builds the DOM with ``textContent`` only.

It scales: each sample's page data is its own JSON element, parsed only when the sample is opened.

* :mod:`~fsm_rollout.report.model`: reading the inputs, the run summary, the lifecycle usage, the rows;
* :mod:`~fsm_rollout.report.detail`: one sample's timeline, conversation and token strip;
* :mod:`~fsm_rollout.report.page`: the HTML writer; :mod:`~fsm_rollout.report.assets`: the page's CSS and script.

Its modules are internal: use the names this package exports.

The benchmark of its figures, the synthetic runs it and the scale test use, the headless Chromium the browser tests
drive and the README's screenshot are maintainers' tools outside the package (``tools/`` of a checkout).
"""

from __future__ import annotations

from fsm_rollout.report.build import ReportData, build_report, write_report
from fsm_rollout.report.model import ReportInputError

__all__ = ["ReportData", "ReportInputError", "build_report", "write_report"]
