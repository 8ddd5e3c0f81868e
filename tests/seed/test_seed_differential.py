"""Differential test: the real seed rollout and ``fsm_rollout.compat.generate`` against one fake vLLM server.

Each scenario runs the seed (``shared/seed/geo3k_rollout_seed.py``, loaded from its path, never copied) first and
then the library's drop-in ``generate``, each against a fresh copy of the same scripted turns and the same scripted
environment (``fsm_rollout.testing.envs``), and asserts they leave the same sample behind and send the same HTTP
requests. The seed's ``vime`` imports are served by the test-only stand-in in ``tests/seed/vime_standin`` (written
independently of the library, importing nothing from ``fsm_rollout``), which is on ``sys.path`` only during a test.

The seed is found at ``<repository>/../shared/seed/geo3k_rollout_seed.py`` or at ``$FSM_ROLLOUT_SEED``. When it is
missing the tests fail if ``$CI`` is set and are skipped loudly otherwise (``conftest.py`` says how).

Compared after a successful run: ``tokens``, ``loss_mask``, ``rollout_log_probs``, ``response_length``,
``response``, the status value, ``metadata`` (including ``multiturn_truncation``), ``weight_versions``, the top-p
ids and offsets, ``rollout_routed_experts``, the prefix-cache counters, ``multimodal_train_inputs``, whether the
caller's metadata dict was mutated, the environment calls, and the HTTP requests (paths in order; token_ids and
sampling_params of each generate; full render bodies and full generate bodies except ``request_id``; the
``x-session-id`` header). Compared after a failing run: the builtin exception class (ValueError, TypeError,
RuntimeError, KeyError; the library's class must be an instance of the seed's) and the request paths sent before
the failure; the messages need not be similar, and the sample's final status is not compared (the README documents
that the library ends a failed sample ``failed``).

Known, intended differences, deliberately not asserted equal here:

* the library sends a ``request_id`` in every generate body (the seed drops the render's ``request_id`` so the
  server assigns one); that key is ignored when generate bodies are compared;
* the library rejects routing replay together with stop strings and EOS-after-stop when the rollout starts, while
  the seed raises only at the turn that would inject the EOS: the ``replay_with_stop_eos`` error scenario does not
  compare request paths (the exception class is still compared);
* the library validates ``max_new_tokens`` and ``rollout_max_context_len`` before any request, while the seed
  renders the prompt first and then raises: the ``negative_*`` error scenarios do not compare request paths;
* the library takes a turn's weight version from ``choices[0].weight_versions`` when the answer has no top-level
  ``weight_version`` (upstream vLLM sends only the spans), while the seed reads only the top-level one: the fake
  server here sends no spans (``weight_version_spans=False``), so ``weight_versions`` compare the top-level ones;
* the seed refuses ``partial_rollout=True``; the library supports it (a sample suspended for a weight update is
  handed back with a resume state), so without a suspension it runs the sample as usual
  (``test_partial_rollout_the_seed_refuses_runs_as_usual``);
* the library does not retry HTTP 4xx answers (the seed's ``post`` retries everything); the fault scenarios here
  use only failures both sides retry (HTTP 503, a dropped connection), and the stand-in's ``post`` makes only 3
  attempts 10 ms apart instead of vime's 60 one second apart (documented in
  ``vime_standin/vime/utils/http_utils.py``).

With no token budget at all (``max_new_tokens=None`` and no context limit) both sides send ``"max_tokens": null``;
the ``unlimited_budget`` scenario asserts it. The library's additive ``metadata["rollout_reason"]`` /
``metadata["rollout_error"]``, ``metadata["weight_version_spans"]`` / ``metadata["start_weight_version"]``,
``metadata["observations"]``, ``metadata["routed_expert_spans"]`` and ``metadata["constrained_spans"]`` (README) are
left out when metadata is compared.
"""

from __future__ import annotations

import base64
import copy
import importlib
import importlib.util
import io
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pytest
from PIL import Image

import fsm_rollout
from fsm_rollout import compat
from fsm_rollout.testing import envs as scripted_envs
from fsm_rollout.testing.fake_vllm import GENERATE_PATH, RENDER_PATH, FakeVLLMServer, ScriptedTurn

HERE = Path(__file__).resolve().parent
SEED_MODULE_NAME = "geo3k_rollout_seed_under_test"
ENV_MODULE = "fsm_rollout.testing.envs"
NO_BUILD_ENV_FILE = HERE / "env_without_build_env.py"
MODEL = "fake-model"
EOS = "<|im_end|>"
PROMPT = "What is 6 * 7?"
SAMPLING: Mapping[str, Any] = {"max_new_tokens": 64, "temperature": 1.0, "top_p": 1.0}
OBSERVATION = scripted_envs.CONTINUE[0]
STOP_SAMPLING: Mapping[str, Any] = {**SAMPLING, "stop": ["</answer>"], "no_stop_trim": True}
SESSION_HEADER = "x-session-id"
# The library's generate body carries a request_id the seed never sends (an intended difference).
LIBRARY_ONLY_GENERATE_KEYS = frozenset({"request_id"})
# Metadata the library adds on top of the seed's (README: "rollout_reason" on every end, "rollout_error" on errors,
# the weight versions of the generated tokens, the record of each appended observation, which request each span of
# routed experts came from, which turns a grammar constrained).
LIBRARY_ONLY_METADATA_KEYS = frozenset(
    {
        "rollout_reason",
        "rollout_error",
        "weight_version_spans",
        "start_weight_version",
        "observations",
        "routed_expert_spans",
        "constrained_spans",
    }
)


