"""The history policies' pure parts: comparison by meaning, assistant messages, branches and training sequences."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fsm_rollout import RolloutConfig, Sample, Status, training_sequences
from fsm_rollout.engine.schema import check_chat_message
from fsm_rollout.rollout.history import assistant_message, canonical_text, rollout_policy, same_meaning
from fsm_rollout.sample.branches import split_branch

CALL = '<tool_call>\n{"name": "calc", "arguments": {"expression": "6*7", "exact": false}}\n</tool_call>'


@pytest.mark.parametrize(
    "rewritten",
    [
        '<tool_call>\n{"arguments": {"exact": false, "expression": "6*7"}, "name": "calc"}\n</tool_call>',  # key order
        '<tool_call>{"name":"calc","arguments":{"expression":"6*7","exact":false}}</tool_call>',  # spacing
        "<tool_call>\n{'name': 'calc', 'arguments': {'expression': '6*7', 'exact': False}}\n</tool_call>",  # Python
        '<tool_call>\n{"name": "calc", "arguments": "{\\"expression\\": \\"6*7\\", \\"exact\\": false}"}\n</tool_call>',
    ],
)
def test_a_tool_call_written_another_way_means_the_same(rewritten: str) -> None:
    assert same_meaning(f"Let me check.\n{CALL}<|im_end|>", f"Let me check.{rewritten}<|im_end|>")


@pytest.mark.parametrize(
    "changed",
    [
        '<tool_call>\n{"name": "calc", "arguments": {"expression": "6*7", "exact": true}}\n</tool_call>',
        '<tool_call>\n{"name": "calc2", "arguments": {"expression": "6*7", "exact": false}}\n</tool_call>',
        '<tool_call>\n{"name": "calc", "arguments": {"expression": "6*7"}}\n</tool_call>',
    ],
)
def test_another_tool_call_is_a_break(changed: str) -> None:
    assert not same_meaning(CALL, changed)


def test_empty_think_blocks_are_normalised_and_thinking_is_not() -> None:
    assert same_meaning("<think>\n\n</think>\n\nIt is 42.", "It is 42.")
    # sampled after an open <think>\n, written back as a closed empty block
    assert same_meaning("assistant\n<think>\n</think>\n\nIt is 42.", "assistant\n<think>\n\n</think>\n\nIt is 42.")
    assert not same_meaning("<think>\nSix sevens.\n</think>\n\nIt is 42.", "It is 42.")
    assert canonical_text("a <tool_call>not json</tool_call> b") == "a<tool_call>not json</tool_call>b"


def test_an_assistant_turn_with_tool_calls_is_structured_only_when_the_sample_has_tools() -> None:
    text = f"Checking.\n{CALL}"
    tools = [{"type": "function", "function": {"name": "calc"}}]
    assert assistant_message(text, tools=None) == {"role": "assistant", "content": text}
    message = assistant_message(text, tools=tools)
    assert message["content"] == "Checking."
    # OpenAI's wire form, which vLLM's render validates: the arguments are a JSON string, not an object
    assert message["tool_calls"] == [
        {
            "id": "call_0",
            "type": "function",
            "function": {"name": "calc", "arguments": '{"expression": "6*7", "exact": false}'},
        }
    ]
    check_chat_message(message, 1)  # the engine's check takes it
    broken = "<tool_call>{oops</tool_call>"
    assert assistant_message(broken, tools=tools) == {"role": "assistant", "content": broken}


def test_auto_reaching_a_rollout_is_append() -> None:
    config = RolloutConfig(engine_url="http://h:1", model="m", max_turns=1)
    assert rollout_policy(config) == "append"
    fork = RolloutConfig(engine_url="http://h:1", model="m", max_turns=1, history_policy="fork")
    assert rollout_policy(fork) == "fork"


def a_forked_sample() -> Sample:
    sample = Sample(prompt="p", index=4, group_index=2, session_id="s", metadata={"keep": 1})
    sample.tokens = [1, 2]
    sample.append_response_tokens([3, 4], [-0.1, -0.2])
    sample.metadata["weight_version_spans"] = [{"version": "1", "start": 0, "end": 2}]
    sample.rollout_routed_experts = np.zeros((3, 1, 1), dtype=np.int32)
    split_branch(sample, response="34", train_inputs={"pixel_values": np.ones((1, 2), dtype=np.float32)})
    sample.tokens = [1, 2, 9]
    sample.append_response_tokens([5], [-0.3])
    sample.metadata["weight_version_spans"] = [{"version": "2", "start": 0, "end": 1}]
    return sample


def test_a_closed_branch_keeps_its_sequence_and_the_sample_starts_afresh() -> None:
    sample = a_forked_sample()
    (branch,) = sample.branches
    assert (branch.tokens, branch.loss_mask, branch.rollout_log_probs) == ([1, 2, 3, 4], [1, 1], [-0.1, -0.2])
    assert branch.metadata == {"keep": 1, "branch": 0, "weight_version_spans": [{"version": "1", "start": 0, "end": 2}]}
    assert branch.rollout_routed_experts is not None and sample.rollout_routed_experts is None
    assert (sample.tokens, sample.loss_mask, sample.response_length) == ([1, 2, 9, 5], [1], 1)
    branch.check_invariants(2)
    sample.check_invariants(3)


def test_branches_survive_to_dict_and_from_dict_through_json() -> None:
    sample = a_forked_sample()
    back = Sample.from_dict(json.loads(json.dumps(sample.to_dict())))
    assert len(back.branches) == 1
    (branch,) = back.branches
    assert isinstance(branch, Sample) and branch.tokens == [1, 2, 3, 4] and branch.loss_mask == [1, 1]
    assert branch.multimodal_train_inputs is not None
    np.testing.assert_array_equal(branch.multimodal_train_inputs["pixel_values"], np.ones((1, 2)))
    assert back.tokens == [1, 2, 9, 5]
    assert Sample.from_dict(Sample(prompt="x").to_dict()).branches == []


def test_training_sequences_flatten_each_rollout_and_share_its_outcome() -> None:
    forked, single = a_forked_sample(), Sample(prompt="q", index=5)
    forked.reward, forked.status = 1.0, Status.COMPLETED  # set after the rollout, as a reward model does
    sequences = training_sequences([forked, single])
    assert sequences == [forked.branches[0], forked, single]
    branch = forked.branches[0]
    assert (branch.reward, branch.status, branch.index, branch.group_index, branch.session_id) == (
        1.0,
        Status.COMPLETED,
        4,
        2,
        "s",
    )
    assert (branch.metadata["branch"], forked.metadata["branch"]) == (0, 1)
    assert "branch" not in single.metadata
    with pytest.raises(TypeError, match="item 0 is dict"):
        training_sequences([{"tokens": []}])  # type: ignore[list-item]


def test_the_grpo_example_gives_every_sequence_of_a_rollout_the_rollouts_advantage() -> None:
    from types import SimpleNamespace

    from fsm_rollout.examples.grpo import GRPOOptions, group_advantages, training_batch

    forked = a_forked_sample()
    forked.reward = 1.0
    plain = Sample(prompt="q", index=5, reward=0.0, metadata={"weight_version_spans": []})
    stale = a_forked_sample()  # its first sequence was sampled by weights three versions back
    stale.reward = 1.0
    stale.branches[0].metadata["weight_version_spans"] = [{"version": "0", "start": 0, "end": 2}]
    for sample in (forked, stale):
        sample.metadata["weight_version_spans"] = [{"version": "3", "start": 0, "end": 1}]
        sample.branches[0].metadata.setdefault("weight_version_spans", [])
    forked.branches[0].metadata["weight_version_spans"] = [{"version": "3", "start": 0, "end": 2}]
    trainer = SimpleNamespace(version="3", history=["0", "1", "2", "3"])
    samples, advantages, dropped, kept = training_batch(
        [[forked, plain, stale]],
        trainer,
        GRPOOptions(max_staleness=1),  # type: ignore[arg-type]
    )
    high, low, _ = group_advantages([1.0, 0.0, 1.0])  # one advantage per rollout, over the group's rollouts
    assert samples == [forked.branches[0], forked, plain]
    assert advantages == [high, high, low]
    assert dropped == 1  # the stale rollout is dropped whole, all its sequences with it
    assert kept == [forked, plain]


def test_pool_metrics_add_up_the_workers_forks_and_sequences() -> None:
    from fsm_rollout.runtime.metrics import MetricsSnapshot, combine_metrics

    def worker(done: int, forks: int) -> MetricsSnapshot:
        return MetricsSnapshot(
            occupancy={},
            in_flight=0,
            dwell_ms_mean={},
            statuses={"completed": done},
            reasons={"env_done": done},
            samples_done=done,
            turns=0,
            tokens_generated=0,
            elapsed_s=1.0,
            samples_per_s=0.0,
            turns_per_s=0.0,
            tokens_per_s=0.0,
            forks=forks,
            sequences=done + forks,
        )

    pooled = combine_metrics([worker(2, 3), worker(4, 1)], elapsed_s=1.0, failed_in_pool={"worker_lost": 2})
    assert (pooled.forks, pooled.sequences, pooled.samples_done) == (4, 12, 8)  # a lost sample is one sequence
    assert pooled.forks_per_rollout == 0.5 and pooled.sequences_per_rollout == 1.5
    assert worker(0, 0).sequences_per_rollout == 0.0
