"""The seed differential over real thinking-model chat templates: ``compat.generate`` refuses a template only where
the seed does.

Every scenario of :mod:`test_seed_differential` runs again with the tokenizer wearing a shipped template
(:mod:`fsm_rollout.testing.chat_templates`) and its thinking switches in ``apply_chat_template_kwargs``. The seed
checks a template once per observation, with its dummy-prefix method, and nowhere else; so:

* a scenario the seed completes must complete identically under the library (everything
  :func:`test_seed_differential.assert_same_run` compares);
* a scenario the seed fails must fail in the library with an instance of the seed's builtin error class, after the
  same requests (the refusal comes at the same moment).

Qwen3 with ``enable_thinking=False`` pre-fills an empty think block in the generation prompt; a start-up template
probe refused such a template before the first request, where the seed completes every scenario that ends before an
observation. Each side gets its own fake server: a side that fails mid-script leaves turns in its queue.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import AsyncIterator, Mapping
from types import ModuleType
from typing import Any

import pytest
from test_seed_differential import (  # the differential's machinery (pytest puts this directory on sys.path)
    MODEL,
    SCENARIOS,
    Case,
    assert_same_run,
    fake_vllm,
    library,
    make_sample,
    run_side,
    seed,
)

import fsm_rollout
from fsm_rollout.testing.chat_templates import tokenizer_with_chat_template
from fsm_rollout.testing.fake_vllm import FakeVLLMServer

__all__ = ["fake_vllm", "library", "seed"]  # fixtures used here by name

# (template, its switches): Qwen3 without thinking is the regression; Qwen3.6 opens <think> in the generation
# prompt and strips history thinking unless preserve_thinking is on.
TEMPLATES: Mapping[str, tuple[str, Mapping[str, Any]]] = {
    "qwen3-no-thinking": ("qwen3", {"enable_thinking": False}),
    "qwen3": ("qwen3", {}),
    "qwen3_6-no-thinking": ("qwen3_6", {"enable_thinking": False}),
    "qwen3_6-preserve-thinking": ("qwen3_6", {"preserve_thinking": True}),
}


@pytest.fixture
def tokenizer(request: pytest.FixtureRequest) -> Any:
    """The Qwen tokenizer wearing the test's template (overrides the shared fixture for the seed, the stand-in,
    the fake server and the library alike)."""
    name, _ = TEMPLATES[request.node.callspec.params["template"]]
    return _shared_tokenizer(name)


@functools.cache
def _shared_tokenizer(name: str) -> Any:
    return tokenizer_with_chat_template(name)  # one copy per template: nothing here changes a tokenizer


@pytest.fixture
async def library_server(tokenizer: Any) -> AsyncIterator[FakeVLLMServer]:
    async with FakeVLLMServer(tokenizer, model=MODEL, weight_version_spans=False) as server:
        yield server


def with_switches(case: Case, switches: Mapping[str, Any]) -> Case:
    own = dict(case.args.get("apply_chat_template_kwargs") or {})
    return dataclasses.replace(case, args={**case.args, "apply_chat_template_kwargs": {**own, **switches}})


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("template", list(TEMPLATES))
async def test_library_refuses_a_thinking_template_only_where_the_seed_does(
    template: str,
    scenario: str,
    seed: ModuleType,
    library: Any,
    fake_vllm: FakeVLLMServer,
    library_server: FakeVLLMServer,
    tokenizer: Any,
) -> None:
    case = with_switches(SCENARIOS[scenario](tokenizer), TEMPLATES[template][1])
    seed_run = await run_side(seed.generate, make_sample(seed.Sample, case), fake_vllm, case, expect_error=None)
    library_sample = make_sample(fsm_rollout.Sample, case)
    library_run = await run_side(
        library.generate, library_sample, library_server, case, expect_error=seed_run.error is not None
    )
    if seed_run.error is None:
        assert_same_run(seed_run, library_run, case, kind="fsm_rollout_sample", seed=seed)
        return
    builtin = next(kind for kind in (ValueError, TypeError, RuntimeError, KeyError) if isinstance(seed_run.error, kind))
    assert isinstance(library_run.error, builtin), f"library raised {library_run.error!r}, seed {seed_run.error!r}"
    if case.compare_paths:
        assert [r.path for r in library_run.requests] == [r.path for r in seed_run.requests]