@pytest.fixture
def seed(seed_file: Path, vime_standin: ModuleType) -> Iterator[ModuleType]:
    """The seed rollout module, executed from its path against the vime stand-in."""
    path = seed_file
    spec = importlib.util.spec_from_file_location(SEED_MODULE_NAME, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[SEED_MODULE_NAME] = module  # dataclasses look their module up while the file executes
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(SEED_MODULE_NAME, None)
        sys.modules.pop(f"rollout_env_{NO_BUILD_ENV_FILE.stem}", None)  # the seed registers file-loaded envs


@pytest.fixture
async def fake_vllm(tokenizer: Any) -> AsyncIterator[FakeVLLMServer]:
    """The shared fake server, but without weight-version spans (see the module docstring)."""
    async with FakeVLLMServer(tokenizer, model=MODEL, weight_version_spans=False) as server:
        yield server


@pytest.fixture
async def library(tokenizer: Any) -> Any:
    """``fsm_rollout.compat`` with the test tokenizer registered; its HTTP clients are closed after the test."""
    compat.register_tokenizer(MODEL, tokenizer)
    yield compat
    await compat.close_clients()


# ------------------------------------------------------------------------------------------- scenario helpers


def ids_of(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def token_ids(encoded: Any) -> list[int]:
    if isinstance(encoded, Mapping) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]
    return [int(token) for token in encoded]


def prompt_length(tokenizer: Any, text: str = PROMPT) -> int:
    """Length of the rendered default prompt (one user message with one text part)."""
    messages = [{"role": "user", "content": [{"type": "text", "text": text}]}]
    return len(token_ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)))


def boundary_length(tokenizer: Any, observation: str = OBSERVATION, *, after_eos: bool = False) -> int:
    """Tokens that close an assistant turn, add a user observation and open the next assistant turn."""
    closing = "" if after_eos else EOS
    text = f"{closing}\n<|im_start|>user\n{observation}{EOS}\n<|im_start|>assistant\n"
    return len(ids_of(tokenizer, text))


def top_p_turn(tokenizer: Any, text: str, weight_version: Any) -> ScriptedTurn:
    """A turn with exact token ids, a kept-id list per token (``sampling_mask``) and a top-level weight version."""
    ids = ids_of(tokenizer, text)
    mask = [[token, token + 1 + index % 3] for index, token in enumerate(ids)]
    return ScriptedTurn(
        token_ids=ids, choice_extra={"sampling_mask": mask}, top_extra={"weight_version": weight_version}
    )


def npy_base64(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def routed_turn(tokenizer: Any, text: str, rows: int, layers: int, topk: int, salt: int) -> ScriptedTurn:
    experts = (np.arange(rows * layers * topk, dtype=np.int32).reshape(rows, layers, topk) + salt) % 64
    return ScriptedTurn(text=text, choice_extra={"routed_experts": npy_base64(experts.astype(np.uint8))})


@dataclass(frozen=True)
class Case:
    """One scenario: what both runs are given, plus what the seed is expected to do (a check on the scenario)."""

    turns: list[ScriptedTurn] = field(default_factory=list)
    sampling: Mapping[str, Any] = field(default_factory=lambda: dict(SAMPLING))
    args: Mapping[str, Any] = field(default_factory=dict)
    sample: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, Any] = field(default_factory=dict)
    session: str | None = None
    faults: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    compare_paths: bool = True
    seed_status: str | None = None
    seed_reason: str | None = None


Builder = Callable[[Any], Case]


def _multi_turn_until_max_turns(tok: Any) -> Case:
    turns = [ScriptedTurn(text=t) for t in ("Let me think.", "Still thinking.", "The answer is 42.")]
    return Case(turns=turns, args={"max_turns": 3}, seed_status="truncated")


def _env_done_on_turn_two(tok: Any) -> Case:
    return Case(
        turns=[ScriptedTurn(text="Maybe 41."), ScriptedTurn(text="It is 42.")],
        env={"steps": [["Try again.", False], ["Correct!", True]]},
        seed_status="completed",
    )


def _length_finish(tok: Any) -> Case:
    return Case(
        turns=[ScriptedTurn(text="This answer is far too long to fit into the tiny budget we allow.")],
        sampling={**SAMPLING, "max_new_tokens": 5},
        seed_status="truncated",
    )


def _length_finish_on_turn_two(tok: Any) -> Case:
    budget = len(ids_of(tok, "Let me think.")) + boundary_length(tok) + 6
    return Case(
        turns=[
            ScriptedTurn(text="Let me think."),
            ScriptedTurn(text="A second answer that is much longer than the six tokens left over."),
        ],
        sampling={**SAMPLING, "max_new_tokens": budget},
        seed_status="truncated",
    )


def _stop_string_with_masked_eos(tok: Any) -> Case:
    return Case(
        turns=[ScriptedTurn(text="<answer>41</answer> and more"), ScriptedTurn(text="<answer>42</answer>")],
        sampling=dict(STOP_SAMPLING),
        args={"max_turns": 2},
        seed_status="truncated",
    )


