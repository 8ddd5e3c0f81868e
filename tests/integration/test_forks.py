"""Trajectories that fork: the fork and per_turn history policies against the fake vLLM server, whose /render
applies the chat template of the tokenizer it serves (here one that strips the thinking of earlier turns)."""

from __future__ import annotations

import asyncio
import enum
import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import orjson
import pytest

from fsm_rollout import (
    RetryPolicy,
    Rollout,
    RolloutConfig,
    RolloutRunner,
    Sample,
    Status,
    compat,
    training_sequences,
)
from fsm_rollout.cli import main as cli_main
from fsm_rollout.engine.client import VLLMClient
from fsm_rollout.engine.local.tiny import tiny_model_dir
from fsm_rollout.machine import lifecycle
from fsm_rollout.machine.diagrams import build_overlay
from fsm_rollout.recording import TapeWriter, recorded_rollout, tape_path_for
from fsm_rollout.replay import replay
from fsm_rollout.testing.envs import ScriptedEnv, ScriptedEnvFactory
from fsm_rollout.testing.fake_vllm import GENERATE_PATH, RENDER_PATH, FakeVLLMServer, ScriptedTurn
from fsm_rollout.testing.templates import (
    GROUPED_TOOLS_CHAT_TEMPLATE,
    THINK_STRIPPING_CHAT_TEMPLATE,
    qwen_tokenizer_with_template,
)
from fsm_rollout.testing.tokenizer import qwen_tokenizer_dir
from fsm_rollout.tokens.parity import template_token_ids
from fsm_rollout.trace import Tracer, capture_transitions
from fsm_rollout.weights.suspension import HandBack, Suspender

pytestmark = pytest.mark.own_process  # its embedded engines and tokenizers are a lasting step up in the suite's process

MODEL = "fake-model"
EOS = "<|im_end|>"
PROMPT = "What is 6 * 7?"
OBSERVATION = "Continue the reasoning."


@pytest.fixture(scope="module")
def stripping_tokenizer() -> Any:
    return qwen_tokenizer_with_template(THINK_STRIPPING_CHAT_TEMPLATE)


@pytest.fixture
async def server(stripping_tokenizer: Any) -> AsyncIterator[FakeVLLMServer]:
    async with FakeVLLMServer(stripping_tokenizer, model=MODEL) as fake:
        yield fake


@pytest.fixture
async def engine(server: FakeVLLMServer) -> AsyncIterator[VLLMClient]:
    async with VLLMClient(server.url, retry=RetryPolicy(max_attempts=2, base_delay_s=0.01)) as client:
        yield client


def config_for(server: FakeVLLMServer, policy: str, **overrides: Any) -> RolloutConfig:
    values: dict[str, Any] = {
        "engine_url": server.url,
        "model": MODEL,
        "max_turns": 3,
        "check_invariants": True,
        "history_policy": policy,
    }
    values.update(overrides)
    return RolloutConfig(**values)


async def run(
    server: FakeVLLMServer,
    engine: VLLMClient,
    tokenizer: Any,
    policy: str,
    turns: list[str],
    *,
    max_new_tokens: int = 256,
    sample: Sample | None = None,
    envs: ScriptedEnvFactory | None = None,
    **overrides: Any,
) -> tuple[Rollout, list[dict[str, Any]]]:
    server.script([ScriptedTurn(text=text) for text in turns])
    rollout = Rollout(
        sample or Sample(prompt=PROMPT, index=3, group_index=1),
        config=config_for(server, policy, max_turns=len(turns), **overrides),
        sampling_params={"max_new_tokens": max_new_tokens, "temperature": 1.0, "top_p": 1.0},
        client=engine,
        tokenizer=tokenizer,
        env_factory=envs or ScriptedEnvFactory(),
    )
    with capture_transitions() as events:
        await rollout.run()
    return rollout, events


def prompt_of(sequence: Sample) -> list[int]:
    return sequence.tokens[: len(sequence.tokens) - sequence.response_length]


def trained_tokens(sequences: list[Sample]) -> list[int]:
    """The tokens with loss mask 1, sequence after sequence."""
    out: list[int] = []
    for sequence in sequences:
        response = sequence.tokens[len(sequence.tokens) - sequence.response_length :]
        out.extend(token for token, mask in zip(response, sequence.loss_mask or [], strict=True) if mask == 1)
    return out


