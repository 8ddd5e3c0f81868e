"""Fork and per_turn rollouts on real thinking chat templates (Qwen3; Qwen3.6 with and without
``preserve_thinking``) over the real Qwen3.6 vocabulary, against the fake vLLM server, which renders with the
tokenizer it serves. The scripted turns reason in ``<think>…</think>`` and every observation is a user message,
so a template that drops the thinking of turns before the last user message rewrites the history at each one.

Each sequence's prompt is compared with an independent render of the conversation so far (the same tokenizer's
``apply_chat_template`` with the same switches), and with what the engine was asked to continue.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest

from fsm_rollout import Rollout, RolloutConfig, Sample, Status, training_sequences
from fsm_rollout.engine.client import VLLMClient
from fsm_rollout.testing.chat_templates import chat_template
from fsm_rollout.testing.envs import ScriptedEnvFactory
from fsm_rollout.testing.fake_vllm import GENERATE_PATH, RENDER_PATH, FakeVLLMServer, ScriptedTurn
from fsm_rollout.testing.qwen3_6_tokenizer import load_qwen3_6_tokenizer
from fsm_rollout.tokens.parity import template_token_ids
from fsm_rollout.trace import capture_transitions

pytestmark = pytest.mark.own_process  # its real-vocabulary tokenizers are a lasting step up in the suite's process

MODEL = "fake-model"
EOS = "<|im_end|>"
PROMPT = "What is 6 * 7?"
OBSERVATIONS = ["Are you sure?", "Check it once more.", "Explain briefly."]
REASONING = ["Six sevens are 42.", "6 * 7 = 42, again.", "Seven sixes: 42.", "Still the same."]
ANSWERS = ["It is 42.", "Yes, 42.", "42 it is.", "Done: 42."]


@functools.cache
def real_tokenizer(template: str) -> Any:
    """The real Qwen3.6 vocabulary (``<think>``, ``</think>``, ``<|im_end|>`` are single special tokens) wearing
    a shipped template. Qwen3's own vocabulary has the same thinking tokens, so its template is served on it too."""
    tokenizer = load_qwen3_6_tokenizer()
    tokenizer.chat_template = chat_template(template)
    return tokenizer


# name -> (template, apply_chat_template_kwargs, whether the generation prompt opens '<think>\n' itself)
CASES: dict[str, tuple[str, Mapping[str, Any], bool]] = {
    "qwen3": ("qwen3", {}, False),
    "qwen3_6": ("qwen3_6", {}, True),
    "qwen3_6_preserve_thinking": ("qwen3_6", {"preserve_thinking": True}, True),
}
FORKS_PER_USER_OBSERVATION = {"qwen3": 1, "qwen3_6": 1, "qwen3_6_preserve_thinking": 0}


def reasoning_turns(case: str, count: int) -> list[str]:
    """What a thinking model generates: after the generation prompt's open ``<think>\\n`` (Qwen3.6) its reasoning,
    else the whole block (Qwen3), then the answer and EOS."""
    _, _, opens_think = CASES[case]
    opening = "" if opens_think else "<think>\n"
    return [f"{opening}{REASONING[n]}\n</think>\n\n{ANSWERS[n]}{EOS}" for n in range(count)]