def _stop_string_without_budget_for_eos(tok: Any) -> Case:
    text = "<answer>42</answer>"
    return Case(
        turns=[ScriptedTurn(text=text)],
        sampling={**STOP_SAMPLING, "max_new_tokens": len(ids_of(tok, text))},
        seed_status="truncated",
        seed_reason="insufficient_budget_for_stop_eos",
    )


def _stop_string_eos_disabled(tok: Any) -> Case:
    return Case(
        turns=[ScriptedTurn(text="<answer>41</answer>"), ScriptedTurn(text="<answer>42</answer>")],
        sampling=dict(STOP_SAMPLING),
        args={"max_turns": 2, "append_eos_token_after_stop_str_in_multi_turn": False},
        seed_status="truncated",
    )


def _observation_not_fitting(tok: Any) -> Case:
    text = "Let me think."
    return Case(
        turns=[ScriptedTurn(text=text)],
        sampling={**SAMPLING, "max_new_tokens": len(ids_of(tok, text)) + boundary_length(tok)},
        seed_status="truncated",
        seed_reason="insufficient_budget_for_next_turn",
    )


def _observation_fitting_minus_one(tok: Any) -> Case:
    text = "Let me think."
    return Case(
        turns=[ScriptedTurn(text=text), ScriptedTurn(text="Done now.")],
        sampling={**SAMPLING, "max_new_tokens": len(ids_of(tok, text)) + boundary_length(tok) + 1},
        seed_status="truncated",
    )


def _zero_budget(tok: Any) -> Case:
    return Case(sampling={**SAMPLING, "max_new_tokens": 0}, seed_status="truncated")


def _unlimited_budget(tok: Any) -> Case:
    return Case(
        turns=[ScriptedTurn(text="One."), ScriptedTurn(text="Two.")],
        sampling={**SAMPLING, "max_new_tokens": None},
        args={"max_turns": 2},
        seed_status="truncated",
    )


def _context_limit(tok: Any) -> Case:
    return Case(
        turns=[ScriptedTurn(text="A long answer that runs past the context limit of this model for sure.")],
        args={"rollout_max_context_len": prompt_length(tok) + 8},
        seed_status="truncated",
    )


def _context_limit_below_prompt(tok: Any) -> Case:
    return Case(
        args={"rollout_max_context_len": prompt_length(tok) - 1},
        seed_status="truncated",
    )


def _server_abort_on_turn_two(tok: Any) -> Case:
    return Case(
        turns=[ScriptedTurn(text="Let me think."), ScriptedTurn(text="Partial answer", finish="abort")],
        seed_status="aborted",
    )


def _eos_terminated_turns(tok: Any) -> Case:
    return Case(
        turns=[ScriptedTurn(text=f"Let me think.{EOS}"), ScriptedTurn(text=f"The answer is 42.{EOS}")],
        args={"max_turns": 2},
        seed_status="truncated",
    )


def _stop_token_ids(tok: Any) -> Case:
    stop_id = tok.convert_tokens_to_ids("<|endoftext|>")
    return Case(
        turns=[
            ScriptedTurn(text="The answer is 41.<|endoftext|> ignored"),
            ScriptedTurn(text="The answer is 42.<|endoftext|>"),
        ],
        sampling={**SAMPLING, "stop_token_ids": [stop_id]},
        args={"max_turns": 2},
        seed_status="truncated",
    )


def _observations_as_text_parts(tok: Any) -> Case:
    return Case(
        turns=[ScriptedTurn(text="Let me think."), ScriptedTurn(text="Done.")],
        env={"steps": [["Look again at the figure.", False]], "observations_as": "parts"},
        args={"max_turns": 2},
        seed_status="truncated",
    )


def _consistent_hash_given_session(tok: Any) -> Case:
    return Case(
        turns=[ScriptedTurn(text="Let me think."), ScriptedTurn(text="Done.")],
        args={"max_turns": 2, "router_policy": "consistent_hash"},
        sample={"session_id": "session-A"},
        session="session-A",
        seed_status="truncated",
    )


def _consistent_hash_new_session(tok: Any) -> Case:
    return Case(
        turns=[ScriptedTurn(text="Let me think."), ScriptedTurn(text="Done.")],
        args={"max_turns": 2, "router_policy": "consistent_hash"},
        seed_status="truncated",
    )


def _tools_and_template_kwargs(tok: Any) -> Case:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "calc_score",
                "description": "Score an answer.",
                "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}},
            },
        }
    ]
    return Case(
        turns=[ScriptedTurn(text='<tool_call>{"name": "calc_score"}</tool_call>'), ScriptedTurn(text="Done.")],
        args={"max_turns": 2, "apply_chat_template_kwargs": {"enable_thinking": False}},
        sample={"metadata": {"tools": tools}},
        env={"steps": [["score: 0.0", False]]},
        seed_status="truncated",
    )


def _sampling_mask_and_weight_version(tok: Any) -> Case:
    return Case(
        turns=[top_p_turn(tok, "Let me think.", 7), top_p_turn(tok, "The answer is 42.", "8")],
        args={"max_turns": 2},
        seed_status="truncated",
    )