def render(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    options = {"add_generation_prompt": True, **kwargs}
    return template_token_ids(tokenizer.apply_chat_template(messages, tokenize=True, **options), what="test render")


THINKING = [
    f"<think>\nSix sevens.\n</think>\n\nIt is 42.{EOS}",
    f"<think>\nCheck again.\n</think>\n\nStill 42.{EOS}",
    f"<think>\nOnce more.\n</think>\n\nYes, 42.{EOS}",
]


async def test_a_template_that_strips_thinking_forks_at_each_user_observation_and_prompts_are_the_engines_render(
    server: FakeVLLMServer, engine: VLLMClient, stripping_tokenizer: Any
) -> None:
    rollout, events = await run(server, engine, stripping_tokenizer, "fork", THINKING)
    sample = rollout.sample
    assert len(sample.branches) == 2
    forks = [event for event in events if event["trigger"] == "fork"]
    assert [(event["src"], event["dst"], event["reason"], event["branch"]) for event in forks] == [
        ("observing", "rendered", "history_rewritten", 1),
        ("observing", "rendered", "history_rewritten", 2),
    ]
    # one render at the start and exactly one per observation
    assert [request.path for request in server.requests] == [
        RENDER_PATH,
        GENERATE_PATH,
        RENDER_PATH,
        GENERATE_PATH,
        RENDER_PATH,
        GENERATE_PATH,
    ]
    sequences = training_sequences([sample])
    assert sequences == [*sample.branches, sample]
    # each sequence's prompt is what the template makes of the conversation so far (thinking of earlier turns gone)
    conversation: list[dict[str, Any]] = [{"role": "user", "content": PROMPT}]
    for number, sequence in enumerate(sequences):
        assert prompt_of(sequence) == render(stripping_tokenizer, conversation)
        assert sequence.loss_mask == [1] * sequence.response_length
        conversation += [
            {"role": "assistant", "content": THINKING[number].removesuffix(EOS)},
            {"role": "user", "content": OBSERVATION},
        ]
    # and that is what the engine was asked to continue
    generate = [request.body["token_ids"] for request in server.requests_to(GENERATE_PATH)]
    assert generate == [prompt_of(sequence) for sequence in sequences]
    assert [sequence.response for sequence in sequences] == THINKING
    generated = [token for text in THINKING for token in stripping_tokenizer.encode(text, add_special_tokens=False)]
    assert trained_tokens(sequences) == generated
    for position, sequence in enumerate(sequences):
        assert sequence.metadata["branch"] == position
        assert (sequence.index, sequence.group_index, sequence.status) == (3, 1, Status.TRUNCATED)
        sequence.check_invariants(len(prompt_of(sequence)))


async def test_turns_without_thinking_extend_the_sequence_so_nothing_forks(
    server: FakeVLLMServer, engine: VLLMClient, stripping_tokenizer: Any
) -> None:
    plain = [f"It is 42.{EOS}", f"Still 42.{EOS}", f"Yes.{EOS}"]
    rollout, events = await run(server, engine, stripping_tokenizer, "fork", plain)
    assert rollout.sample.branches == []
    assert not [event for event in events if event["trigger"] == "fork"]
    conversation: list[dict[str, Any]] = [{"role": "user", "content": PROMPT}]
    for text in plain:
        conversation += [{"role": "assistant", "content": text.removesuffix(EOS)}]
        conversation += [{"role": "user", "content": OBSERVATION}]
    full = render(stripping_tokenizer, conversation[:-1], add_generation_prompt=False)
    assert rollout.sample.tokens == full[: len(rollout.sample.tokens)]
    assert len(server.requests_to(RENDER_PATH)) == 3  # one per observation under fork


async def test_an_empty_think_block_the_template_drops_is_no_break(
    server: FakeVLLMServer, engine: VLLMClient, stripping_tokenizer: Any
) -> None:
    empty = [f"<think>\n\n</think>\n\nIt is 42.{EOS}", f"<think>\n\n</think>\n\nStill 42.{EOS}"]
    rollout, events = await run(server, engine, stripping_tokenizer, "fork", empty)
    # the template writes the history without the empty block: the tokens differ, the meaning does not
    history = render(
        stripping_tokenizer,
        [
            {"role": "user", "content": PROMPT},
            {"role": "assistant", "content": empty[0].removesuffix(EOS)},
            {"role": "user", "content": OBSERVATION},
        ],
    )
    first = server.requests_to(GENERATE_PATH)[1].body["token_ids"]
    assert first != history
    assert rollout.sample.branches == []
    assert not [event for event in events if event["trigger"] == "fork"]


async def test_per_turn_makes_every_model_call_its_own_row_prompted_with_the_render_of_its_history(
    server: FakeVLLMServer, engine: VLLMClient, stripping_tokenizer: Any
) -> None:
    plain = [f"It is 42.{EOS}", f"Still 42.{EOS}", f"Yes.{EOS}"]
    rollout, _ = await run(server, engine, stripping_tokenizer, "per_turn", plain)
    sequences = training_sequences([rollout.sample])
    assert len(sequences) == 3
    conversation: list[dict[str, Any]] = [{"role": "user", "content": PROMPT}]
    for text, sequence in zip(plain, sequences, strict=True):
        assert prompt_of(sequence) == render(stripping_tokenizer, conversation)
        assert sequence.tokens[len(prompt_of(sequence)) :] == stripping_tokenizer.encode(text, add_special_tokens=False)
        conversation += [{"role": "assistant", "content": text.removesuffix(EOS)}]
        conversation += [{"role": "user", "content": OBSERVATION}]


async def test_tool_calls_written_in_another_key_order_and_spacing_are_no_break() -> None:
    tokenizer = qwen_tokenizer_with_template(GROUPED_TOOLS_CHAT_TEMPLATE)
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    call = '<tool_call>\n{"arguments": {"exact": false, "expression": "6*7"},  "name": "calc"}\n</tool_call>'
    observation = {"role": "tool", "content": "42", "tool_call_id": "call_0", "name": "calc"}
    async with FakeVLLMServer(tokenizer, model=MODEL) as fake, VLLMClient(fake.url) as client:
        rollout, events = await run(
            fake,
            client,
            tokenizer,
            "fork",
            [f"{call}{EOS}", f"It is 42.{EOS}"],
            sample=Sample(prompt=PROMPT, metadata={"tools": tools}),
            envs=ScriptedEnvFactory(steps=[(observation, False)]),
        )
        # the engine re-serialised the call (its own key order and spacing), yet the sequence goes on; the call
        # went to the engine in OpenAI's wire form (arguments a JSON string), which the fake validates as vLLM does
        rerender = fake.requests_to(RENDER_PATH)[1].body["messages"][1]
        expected = {"name": "calc", "arguments": '{"exact": false, "expression": "6*7"}'}
        assert rerender["tool_calls"][0]["function"] == expected
    assert "rollout_error" not in rollout.sample.metadata  # both turns ran (max_turns ends it)
    assert rollout.sample.branches == []
    assert not [event for event in events if event["trigger"] == "fork"]


async def test_a_tool_call_turn_re_rendered_under_per_turn_reaches_the_engine_in_the_wire_form() -> None:
    tokenizer = qwen_tokenizer_with_template(GROUPED_TOOLS_CHAT_TEMPLATE)
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    call = '<tool_call>\n{"name": "calc", "arguments": {"expression": "6*7"}}\n</tool_call>'
    observation = {"role": "tool", "content": "42", "tool_call_id": "call_0", "name": "calc"}
    async with FakeVLLMServer(tokenizer, model=MODEL) as fake, VLLMClient(fake.url) as client:
        rollout, _ = await run(
            fake,
            client,
            tokenizer,
            "per_turn",
            [f"{call}{EOS}", f"It is 42.{EOS}"],
            sample=Sample(prompt=PROMPT, metadata={"tools": tools}),
            envs=ScriptedEnvFactory(steps=[(observation, False)]),
        )
        assert len(fake.requests_to(RENDER_PATH)) == 2
        sent = fake.requests_to(RENDER_PATH)[1].body["messages"][1]
    assert sent["tool_calls"][0]["function"]["arguments"] == '{"expression": "6*7"}'
    assert "rollout_error" not in rollout.sample.metadata
    sequences = training_sequences([rollout.sample])
    assert len(sequences) == 2
    # the second sequence's prompt is the template's render of the call with its arguments as an object
    conversation = [
        {"role": "user", "content": PROMPT},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_0", "type": "function", "function": {"name": "calc", "arguments": {"expression": "6*7"}}}
            ],
        },
        observation,
    ]
    expected = template_token_ids(
        tokenizer.apply_chat_template(conversation, tools=tools, tokenize=True, add_generation_prompt=True),
        what="expected",
    )
    assert prompt_of(sequences[1]) == expected


