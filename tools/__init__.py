"""Maintainers' tools, run from a checkout (``python -m tools.NAME``); not part of the installed package."""