def _sampling_mask_with_stop_eos(tok: Any) -> Case:
    return Case(
        turns=[top_p_turn(tok, "<answer>41</answer>", "3"), top_p_turn(tok, "<answer>42</answer>", "4")],
        sampling=dict(STOP_SAMPLING),
        args={"max_turns": 2},
        seed_status="truncated",
    )


def _routing_replay(tok: Any) -> Case:
    layers, topk = 2, 2
    first, second = "Let me think.", "The answer is 42."
    prompt = prompt_length(tok)
    rows_first = prompt + len(ids_of(tok, first)) - 1
    rows_second = rows_first + boundary_length(tok) + len(ids_of(tok, second))
    return Case(
        turns=[
            routed_turn(tok, first, rows_first, layers, topk, salt=1),
            routed_turn(tok, second, rows_second, layers, topk, salt=5),
        ],
        args={"max_turns": 2, "use_rollout_routing_replay": True, "num_layers": layers, "moe_router_topk": topk},
        seed_status="truncated",
    )


def _prompt_as_message_list(tok: Any) -> Case:
    prompt = [
        {"role": "system", "content": "You are a careful geometry tutor."},
        {"role": "user", "content": [{"type": "text", "text": PROMPT}]},
    ]
    return Case(
        turns=[ScriptedTurn(text="Let me think."), ScriptedTurn(text="42.")],
        args={"max_turns": 2},
        sample={"prompt": prompt},
        seed_status="truncated",
    )


def _string_prompt_with_image_tag(tok: Any) -> Case:
    return Case(
        turns=[ScriptedTurn(text="The area is 12.")],
        args={"max_turns": 1},
        sample={"prompt": "<image>  Find the area of the triangle.<image>"},
        seed_status="truncated",
    )


def _env_done_on_turn_one(tok: Any) -> Case:
    return Case(turns=[ScriptedTurn(text="It is 42.")], env={"steps": [["Correct!", True]]}, seed_status="completed")


def _server_abort_on_turn_one(tok: Any) -> Case:
    return Case(turns=[ScriptedTurn(text="Partial answer", finish="abort")], seed_status="aborted")


def _cancelled_finish_reason(tok: Any) -> Case:
    return Case(
        turns=[
            ScriptedTurn(text="Let me think."),
            ScriptedTurn(text="Cut", choice_extra={"finish_reason": "cancelled"}),
        ],
        seed_status="aborted",
    )


def _finish_reason_as_dict(tok: Any) -> Case:
    return Case(
        turns=[
            ScriptedTurn(text="Let me think.", choice_extra={"finish_reason": {"type": "stop"}}),
            ScriptedTurn(text="A longer second answer", choice_extra={"finish_reason": {"type": "length"}}),
        ],
        seed_status="truncated",
    )


def _empty_stop_turn(tok: Any) -> Case:
    return Case(
        turns=[
            ScriptedTurn(token_ids=[], top_extra={"weight_version": "9"}),
            ScriptedTurn(text="Done.", top_extra={"weight_version": "10"}),
        ],
        args={"max_turns": 2},
        seed_status="truncated",
    )


def _prefilled_prompt_tokens(tok: Any) -> Case:
    messages = [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]
    prompt_ids = token_ids(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    return Case(
        turns=[ScriptedTurn(text="42.")], args={"max_turns": 1}, sample={"tokens": prompt_ids}, seed_status="truncated"
    )


def _routed_experts_without_replay(tok: Any) -> Case:
    layers, topk = 3, 1
    text = "The answer is 42."
    rows = prompt_length(tok) + len(ids_of(tok, text)) - 1
    return Case(
        turns=[routed_turn(tok, text, rows, layers, topk, salt=2)],
        args={"max_turns": 1, "num_layers": layers, "moe_router_topk": topk},
        seed_status="truncated",
    )


def _prefix_cache_usage(tok: Any) -> Case:
    def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
        return {
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached},
            }
        }

    return Case(
        turns=[
            ScriptedTurn(text="Let me think.", top_extra=usage(27, 4, 16)),
            ScriptedTurn(text="Done.", top_extra=usage(45, 2, 31)),
        ],
        args={"max_turns": 2},
        seed_status="truncated",
    )


def _transient_503_on_render(tok: Any) -> Case:
    return Case(
        turns=[ScriptedTurn(text="42.")],
        args={"max_turns": 1},
        faults=[(RENDER_PATH, {"status": 503})],
        seed_status="truncated",
    )


def _transient_503_on_generate(tok: Any) -> Case:
    return Case(
        turns=[ScriptedTurn(text="Let me think."), ScriptedTurn(text="42.")],
        args={"max_turns": 2},
        faults=[(GENERATE_PATH, {"status": 503})],
        seed_status="truncated",
    )


def _dropped_connection_on_generate(tok: Any) -> Case:
    return Case(
        turns=[ScriptedTurn(text="42.")],
        args={"max_turns": 1},
        faults=[(GENERATE_PATH, {"reset": True})],
        seed_status="truncated",
    )


def _stop_string_inside_last_token(tok: Any) -> Case:
    # ">." is one token, so the text ends with "</answer>." and no EOS is injected after the first turn.
    return Case(
        turns=[ScriptedTurn(text="<answer>41</answer>. More"), ScriptedTurn(text="<answer>42</answer>")],
        sampling=dict(STOP_SAMPLING),
        args={"max_turns": 2},
        seed_status="truncated",
    )


