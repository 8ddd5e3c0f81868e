"""The README's in-process embedding example is the code of ``fsm_rollout.examples.embed_local``, and it runs."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from fsm_rollout.engine.local import tiny_model_dir
from fsm_rollout.examples import embed_local
from fsm_rollout.machine import lifecycle

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "fsm_rollout" / "examples" / "embed_local.py"


def example_body() -> str:
    """The module's source after its docstring: what the README must show."""
    source = EXAMPLE.read_text()
    docstring = ast.parse(source).body[0]
    assert isinstance(docstring, ast.Expr) and isinstance(docstring.value, ast.Constant)
    lines = source.splitlines(keepends=True)
    return "".join(lines[docstring.end_lineno :]).strip("\n") + "\n"


def readme_python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_the_readme_shows_the_in_process_example_verbatim() -> None:
    assert example_body() in readme_python_blocks()


async def test_the_in_process_example_runs_against_the_embedded_engine() -> None:
    samples = await embed_local.main(tiny_model_dir())

    assert len(samples) == 8
    for sample in samples:
        assert sample.status.value in lifecycle.TERMINAL - {"failed"}, sample.metadata.get("rollout_error")
        assert sample.metadata["rollout_reason"]
        assert len(sample.loss_mask) == len(sample.rollout_log_probs or []) == sample.response_length
    # the first group ran before the weight push, the second after it, under the version the push set
    first, second = samples[:4], samples[4:]
    for sample in first:
        assert {span["version"] for span in sample.metadata["weight_version_spans"]} <= {"default"}
    for sample in second:
        assert {span["version"] for span in sample.metadata["weight_version_spans"]} <= {"step-1"}
    assert any(sample.metadata["weight_version_spans"] for sample in second)