async def test_the_whole_rollout_shares_max_new_tokens_across_its_sequences(
    server: FakeVLLMServer, engine: VLLMClient, stripping_tokenizer: Any
) -> None:
    budget = 24
    rollout, _ = await run(server, engine, stripping_tokenizer, "fork", THINKING, max_new_tokens=budget)
    sequences = training_sequences([rollout.sample])
    assert len(trained_tokens(sequences)) <= budget
    asked = [request.body["sampling_params"]["max_tokens"] for request in server.requests_to(GENERATE_PATH)]
    first = len(stripping_tokenizer.encode(THINKING[0], add_special_tokens=False))
    assert asked[0] == budget
    assert asked[1] == budget - first  # the second sequence may only generate what the first left


async def test_a_re_render_longer_than_the_context_ends_the_rollout_before_forking(
    server: FakeVLLMServer, engine: VLLMClient, stripping_tokenizer: Any
) -> None:
    first_prompt = len(render(stripping_tokenizer, [{"role": "user", "content": PROMPT}]))
    first_turn = len(stripping_tokenizer.encode(THINKING[0], add_special_tokens=False))
    # room for the first sequence, none for the re-render with the observation
    rollout, events = await run(
        server, engine, stripping_tokenizer, "fork", THINKING, rollout_max_context_len=first_prompt + first_turn + 2
    )
    assert rollout.sample.branches == []
    assert rollout.reason == "insufficient_budget_for_next_turn"
    assert events[-1]["trigger"] == "fork" and events[-1]["dst"] == "truncated"
    assert rollout.sample.metadata["multiturn_truncation"]["reason"] == "insufficient_budget_for_next_turn"