def _stop_as_plain_string(tok: Any) -> Case:
    return Case(
        turns=[ScriptedTurn(text="<answer>41</answer>"), ScriptedTurn(text="<answer>42</answer>")],
        sampling={**SAMPLING, "stop": "</answer>", "no_stop_trim": True},
        args={"max_turns": 2},
        seed_status="truncated",
    )


SCENARIOS: dict[str, Builder] = {
    "multi_turn_until_max_turns": _multi_turn_until_max_turns,
    "env_done_on_turn_two": _env_done_on_turn_two,
    "length_finish": _length_finish,
    "length_finish_on_turn_two": _length_finish_on_turn_two,
    "stop_string_with_masked_eos": _stop_string_with_masked_eos,
    "stop_string_without_budget_for_eos": _stop_string_without_budget_for_eos,
    "stop_string_eos_disabled": _stop_string_eos_disabled,
    "observation_not_fitting": _observation_not_fitting,
    "observation_fitting_minus_one": _observation_fitting_minus_one,
    "zero_budget": _zero_budget,
    "unlimited_budget": _unlimited_budget,
    "context_limit": _context_limit,
    "context_limit_below_prompt": _context_limit_below_prompt,
    "server_abort_on_turn_two": _server_abort_on_turn_two,
    "eos_terminated_turns": _eos_terminated_turns,
    "stop_token_ids": _stop_token_ids,
    "observations_as_text_parts": _observations_as_text_parts,
    "consistent_hash_given_session": _consistent_hash_given_session,
    "consistent_hash_new_session": _consistent_hash_new_session,
    "tools_and_template_kwargs": _tools_and_template_kwargs,
    "sampling_mask_and_weight_version": _sampling_mask_and_weight_version,
    "sampling_mask_with_stop_eos": _sampling_mask_with_stop_eos,
    "routing_replay": _routing_replay,
    "prompt_as_message_list": _prompt_as_message_list,
    "string_prompt_with_image_tag": _string_prompt_with_image_tag,
    "env_done_on_turn_one": _env_done_on_turn_one,
    "server_abort_on_turn_one": _server_abort_on_turn_one,
    "cancelled_finish_reason": _cancelled_finish_reason,
    "finish_reason_as_dict": _finish_reason_as_dict,
    "empty_stop_turn": _empty_stop_turn,
    "prefilled_prompt_tokens": _prefilled_prompt_tokens,
    "routed_experts_without_replay": _routed_experts_without_replay,
    "prefix_cache_usage": _prefix_cache_usage,
    "transient_503_on_render": _transient_503_on_render,
    "transient_503_on_generate": _transient_503_on_generate,
    "dropped_connection_on_generate": _dropped_connection_on_generate,
    "stop_string_inside_last_token": _stop_string_inside_last_token,
    "stop_as_plain_string": _stop_as_plain_string,
}


# ------------------------------------------------------------------------------------------- error scenarios


def _logprob_count_mismatch(tok: Any) -> Case:
    one_entry = {"content": [{"token_id": 9707, "logprob": -0.1, "rank": 1, "top_logprobs": []}]}
    return Case(turns=[ScriptedTurn(text="Let me think.", choice_extra={"logprobs": one_entry})])


def _unsupported_finish_reason(tok: Any) -> Case:
    return Case(turns=[ScriptedTurn(text="Let me think.", choice_extra={"finish_reason": "error"})])


def _non_int_token_ids(tok: Any) -> Case:
    entries = [{"token_id": 9707, "logprob": -0.1}, {"token_id": 11, "logprob": -0.2}]
    extra = {"token_ids": [9707, 11.0], "logprobs": {"content": entries}}
    return Case(turns=[ScriptedTurn(text="Hello,", choice_extra=extra)])


def _more_tokens_than_requested(tok: Any) -> Case:
    count = 10
    raw = {
        "request_id": "generate-tokens-raw",
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "finish_reason": "length",
                "token_ids": [9707] * count,
                "logprobs": {"content": [{"token_id": 9707, "logprob": -0.1}] * count},
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": count, "total_tokens": count + 1},
    }
    return Case(turns=[ScriptedTurn(raw=raw)], sampling={**SAMPLING, "max_new_tokens": 3})


def _image_observation(tok: Any) -> Case:
    message = {"role": "user", "content": [{"type": "image", "image": "https://example.invalid/figure.png"}]}
    return Case(turns=[ScriptedTurn(text="Let me think.")], env={"steps": [[message, False]]})


def _non_text_non_list_observation(tok: Any) -> Case:
    return Case(turns=[ScriptedTurn(text="Let me think.")], env={"steps": [[{"role": "user", "content": 42}, False]]})


def _env_module_without_build_env(tok: Any) -> Case:
    return Case(args={"rollout_interaction_env_path": str(NO_BUILD_ENV_FILE)})


def _pre_existing_response(tok: Any) -> Case:
    return Case(sample={"response": "an earlier answer"})


def _pre_existing_loss_mask(tok: Any) -> Case:
    return Case(sample={"loss_mask": [1]})


def _not_pending(tok: Any) -> Case:
    return Case(sample={"status": "completed"})


def _max_turns_zero(tok: Any) -> Case:
    return Case(args={"max_turns": 0})


