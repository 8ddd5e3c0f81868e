"""The verl tier: the cases of ``verl_cases/`` (verl's real classes driving ``FsmRolloutAgentLoop``) run in a
python that has verl, and must all pass.

verl cannot be installed beside the project's pins (see :mod:`verl_venv`), so the cases run in a subprocess: with
the running interpreter when it has verl, else with the layered venv :func:`verl_venv.ensure_venv` builds once into
the fsm-rollout cache (verl and six packages installed without dependencies, over this venv's site-packages). A venv
that cannot be built fails the test, in CI and elsewhere, with the failing command's output; so does a case run that
fails, errors, skips or runs nothing.
"""

from __future__ import annotations

import pathlib
import re
import sys
import time

import pytest
import verl_venv

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_verl_cases_pass_in_a_python_that_has_verl(tmp_path: pathlib.Path) -> None:
    started = time.perf_counter()
    if verl_venv.verl_in_process():
        python, how = sys.executable, "the running interpreter"
    else:
        was_built = verl_venv.is_complete(verl_venv.venv_dir())
        try:
            venv = verl_venv.ensure_venv()
        except verl_venv.BuildError as error:
            pytest.fail(f"the layered verl venv could not be built:\n{error}", pytrace=False)
        python = str(venv / "bin" / "python")
        how = "reused" if was_built else f"built in {verl_venv.venv_info()['build_seconds']} s"
        how = f"the layered venv {venv} ({how})"
    ready = time.perf_counter() - started
    run = verl_venv.run_cases(python, tmp_path / "verl-cases.xml", cwd=ROOT)
    summary = (
        f"verl cases with {how}: python ready in {ready:.1f} s, cases ran in {run.seconds:.1f} s; "
        f"{run.tests} tests, {run.failures} failed, {run.errors} errors, {run.skipped} skipped"
    )
    print(summary)
    assert not run.problems(), f"{summary}: {run.problems()}\n--- the cases' pytest run ---\n{run.output}"


def test_a_case_run_counts_as_passing_only_when_every_case_ran_and_passed(tmp_path: pathlib.Path) -> None:
    """The verdict the tier's test asserts on, from a real pytest run of case files (with this venv's python)."""
    (tmp_path / "verl_case_mixed.py").write_text(
        "import pytest\n\n"
        "def test_passes():\n    assert True\n\n"
        "def test_skips():\n    pytest.skip('no verl here')\n\n"
        "def test_fails():\n    assert 1 == 2, 'a broken case'\n",
        encoding="utf-8",
    )
    run = verl_venv.run_cases(sys.executable, tmp_path / "mixed.xml", cwd=ROOT, cases_dir=tmp_path)
    assert (run.tests, run.failures, run.errors, run.skipped) == (3, 1, 0, 1)
    assert run.problems() == ["pytest exited 1", "1 failed", "1 skipped"]
    assert "a broken case" in run.output
    (tmp_path / "verl_case_mixed.py").write_text("def test_passes():\n    assert True\n", encoding="utf-8")
    assert verl_venv.run_cases(sys.executable, tmp_path / "ok.xml", cwd=ROOT, cases_dir=tmp_path).problems() == []
    (tmp_path / "verl_case_mixed.py").write_text("X = 1\n", encoding="utf-8")
    empty = verl_venv.run_cases(sys.executable, tmp_path / "empty.xml", cwd=ROOT, cases_dir=tmp_path)
    assert empty.problems() == ["pytest exited 5", "no test ran"]


def test_the_adapters_docstring_gives_the_recipe_the_tier_installs() -> None:
    """The adapter's module docstring tells users what to install; it is read as text (importing it needs verl)."""
    source = (ROOT / "fsm_rollout" / "adapters" / "verl_agent_loop.py").read_text(encoding="utf-8")
    docstring = source.split('"""')[1]
    command = re.search(r"pip install --no-deps (.+?)\n\n", docstring, re.S)
    assert command is not None, "the docstring lost its pip install line"
    assert tuple(command.group(1).replace("\\", " ").split()) == verl_venv.RECIPE


def test_importing_the_adapter_without_verl_names_the_install_line() -> None:
    """Without verl, the import fails in one line that says how to install it (the same pinned recipe)."""
    if verl_venv.verl_in_process():
        pytest.fail("this test needs an interpreter without verl; the project's venv has none", pytrace=False)
    with pytest.raises(ImportError) as raised:
        __import__("fsm_rollout.adapters.verl_agent_loop")
    message = str(raised.value)
    assert "needs verl, which is not an extra of fsm-rollout" in message
    assert " ".join(verl_venv.RECIPE) in message