# ------------------------------------------------------------------------------- every token trained exactly once


def random_turn(rng: random.Random) -> str:
    words = " ".join(rng.choice(["six", "seven", "is", "42", "so", "then"]) for _ in range(rng.randint(1, 6)))
    kind = rng.choice(["think", "empty", "plain", "unclosed"])
    if kind == "think":
        return f"<think>\n{words}\n</think>\n\n{words}.{EOS}"
    if kind == "empty":
        return f"<think>\n\n</think>\n\n{words}.{EOS}"
    if kind == "unclosed":  # no EOS: the turn ends by length or runs into the next budget
        return f"{words} {words} {words}"
    return f"{words}.{EOS}"


async def test_every_generated_token_is_trainable_in_exactly_one_sequence(stripping_tokenizer: Any) -> None:
    """Seeded random scripted runs (turns with and without thinking, empty think blocks, turns cut by the budget,
    random done flags) under fork and per_turn: the tokens with loss mask 1, sequence after sequence, are the
    generated tokens in order, each once."""
    seen = {"forked_twice": 0, "no_fork": 0, "cut_by_budget": 0}
    for seed in range(16):
        rng = random.Random(seed)
        policy = rng.choice(["fork", "per_turn"])
        turns = [random_turn(rng) for _ in range(rng.randint(1, 5))]
        observations = [(rng.choice(["Again.", OBSERVATION]), rng.random() < 0.15) for _ in turns]
        budget = rng.choice([8, 20, 40, 400])
        async with FakeVLLMServer(stripping_tokenizer, model=MODEL) as server, VLLMClient(server.url) as engine:
            rollout, events = await run(
                server,
                engine,
                stripping_tokenizer,
                policy,
                turns,
                max_new_tokens=budget,
                envs=ScriptedEnvFactory(steps=observations),
            )
            asked = server.requests_to(RENDER_PATH)
            renders = [render(stripping_tokenizer, request.body["messages"]) for request in asked]
        sequences = training_sequences([rollout.sample])
        script = [token for text in turns for token in stripping_tokenizer.encode(text, add_special_tokens=False)]
        trained = trained_tokens(sequences)
        assert trained == rollout.ctx.response_token_ids, seed
        assert trained == script[: len(trained)], seed
        assert len(trained) <= budget, seed
        observed = sum(1 for event in events if event["src"] == "observing")
        assert len(renders) == 1 + observed, seed  # one render per observation
        forks = sum(1 for event in events if event["trigger"] == "fork" and event["dst"] == "rendered")
        assert len(sequences) == 1 + forks, seed
        for position, sequence in enumerate(sequences):
            sequence.check_invariants(len(prompt_of(sequence)))
            assert sequence.metadata.get("branch", 0) == position, seed
            assert sequence.status == rollout.sample.status, seed
            assert prompt_of(sequence) in renders, seed  # every prompt is an engine's render
        seen["forked_twice"] += forks >= 2
        seen["no_fork"] += forks == 0
        seen["cut_by_budget"] += len(trained) < len(script)
    assert all(seen.values()), seen  # the seeds cover forking, not forking and running out of budget