def _partial_rollout(tok: Any) -> Case:
    return Case(args={"partial_rollout": True})


def _image_prompt_without_render_features(tok: Any) -> Case:
    image = Image.new("RGB", (4, 4), color=(200, 10, 10))
    return Case(
        turns=[ScriptedTurn(text="The area is 12.")],
        args={"max_turns": 1},
        sample={"prompt": "<image>Find the area.", "multimodal_inputs": {"images": [image]}},
    )


def _prefilled_tokens_mismatch(tok: Any) -> Case:
    return Case(sample={"tokens": [1, 2, 3]})


def _negative_max_new_tokens(tok: Any) -> Case:
    # Intended difference: the library validates budgets before any request; the seed renders first.
    return Case(sampling={**SAMPLING, "max_new_tokens": -1}, compare_paths=False)


def _negative_context_limit(tok: Any) -> Case:
    # Intended difference: the library validates budgets before any request; the seed renders first.
    return Case(args={"rollout_max_context_len": -1}, compare_paths=False)


def _missing_sampling_key(tok: Any) -> Case:
    return Case(sampling={"max_new_tokens": 64, "temperature": 1.0})


def _replay_without_routed_experts(tok: Any) -> Case:
    return Case(
        turns=[ScriptedTurn(text="42.")],
        args={"use_rollout_routing_replay": True, "num_layers": 2, "moe_router_topk": 2},
    )


def _replay_with_wrong_routed_experts_size(tok: Any) -> Case:
    return Case(
        turns=[routed_turn(tok, "42.", 3, 2, 2, salt=0)],
        args={"use_rollout_routing_replay": True, "num_layers": 2, "moe_router_topk": 2},
    )


def _replay_with_stop_eos(tok: Any) -> Case:
    text = "<answer>42</answer>"
    rows = prompt_length(tok) + len(ids_of(tok, text)) - 1
    return Case(
        turns=[routed_turn(tok, text, rows, 2, 2, salt=0)],
        sampling=dict(STOP_SAMPLING),
        args={"use_rollout_routing_replay": True, "num_layers": 2, "moe_router_topk": 2},
        # Intended difference: the library refuses this configuration before any request.
        compare_paths=False,
    )


def _malformed_json_generate(tok: Any) -> Case:
    return Case(faults=[(GENERATE_PATH, {"malformed_json": True})])


def _sampling_mask_length_mismatch(tok: Any) -> Case:
    ids = ids_of(tok, "Let me think.")
    return Case(turns=[ScriptedTurn(token_ids=ids, choice_extra={"sampling_mask": [[ids[0]]]})])


ERROR_SCENARIOS: dict[str, tuple[Builder, type[Exception]]] = {
    "logprob_count_mismatch": (_logprob_count_mismatch, ValueError),
    "unsupported_finish_reason": (_unsupported_finish_reason, ValueError),
    "non_int_token_ids": (_non_int_token_ids, TypeError),
    "more_tokens_than_requested": (_more_tokens_than_requested, ValueError),
    "image_observation": (_image_observation, ValueError),
    "non_text_non_list_observation": (_non_text_non_list_observation, TypeError),
    "env_module_without_build_env": (_env_module_without_build_env, ValueError),
    "pre_existing_response": (_pre_existing_response, ValueError),
    "pre_existing_loss_mask": (_pre_existing_loss_mask, ValueError),
    "not_pending": (_not_pending, ValueError),
    "max_turns_zero": (_max_turns_zero, ValueError),
    "image_prompt_without_render_features": (_image_prompt_without_render_features, RuntimeError),
    "prefilled_tokens_mismatch": (_prefilled_tokens_mismatch, ValueError),
    "negative_max_new_tokens": (_negative_max_new_tokens, ValueError),
    "negative_context_limit": (_negative_context_limit, ValueError),
    "missing_sampling_key": (_missing_sampling_key, KeyError),
    "replay_without_routed_experts": (_replay_without_routed_experts, RuntimeError),
    "replay_with_wrong_routed_experts_size": (_replay_with_wrong_routed_experts_size, ValueError),
    "replay_with_stop_eos": (_replay_with_stop_eos, RuntimeError),
    "malformed_json_generate": (_malformed_json_generate, ValueError),
    "sampling_mask_length_mismatch": (_sampling_mask_length_mismatch, ValueError),
}

# fsm_rollout.Sample and the stand-in's (vime's) Sample: the library must handle both.
SAMPLE_KINDS = ("vime_sample", "fsm_rollout_sample")


# ------------------------------------------------------------------------------------------- running one side


def make_args(server: FakeVLLMServer, case: Case) -> SimpleNamespace:
    values: dict[str, Any] = {
        "partial_rollout": False,
        "max_turns": 3,
        "rollout_interaction_env_path": ENV_MODULE,
        "vllm_router_ip": "127.0.0.1",
        "vllm_router_port": urlsplit(server.url).port,
        "hf_checkpoint": MODEL,
        "rollout_max_context_len": None,
        "router_policy": None,
        "apply_chat_template_kwargs": None,
        "append_eos_token_after_stop_str_in_multi_turn": True,
    }
    values.update(copy.deepcopy(dict(case.args)))
    return SimpleNamespace(**values)


