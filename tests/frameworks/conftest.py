"""The agent-framework tier: real agent frameworks from PyPI, unchanged, drive the gateway (marked ``frameworks``).

Each framework is a pinned part of the ``dev`` extra, so the tier runs wherever the tests run; ``-m "not
frameworks"`` leaves it out. litellm fetches its model cost map from the network at import unless told to use the
local copy, so the tier sets that before anything imports it.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.frameworks)