# ------------------------------------------------------------------------------------------------ tape and replay


async def record_forked_runs(tmp_path: Path, server: FakeVLLMServer, engine: VLLMClient, tokenizer: Any) -> Path:
    trace = tmp_path / "run.jsonl"
    tracer = Tracer(trace.open("ab"), owns_stream=True)
    writer = TapeWriter(tape_path_for(trace))
    for index, policy in enumerate(["fork", "per_turn"]):
        server.script([ScriptedTurn(text=text) for text in THINKING], session=f"s{index}")
        rollout = recorded_rollout(
            Sample(prompt=PROMPT, index=index, session_id=f"s{index}"),
            config=config_for(server, policy, router_policy="consistent_hash"),
            sampling_params={"max_new_tokens": 256, "temperature": 1.0, "top_p": 1.0},
            client=engine,
            tokenizer=tokenizer,
            env_factory=ScriptedEnvFactory(),
            tracer=tracer,
            tape=writer,
        )
        sample = await rollout.run()
        assert len(sample.branches) == 2
    writer.close()
    tracer.close()
    return trace


async def test_a_forked_run_replays_identically_and_a_changed_branch_is_found(
    tmp_path: Path, server: FakeVLLMServer, engine: VLLMClient, stripping_tokenizer: Any
) -> None:
    trace = await record_forked_runs(tmp_path, server, engine, stripping_tokenizer)
    tape = tape_path_for(trace)
    records = [orjson.loads(line) for line in tape.read_bytes().splitlines()]
    samples = [record for record in records if record["kind"] == "sample"]
    # the tape holds every render answer (one per observation) and the earlier sequences
    assert [sum(entry["op"] == "render" for entry in record["io"]) for record in samples] == [3, 3]
    assert [len(record["result"]["branches"]) for record in samples] == [2, 2]
    report = await asyncio.to_thread(replay, trace, tokenizer=stripping_tokenizer)
    assert report.exit_code == 0, report.render(verbose=True)
    assert report.counts() == {"identical": 2}

    for record in samples:  # a branch the recording says ended otherwise
        record["result"]["branches"][1]["tokens"][-1] += 1
    tape.write_bytes(b"\n".join(orjson.dumps(record) for record in records) + b"\n")
    report = await asyncio.to_thread(replay, trace, tokenizer=stripping_tokenizer)
    assert report.exit_code == 1
    divergences = [sample.divergence for sample in report.samples]
    assert all(found is not None and found.message.startswith("branch 1 tokens[") for found in divergences)


# ------------------------------------------------------------------------------------------------ suspend and resume


class HandingBack(Suspender):
    """A gate that hands a suspended rollout back instead of letting it wait (``partial_rollout``)."""

    async def wait_resumed(self) -> None:
        if self.suspended:
            raise HandBack


@dataclass
class SnapshotEnv(ScriptedEnv):
    def snapshot(self) -> dict[str, Any]:
        return {"texts": list(self.texts)}

    def restore(self, state: Any) -> None:
        self.texts = list(state["texts"])


@dataclass
class SnapshotEnvFactory(ScriptedEnvFactory):
    def __call__(self, *, sample: Any, args: Any) -> ScriptedEnv:
        env = SnapshotEnv(steps=list(self.steps), default=self.default)
        self.built.append(env)
        return env


def sequences_of(sample: Sample) -> list[tuple[Any, ...]]:
    return [
        (sequence.tokens, sequence.loss_mask, sequence.rollout_log_probs, sequence.response, sequence.status)
        for sequence in training_sequences([sample])
    ]