def make_sample(sample_class: type, case: Case) -> Any:
    values: dict[str, Any] = {"prompt": PROMPT, "index": 0}
    # Images are not deep-copied (PIL images are), everything else is: each run gets its own containers.
    values.update({k: v if k == "multimodal_inputs" else copy.deepcopy(v) for k, v in case.sample.items()})
    metadata = dict(values.pop("metadata", {}) or {})
    metadata["scripted_env"] = copy.deepcopy(dict(case.env))
    values["metadata"] = metadata
    if "status" in values:
        values["status"] = sample_class.Status(values["status"])
    return sample_class(**values)


@dataclass
class Run:
    """What one side left behind."""

    sample: Any
    requests: list[Any]
    env: scripted_envs.ScriptedEnv | None
    error: BaseException | None = None
    caller_metadata_changed: bool = False


async def run_side(
    generate: Callable[..., Any],
    sample: Any,
    server: FakeVLLMServer,
    case: Case,
    *,
    expect_error: bool | None = False,
) -> Run:
    """Run one side; ``expect_error`` True: it must raise, False: it must not, None: either."""
    server.script(copy.deepcopy(case.turns), session=case.session)
    for path, fault in case.faults:
        server.fail_next(path, **fault)
    first_request = len(server.requests)
    first_env = len(scripted_envs.BUILT)
    caller_metadata, caller_metadata_before = sample.metadata, copy.deepcopy(sample.metadata)
    error: BaseException | None = None
    try:
        returned = await generate(make_args(server, case), sample, dict(case.sampling))
    except Exception as raised:
        if expect_error is False:
            raise
        error = raised
    else:
        assert returned is sample, "generate must return the sample it was given"
        assert expect_error is not True, "expected the rollout to raise"
    built = scripted_envs.BUILT[first_env:]
    assert len(built) <= 1
    return Run(
        sample,
        list(server.requests[first_request:]),
        built[0] if built else None,
        error,
        caller_metadata_changed=caller_metadata != caller_metadata_before,
    )


def assert_seed_consumed_its_script(run: Run, case: Case) -> None:
    """The seed must use up exactly its copy of the script (and faults), so the library starts from fresh queues."""
    generates = sum(request.path == GENERATE_PATH for request in run.requests)
    faults = sum(fault.get("times", 1) for path, fault in case.faults if path == GENERATE_PATH)
    assert generates == len(case.turns) + faults, (
        f"scenario scripts {len(case.turns)} turns and {faults} generate faults, "
        f"but the seed sent {generates} generate requests"
    )


# ------------------------------------------------------------------------------------------- comparison


def _ints(values: Any) -> list[int] | None:
    if values is None:
        return None
    if hasattr(values, "tolist"):
        values = values.tolist()
    return [int(value) for value in values]


def _floats(values: Any) -> list[float] | None:
    if values is None:
        return None
    if hasattr(values, "tolist"):
        values = values.tolist()
    return [float(value) for value in values]


def outcome(sample: Any) -> dict[str, Any]:
    experts = sample.rollout_routed_experts
    return {
        "tokens": _ints(sample.tokens),
        "loss_mask": _ints(sample.loss_mask),
        "rollout_log_probs": _floats(sample.rollout_log_probs),
        "response_length": sample.response_length,
        "response": sample.response,
        "status": sample.status.value,
        "multiturn_truncation": (sample.metadata or {}).get("multiturn_truncation"),
        "metadata": {k: v for k, v in (sample.metadata or {}).items() if k not in LIBRARY_ONLY_METADATA_KEYS},
        "weight_versions": list(sample.weight_versions),
        "top_p_token_ids": _ints(sample.rollout_top_p_token_ids),
        "top_p_token_offsets": _ints(sample.rollout_top_p_token_offsets),
        "routed_experts": None if experts is None else (np.asarray(experts).shape, np.asarray(experts).tolist()),
        "prefix_cache": (sample.prefix_cache_info.cached_tokens, sample.prefix_cache_info.total_prompt_tokens),
        "multimodal_train_inputs": sample.multimodal_train_inputs,
    }


def comparable_body(path: str, body: Any) -> Any:
    """A request body as compared: generate bodies lose the keys only the library sends (``request_id``)."""
    if path != GENERATE_PATH or not isinstance(body, dict):
        return body
    return {key: value for key, value in body.items() if key not in LIBRARY_ONLY_GENERATE_KEYS}


def request_summary(run: Run) -> list[tuple[str, Any, Any]]:
    """(path, token_ids, sampling_params) per request: what both sides must send alike."""
    summary: list[tuple[str, Any, Any]] = []
    for request in run.requests:
        body = comparable_body(request.path, request.body)
        if request.path == GENERATE_PATH and isinstance(body, dict):
            summary.append((request.path, body.get("token_ids"), body.get("sampling_params")))
        else:
            summary.append((request.path, None, None))
    return summary


def full_bodies(run: Run) -> list[tuple[str, Any]]:
    """Every request body in full (generate bodies as in :func:`comparable_body`)."""
    return [(request.path, comparable_body(request.path, request.body)) for request in run.requests]