@pytest.fixture(params=sorted(CASES))
def case(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def server(case: str) -> AsyncIterator[FakeVLLMServer]:
    async with FakeVLLMServer(real_tokenizer(CASES[case][0]), model=MODEL) as fake:
        yield fake


@pytest.fixture
async def engine(server: FakeVLLMServer) -> AsyncIterator[VLLMClient]:
    async with VLLMClient(server.url) as client:
        yield client


async def run(
    case: str, server: FakeVLLMServer, engine: VLLMClient, policy: str, turns: list[str]
) -> tuple[Rollout, list[dict[str, Any]]]:
    template, switches, _ = CASES[case]
    server.script([ScriptedTurn(text=text) for text in turns])
    config = RolloutConfig(
        engine_url=server.url,
        model=MODEL,
        max_turns=len(turns),
        check_invariants=True,
        history_policy=policy,
        apply_chat_template_kwargs=dict(switches),
    )
    rollout = Rollout(
        # the prompt as a message with string content: a string prompt is sent as text parts, which vLLM joins
        # for a template that reads content as a string (Qwen3's) but the fake server hands to the template as is
        Sample(prompt=[{"role": "user", "content": PROMPT}], index=5, group_index=2),
        config=config,
        sampling_params={"max_new_tokens": 512, "temperature": 1.0, "top_p": 1.0},
        client=engine,
        tokenizer=real_tokenizer(template),
        env_factory=ScriptedEnvFactory(steps=[(text, False) for text in OBSERVATIONS]),
    )
    with capture_transitions() as events:
        await rollout.run()
    return rollout, events


def render(case: str, messages: list[dict[str, Any]], **options: Any) -> list[int]:
    """The template's tokens for ``messages``, with the case's switches, rendered here (not by the server)."""
    template, switches, _ = CASES[case]
    rendered = real_tokenizer(template).apply_chat_template(
        messages, tokenize=True, **{"add_generation_prompt": True, **switches, **options}
    )
    return template_token_ids(rendered, what="test render")


def prompt_of(sequence: Sample) -> list[int]:
    return sequence.tokens[: len(sequence.tokens) - sequence.response_length]


def response_of(sequence: Sample) -> list[int]:
    return sequence.tokens[len(sequence.tokens) - sequence.response_length :]


def conversations(turns: list[str]) -> list[list[dict[str, Any]]]:
    """The conversation before each model call: the prompt, then each turn (its text without EOS, as a deployment
    hands it back) and the user observation that answered it."""
    conversation: list[dict[str, Any]] = [{"role": "user", "content": PROMPT}]
    before = [list(conversation)]
    for text, observation in zip(turns[:-1], OBSERVATIONS, strict=False):
        conversation += [
            {"role": "assistant", "content": text.removesuffix(EOS)},
            {"role": "user", "content": observation},
        ]
        before.append(list(conversation))
    return before


def check_each_generated_token_trained_once(case: str, sequences: list[Sample], turns: list[str]) -> None:
    tokenizer = real_tokenizer(CASES[case][0])
    generated = [token for text in turns for token in tokenizer.encode(text, add_special_tokens=False)]
    trained: list[int] = []
    for sequence in sequences:
        mask = sequence.loss_mask or []
        assert len(mask) == sequence.response_length
        trained.extend(token for token, bit in zip(response_of(sequence), mask, strict=True) if bit == 1)
    assert trained == generated  # every generated token, in order, each in exactly one sequence


async def test_fork_gives_one_sequence_per_rewritten_history_each_prompted_with_the_engines_render(
    case: str, server: FakeVLLMServer, engine: VLLMClient
) -> None:
    turns = reasoning_turns(case, 4)
    rollout, events = await run(case, server, engine, "fork", turns)
    sample = rollout.sample
    user_observations = sum(1 for event in events if event["src"] == "observing")
    assert user_observations == len(turns) - 1
    forks = [event for event in events if event["trigger"] == "fork"]
    assert len(forks) == len(sample.branches) == FORKS_PER_USER_OBSERVATION[case] * user_observations
    assert all(event["reason"] == "history_rewritten" for event in forks)
    # one render at the start and one per observation, whatever they decide
    assert len(server.requests_to(RENDER_PATH)) == 1 + user_observations
    for request in server.requests_to(RENDER_PATH):
        assert request.body.get("chat_template_kwargs", {}) == dict(CASES[case][1])

    sequences = training_sequences([sample])
    assert sequences == [*sample.branches, sample]
    asked = [request.body["token_ids"] for request in server.requests_to(GENERATE_PATH)]
    before = conversations(turns)
    if forks:  # every turn opened a sequence: its prompt is the render of the conversation before it
        assert len(sequences) == len(turns)
        for sequence, conversation, text in zip(sequences, before, turns, strict=True):
            assert prompt_of(sequence) == render(case, conversation)
            assert sequence.response == text
            assert sequence.loss_mask == [1] * sequence.response_length
        assert asked == [prompt_of(sequence) for sequence in sequences]
    else:  # one sequence; before each call it is exactly the render of the conversation so far
        assert len(sequences) == 1
        for tokens, conversation in zip(asked, before, strict=True):
            assert tokens == render(case, conversation)
        final = [*before[-1], {"role": "assistant", "content": turns[-1].removesuffix(EOS)}]
        # and at the end the whole conversation as the template writes it (bar the newline after the last EOS)
        assert sample.tokens == render(case, final, add_generation_prompt=False)[:-1]
    check_each_generated_token_trained_once(case, sequences, turns)
    for position, sequence in enumerate(sequences):
        assert sequence.metadata.get("branch", 0) == position
        assert (sequence.index, sequence.group_index, sequence.status) == (5, 2, Status.TRUNCATED)
        sequence.check_invariants(len(prompt_of(sequence)))


async def test_per_turn_prompts_every_model_call_with_the_engines_render_of_its_history(
    case: str, server: FakeVLLMServer, engine: VLLMClient
) -> None:
    turns = reasoning_turns(case, 3)
    rollout, events = await run(case, server, engine, "per_turn", turns)
    sequences = training_sequences([rollout.sample])
    assert len(sequences) == len(turns)
    assert sum(1 for event in events if event["trigger"] == "fork") == len(turns) - 1
    asked = [request.body["token_ids"] for request in server.requests_to(GENERATE_PATH)]
    for sequence, conversation, text, tokens in zip(sequences, conversations(turns), turns, asked, strict=True):
        assert prompt_of(sequence) == render(case, conversation) == tokens
        assert sequence.response == text
    check_each_generated_token_trained_once(case, sequences, turns)


# ------------------------------------------------------- preserve_thinking: what still rewrites the history

# Turns in the form a thinking model writes (``reasoning\n</think>\n\nanswer``) never fork under preserve_thinking
# (above). Qwen3.6 writes every kept turn as '<think>\n' + reasoning|trim + '\n</think>\n\n' + answer, so:
PRESERVED_TURNS: dict[str, tuple[list[str], int]] = {
    # a turn that did not reason comes back as a closed empty block whose '\n\n' is one token where the rollout
    # holds two: the same text, so by meaning no break (the model keeps its own tokens)
    "empty_think": (
        [f"\n</think>\n\nIt is 42.{EOS}", f"Check.\n</think>\n\nYes.{EOS}", f"\n</think>\n\nDone.{EOS}"],
        0,
    ),
    # a turn that never closed its think block comes back as the answer after an empty block: what the model
    # wrote as thinking is now its answer, a real rewrite
    "unclosed_think": ([f"It is 42.{EOS}", f"Check.\n</think>\n\nYes.{EOS}", f"Done.\n</think>\n\nOk.{EOS}"], 1),
    # reasoning and answer are trimmed: a non-empty block written with other whitespace is a rewrite too
    "untrimmed_reasoning": (
        [f"  Six.  \n</think>\n\nIt is 42.{EOS}", f"Check.\n\n</think>\n\n\nYes.{EOS}", f"Done.\n</think>\n\nOk.{EOS}"],
        2,
    ),
}


@pytest.mark.parametrize("case", ["qwen3_6_preserve_thinking"])
@pytest.mark.parametrize("variant", sorted(PRESERVED_TURNS))
async def test_under_preserve_thinking_only_a_turn_the_template_writes_otherwise_forks(
    case: str, variant: str, server: FakeVLLMServer, engine: VLLMClient
) -> None:
    turns, expected_forks = PRESERVED_TURNS[variant]
    rollout, events = await run(case, server, engine, "fork", turns)
    sequences = training_sequences([rollout.sample])
    assert sum(1 for event in events if event["trigger"] == "fork") == len(sequences) - 1 == expected_forks
    tokenizer = real_tokenizer(CASES[case][0])
    renders = [render(case, conversation) for conversation in conversations(turns)]
    asked = [request.body["token_ids"] for request in server.requests_to(GENERATE_PATH)]
    # every sequence opens with the engine's render of the conversation before its first turn
    starts = [renders.index(prompt_of(sequence)) for sequence in sequences]
    assert starts == sorted(starts) and starts[0] == 0
    for turn, (tokens, rendered) in enumerate(zip(asked, renders, strict=True)):
        if turn in starts:
            assert tokens == rendered
        else:  # the sequence went on: the model's own tokens, which say what the render says
            assert tokenizer.decode(tokens) == tokenizer.decode(rendered)
    if variant == "empty_think":
        assert asked[1] != renders[1]  # the tokens differ where the whitespace merged
    check_each_generated_token_trained_once(case, sequences, turns)