@pytest.mark.parametrize("held_turn", [0, 1, 2])
async def test_a_rollout_handed_back_on_either_side_of_a_fork_resumes_to_the_uninterrupted_result(
    held_turn: int, server: FakeVLLMServer, engine: VLLMClient, stripping_tokenizer: Any
) -> None:
    """Turn 0 is held before any fork, turn 1 between the two, turn 2 after both: the handed-back sample goes
    through to_dict/from_dict (as the Ray pool moves it) and resumes to what the uninterrupted rollout gives."""
    config = config_for(server, "fork", router_policy="consistent_hash")
    sampling = {"max_new_tokens": 256, "temperature": 1.0, "top_p": 1.0}
    server.script([ScriptedTurn(text=text) for text in THINKING], session="reference")
    reference = await Rollout(
        Sample(prompt=PROMPT, index=0, session_id="reference"),
        config=config,
        sampling_params=sampling,
        client=engine,
        tokenizer=stripping_tokenizer,
        env_factory=SnapshotEnvFactory(),
    ).run()
    assert len(reference.branches) == 2

    turns = [
        ScriptedTurn(text=text, hang=True, held_after=3) if number == held_turn else ScriptedTurn(text=text)
        for number, text in enumerate(THINKING)
    ]
    server.script(turns, session="held")
    gate = HandingBack(lambda: [engine])
    envs = SnapshotEnvFactory()
    run = asyncio.ensure_future(
        Rollout(
            Sample(prompt=PROMPT, index=0, session_id="held"),
            config=config,
            sampling_params=sampling,
            client=engine,
            tokenizer=stripping_tokenizer,
            env_factory=envs,
            suspender=gate,
        ).run()
    )
    await server.wait_until_waiting(1)
    await gate.suspend()
    handed = await run
    assert handed.metadata["rollout_reason"] == "handed_back"
    assert len(handed.branches) == held_turn
    moved = Sample.from_dict(json.loads(json.dumps(handed.to_dict())))
    await gate.resume()
    with capture_transitions() as events:
        resumed = await Rollout(
            moved,
            config=config,
            sampling_params=sampling,
            client=engine,
            tokenizer=stripping_tokenizer,
            env_factory=envs,
            suspender=gate,
        ).run()
    assert sequences_of(resumed) == sequences_of(reference)
    assert [event["trigger"] for event in events].count("fork") == 2 - held_turn
    for sequence in training_sequences([resumed]):
        sequence.check_invariants(len(prompt_of(sequence)))


# ------------------------------------------------------------------------------------------------ compat.generate


class TrainerStatus(enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass
class TrainerSample:
    """A trainer's own sample class (as slime's): some of the library's fields, its own status enum."""

    prompt: Any = ""
    index: int | None = None
    tokens: list[int] = field(default_factory=list)
    response_length: int = 0
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    response: str = ""
    status: TrainerStatus = TrainerStatus.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)


def compat_args(server: FakeVLLMServer, **extra: Any) -> SimpleNamespace:
    return SimpleNamespace(
        partial_rollout=False,
        max_turns=3,
        rollout_interaction_env_path="fsm_rollout.testing.envs",
        vllm_router_ip="127.0.0.1",
        vllm_router_port=urlsplit(server.url).port,
        hf_checkpoint=MODEL,
        rollout_max_context_len=None,
        **extra,
    )


@pytest.mark.parametrize("sample_class", [Sample, TrainerSample])
async def test_compat_generate_returns_a_forked_rollouts_sequences_as_a_list(
    sample_class: type, server: FakeVLLMServer, stripping_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compat, "_load_tokenizer_and_processor", lambda path: (stripping_tokenizer, None))
    sampling = {"max_new_tokens": 256, "temperature": 1.0, "top_p": 1.0}
    try:
        server.script([ScriptedTurn(text=text) for text in THINKING])
        sample = sample_class(prompt=PROMPT, index=0, metadata={"scripted_env": {}})
        result = await compat.generate(compat_args(server, fsm_rollout_history_policy="fork"), sample, sampling)
        assert isinstance(result, list) and len(result) == 3 and result[-1] is sample
        assert all(type(item) is sample_class for item in result)
        assert trained_tokens(result) == [
            token for text in THINKING for token in stripping_tokenizer.encode(text, add_special_tokens=False)
        ]
        assert [item.status.value for item in result] == ["truncated"] * 3
        plain = [f"It is 42.{EOS}", f"Still 42.{EOS}", f"Yes.{EOS}"]
        server.script([ScriptedTurn(text=text) for text in plain])
        single = sample_class(prompt=PROMPT, index=1, metadata={"scripted_env": {}})
        assert await compat.generate(compat_args(server, fsm_rollout_history_policy="fork"), single, sampling) is single
    finally:
        await compat.close_clients()