def assert_null_max_tokens_is_sent(seed_run: Run, library_run: Run) -> None:
    """Where the seed sends ``"max_tokens": null`` the library sends it too (an omitted key meant 16 on old vLLM)."""
    seed_generates = [r.body for r in seed_run.requests if r.path == GENERATE_PATH]
    library_generates = [r.body for r in library_run.requests if r.path == GENERATE_PATH]
    for seed_body, library_body in zip(seed_generates, library_generates, strict=True):
        if seed_body["sampling_params"].get("max_tokens", 0) is None:
            assert "max_tokens" in library_body["sampling_params"]
            assert library_body["sampling_params"]["max_tokens"] is None


def session_headers(run: Run) -> list[str | None]:
    return [{k.lower(): v for k, v in request.headers.items()}.get(SESSION_HEADER) for request in run.requests]


def env_record(env: scripted_envs.ScriptedEnv | None) -> tuple[list[str], list[str]] | None:
    return None if env is None else (list(env.calls), list(env.texts))


def sample_class_for(kind: str, seed: ModuleType) -> type:
    return seed.Sample if kind == "vime_sample" else fsm_rollout.Sample


# ------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("kind", SAMPLE_KINDS)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
async def test_library_matches_seed(
    scenario: str, kind: str, seed: ModuleType, library: Any, fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    case = SCENARIOS[scenario](tokenizer)

    seed_run = await run_side(seed.generate, make_sample(seed.Sample, case), fake_vllm, case)
    assert_seed_consumed_its_script(seed_run, case)
    if case.seed_status is not None:
        assert seed_run.sample.status.value == case.seed_status, "scenario does not reach the status it claims"
    if case.seed_reason is not None:
        assert seed_run.sample.metadata["multiturn_truncation"]["reason"] == case.seed_reason

    library_sample = make_sample(sample_class_for(kind, seed), case)
    library_run = await run_side(library.generate, library_sample, fake_vllm, case)
    assert_same_run(seed_run, library_run, case, kind=kind, seed=seed)


def assert_same_run(seed_run: Run, library_run: Run, case: Case, *, kind: str, seed: ModuleType) -> None:
    """Everything compared after both sides completed (see the module docstring)."""
    if kind == "vime_sample":
        assert isinstance(library_run.sample.status, seed.Sample.Status), "status must stay the caller's enum"
    assert outcome(library_run.sample) == outcome(seed_run.sample)
    assert request_summary(library_run) == request_summary(seed_run)
    assert full_bodies(library_run) == full_bodies(seed_run)
    assert_null_max_tokens_is_sent(seed_run, library_run)
    assert library_run.caller_metadata_changed == seed_run.caller_metadata_changed
    assert env_record(library_run.env) == env_record(seed_run.env)

    seed_headers, library_headers = session_headers(seed_run), session_headers(library_run)
    if case.args.get("router_policy") == "consistent_hash":
        assert seed_headers == [seed_run.sample.session_id] * len(seed_run.requests)
        assert library_headers == [library_run.sample.session_id] * len(library_run.requests)
        if case.sample.get("session_id") is not None:
            assert library_run.sample.session_id == seed_run.sample.session_id
        else:
            assert library_run.sample.session_id and library_run.sample.session_id != seed_run.sample.session_id
    else:
        assert library_headers == seed_headers == [None] * len(seed_run.requests)
        assert library_run.sample.session_id == seed_run.sample.session_id


@pytest.mark.parametrize("kind", SAMPLE_KINDS)
async def test_partial_rollout_the_seed_refuses_runs_as_usual(
    kind: str, seed: ModuleType, library: Any, fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    case = _partial_rollout(tokenizer)
    seed_run = await run_side(seed.generate, make_sample(seed.Sample, case), fake_vllm, case, expect_error=True)
    assert type(seed_run.error) is ValueError
    case = Case(args={"partial_rollout": True, "max_turns": 1}, turns=[ScriptedTurn(text="The answer is 42.")])
    plain = Case(args={"max_turns": 1}, turns=case.turns)
    expected = await run_side(library.generate, make_sample(sample_class_for(kind, seed), plain), fake_vllm, plain)
    today = await run_side(library.generate, make_sample(sample_class_for(kind, seed), case), fake_vllm, case)
    assert today.error is None
    assert today.sample.tokens == expected.sample.tokens
    assert today.sample.loss_mask == expected.sample.loss_mask
    assert today.sample.status.value == expected.sample.status.value


@pytest.mark.parametrize("kind", SAMPLE_KINDS)
@pytest.mark.parametrize("scenario", list(ERROR_SCENARIOS))
async def test_library_raises_like_seed(
    scenario: str, kind: str, seed: ModuleType, library: Any, fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    builder, builtin = ERROR_SCENARIOS[scenario]
    case = builder(tokenizer)

    seed_run = await run_side(seed.generate, make_sample(seed.Sample, case), fake_vllm, case, expect_error=True)
    assert type(seed_run.error) is builtin, f"the seed raised {seed_run.error!r}, expected a plain {builtin.__name__}"
    assert_seed_consumed_its_script(seed_run, case)

    library_sample = make_sample(sample_class_for(kind, seed), case)
    library_run = await run_side(library.generate, library_sample, fake_vllm, case, expect_error=True)
    # Only the builtin class must agree; the messages may differ.
    assert isinstance(library_run.error, builtin), f"library raised {library_run.error!r}, seed {seed_run.error!r}"
    if case.compare_paths:
        assert [r.path for r in library_run.requests] == [r.path for r in seed_run.requests]
