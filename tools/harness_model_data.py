"""The harness model's shipped request templates: Codex CLI's and Claude Code's first requests, as the gateway sees
them.

The embedded engine's harness model (:mod:`fsm_rollout.engine.local.harness_model`) is trained on the prompts the
gateway really renders for these harnesses. This module reads one recorded first request of each
(``tests/fixtures/harness/{codex,claude}-request-1.json``), converts it with the gateway's own parsers (a Responses
request and a Messages request become chat messages and tools, as the gateway sends them to the engine), puts
placeholders where a run differs (the task, the working directory, the harness's home, the date) and writes the
result beside the engine's module (``python -m tools.harness_model_data`` from a checkout); a test checks that the
shipped copy is what it would write today.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys
from typing import Any, Final

from fsm_rollout.engine.local.harness_data import (
    HARNESSES,
    PLACEHOLDERS,
    SHIPPED_TEMPLATES,
    HarnessTemplate,
    write_templates,
)
from fsm_rollout.gateway.messages_wire import parse_messages_request
from fsm_rollout.gateway.responses_wire import parse_responses_request

__all__ = ["CAPTURES", "harness_templates"]

CAPTURES: Final = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "harness"
"""The recorded requests (see ``/work/captures/README.md`` of the harness branch for how they were captured)."""

#: What each capture's run had where a run differs (its task, its directories, its date).
_RECORDED: Final[dict[str, dict[str, str]]] = {
    "codex": {
        "task": "Write the word hi into out.txt",
        "home": "/tmp/cap/codexhome",
        "cwd": "/tmp/cap/codexcwd",
        "date": "2026-12-06",
    },
    "claude": {
        "task": "Write the word hi into out.txt",
        "home": "/tmp/cap/claudehome",
        "cwd_slug": "-tmp-cap-claudecwd",
        "cwd": "/tmp/cap/claudecwd",
        "date": "2026-12-06",
    },
}


def _placeheld(value: Any, recorded: dict[str, str]) -> Any:
    if isinstance(value, str):
        for field, text in recorded.items():  # the slug before the cwd it contains
            value = value.replace(text, PLACEHOLDERS[field])
        return value
    if isinstance(value, list):
        return [_placeheld(each, recorded) for each in value]
    if isinstance(value, dict):
        return {key: _placeheld(each, recorded) for key, each in value.items()}
    return value


def harness_templates(captures: pathlib.Path = CAPTURES) -> dict[str, HarnessTemplate]:
    """Each harness's first request as the gateway's chat call, with the placeholders."""
    templates = {}
    for harness in HARNESSES:
        recorded = json.loads((captures / f"{harness}-request-1.json").read_text(encoding="utf-8"))
        if harness == "codex":
            call = parse_responses_request(recorded["body"]).chat_call()
        else:
            call = parse_messages_request(recorded["body"], recorded["headers"]).call
        for field, text in _RECORDED[harness].items():
            if not re.search(re.escape(text), json.dumps([call.messages, call.tools])):
                raise ValueError(f"{harness}: the capture has no {field} {text!r}")
        templates[harness] = HarnessTemplate(
            _placeheld(call.messages, _RECORDED[harness]), _placeheld(call.tools or [], _RECORDED[harness])
        )
    return templates


if __name__ == "__main__":
    path = write_templates(harness_templates(), SHIPPED_TEMPLATES)
    print(f"wrote {path} ({path.stat().st_size} bytes)", file=sys.stderr)