@pytest.mark.parametrize("sample_class", [Sample, TrainerSample])
async def test_compat_generate_returns_a_handed_back_forked_rollout_as_the_sample_alone(
    sample_class: type, server: FakeVLLMServer, stripping_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """slime's abort path reads ``.response`` off each sample it gets back: a forked rollout handed back for a
    later resumption is the one sample, its earlier sequences kept in ``branches``, not a list."""
    monkeypatch.setattr(compat, "_load_tokenizer_and_processor", lambda path: (stripping_tokenizer, None))
    sampling = {"max_new_tokens": 256, "temperature": 1.0, "top_p": 1.0}
    turns = [ScriptedTurn(text=text) for text in THINKING[:2]]
    server.script([*turns, ScriptedTurn(text=THINKING[2], hang=True, held_after=3)])
    sample = sample_class(prompt=PROMPT, index=0, metadata={"scripted_env": {}})
    args = compat_args(server, fsm_rollout_history_policy="fork")
    args.partial_rollout = True
    try:
        run = asyncio.ensure_future(compat.generate(args, sample, sampling))
        await server.wait_until_waiting(1)
        await compat.suspend()
        result = await run
        assert result is sample
        assert result.status.value == "aborted" and result.metadata["rollout_reason"] == "handed_back"
        if sample_class is Sample:
            assert len(result.branches) == 2
    finally:
        await compat.resume()
        await compat.close_clients()


async def test_inspect_shows_a_forked_rollouts_branches_and_the_fork(
    tmp_path: Path,
    server: FakeVLLMServer,
    engine: VLLMClient,
    stripping_tokenizer: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    trace = await record_forked_runs(tmp_path, server, engine, stripping_tokenizer)
    tokenizer_dir = str(qwen_tokenizer_dir())
    code = await asyncio.to_thread(cli_main, ["inspect", str(trace), "--sample", "0", "--tokenizer", tokenizer_dir])
    out = capsys.readouterr().out
    assert code == 0
    assert "observing --fork--> rendered" in out and "reason=history_rewritten" in out and "branch=2" in out
    first, second, last = out.index("branch 0 (an earlier"), out.index("branch 1 (an earlier"), out.index("sequence 2")
    assert first < second < last
    assert "Six sevens." in out[first:second] and "Check again." in out[second:last]
    assert "Once more." in out[last:] and "Six sevens." not in out[last:]


# ------------------------------------------------------------------------------------------------ runner, overlay


async def test_the_runner_counts_forks_and_sequences_per_rollout_and_the_overlay_counts_the_fork_edge(
    server: FakeVLLMServer, stripping_tokenizer: Any
) -> None:
    for session in ("a", "b"):
        server.script([ScriptedTurn(text=text) for text in THINKING], session=session)
    config = config_for(server, "fork", router_policy="consistent_hash")
    runner = RolloutRunner(
        config,
        sampling_params={"max_new_tokens": 256, "temperature": 1.0, "top_p": 1.0},
        tokenizer=stripping_tokenizer,
        env_factory=ScriptedEnvFactory(),
    )
    with capture_transitions() as events:
        async with runner:
            samples = await runner.run_batch(
                [Sample(prompt=PROMPT, index=number, session_id=session) for number, session in enumerate("ab")]
            )
            metrics = runner.metrics()
    assert [len(sample.branches) for sample in samples] == [2, 2]
    assert (metrics.forks, metrics.sequences, metrics.samples_done) == (4, 6, 2)
    assert (metrics.forks_per_rollout, metrics.sequences_per_rollout) == (2.0, 3.0)
    overlay = build_overlay(events)
    fork_edge, compaction_edge = (
        next(index for index, edge in enumerate(lifecycle.TRANSITIONS) if (edge.trigger, edge.reason) == ("fork", why))
        for why in ("history_rewritten", "compacted")
    )
    assert (overlay.edges[fork_edge].transitions, overlay.edges[fork_edge].samples) == (4, 2)
    assert overlay.edges[compaction_edge].transitions == 0  # the event's reason tells the two fork edges apart
    assert not overlay.unmatched


async def test_the_runner_resolves_auto_once_at_start_up(server: FakeVLLMServer, stripping_tokenizer: Any) -> None:
    runner = RolloutRunner(
        config_for(server, "auto"),
        sampling_params={"max_new_tokens": 8, "temperature": 1.0},
        tokenizer=stripping_tokenizer,
        env_factory=ScriptedEnvFactory(),
    )
    assert runner.config.history_policy == "auto"
    async with runner:
        # the template strips the thinking of turns before a user message: the probe chooses fork, once
        assert runner.history_policy == "fork"
        assert runner.config.history_policy == "auto"


# ------------------------------------------------------------------------------------------------ the embedded engine


def tiny_model_with_template(tmp_path: Path, chat_template: str) -> Path:
    """The tiny model's directory, its weights linked, with another chat template in its tokenizer config."""
    source = tiny_model_dir()
    target = tmp_path / "tiny-stripping"
    target.mkdir()
    for item in source.iterdir():
        if item.name == "tokenizer_config.json":
            config = json.loads(item.read_text())
            config["chat_template"] = chat_template
            (target / item.name).write_text(json.dumps(config))
        elif item.name != "chat_template.jinja":
            (target / item.name).symlink_to(item)
    return target


async def test_on_the_embedded_engine_every_prompt_is_its_render_and_every_token_its_generation(
    tmp_path: Path,
) -> None:
    """Whatever the random weights write, under fork and per_turn each sequence's prompt is one of the engine's
    renders, each render is the served template's rendering of the conversation sent, and the trainable tokens are
    the engine's answers."""
    from fsm_rollout.engine.local import LocalEngine
    from fsm_rollout.tokens.tokenizers import load_tokenizer

    model_dir = tiny_model_with_template(tmp_path, THINK_STRIPPING_CHAT_TEMPLATE)
    tokenizer = load_tokenizer(str(model_dir))
    renders: list[tuple[list[dict[str, Any]], list[int]]] = []
    answers: list[list[int]] = []
    engine = LocalEngine(model_dir, served_model_name="tiny", max_model_len=1024, torch_threads=1)
    async with engine, VLLMClient(engine.url) as client:
        render_once, generate_once = client.render, client.generate

        async def render_kept(payload: dict[str, Any], **kwargs: Any) -> Any:
            rendered = await render_once(payload, **kwargs)
            renders.append((payload["messages"], list(rendered.token_ids)))
            return rendered

        async def generate_kept(body: dict[str, Any], **kwargs: Any) -> Any:
            answer = await generate_once(body, **kwargs)
            answers.append(list(answer.token_ids))
            return answer

        client.render, client.generate = render_kept, generate_kept  # type: ignore[method-assign]
        for policy in ("fork", "per_turn"):
            renders.clear()
            answers.clear()
            rollout = Rollout(
                Sample(prompt=PROMPT, index=0),
                config=RolloutConfig(
                    engine_url=engine.url, model="tiny", max_turns=4, check_invariants=True, history_policy=policy
                ),
                # a stop token roughly every few tokens, so turns end and observations follow
                sampling_params={
                    "max_new_tokens": 200,
                    "temperature": 1.0,
                    "top_p": 1.0,
                    "seed": 7,
                    "stop_token_ids": list(range(0, len(tokenizer), 5)),
                },
                client=client,
                tokenizer=tokenizer,
                env_factory=ScriptedEnvFactory(),
            )
            sample = await rollout.run()
            sequences = training_sequences([sample])
            assert trained_tokens(sequences) == [token for answer in answers for token in answer], policy
            assert len(answers) >= 2, policy  # observations followed turns
            for messages, token_ids in renders:  # the engine rendered with the template it serves
                assert token_ids == render(tokenizer, messages), policy
            rendered = [token_ids for _, token_ids in renders]
            for sequence in sequences:
                assert prompt_of(sequence) in rendered, policy
                sequence.check_invariants(len(prompt_of(sequence)))
            if policy == "per_turn":
                assert len(sequences) == len(answers)


def test_the_canned_bench_server_renders_a_conversation_so_fork_rollouts_extend_without_forking(
    tokenizer: Any,
) -> None:
    """The forks benchmark's CPU figure is fork's own cost only if the canned server's re-render is the template's
    (a canned first prompt for every render would fork every observation)."""
    from fsm_rollout.cli.bench.server import Server
    from tools.bench_forks import canned_run

    server = Server(0.0)
    try:
        url = server.url()
        fork = canned_run(url, tokenizer, "fork", 2)
        append = canned_run(url, tokenizer, "append", 2)
    finally:
        server.stop()
    assert (fork["renders_per_observation"], fork["forks_per_rollout"]) == (1.0, 0.0)
    assert (append["renders_per_observation"], append["forks_per_rollout"]) == (0.0, 0.0)
