"""The typed step end to end: an environment that accepts turns and returns StepResult, recorded and replayed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsm_rollout import RolloutRunner, Sample, StepResult, Turn
from fsm_rollout.replay import replay
from fsm_rollout.testing.fake_vllm import FakeVLLMServer, ScriptedTurn

SAMPLING = {"max_new_tokens": 64, "temperature": 1.0, "top_p": 1.0}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'


class TurnEnv:
    """Declares that it takes turns; ends the episode cut short on the second, with a reward."""

    accepts_turn = True

    def __init__(self) -> None:
        self.turns: list[Turn] = []

    def reset(self) -> None:
        return None

    def step(self, turn: Turn) -> StepResult:
        self.turns.append(turn)
        if len(self.turns) == 1:
            return StepResult("5", reward=0.5, info={"note": "first"})
        return StepResult("stop", done=True, truncated=True, reward=1.5)

    def format_observation(self, observation: Any) -> dict[str, Any]:
        return {"role": "tool", "content": str(observation)}

    def close(self) -> None:
        return None


async def test_an_environment_that_accepts_turns_gets_them_and_its_typed_step_picks_the_edge(
    fake_vllm: FakeVLLMServer, tokenizer: Any, make_config: Callable[..., Any], tmp_path: Path
) -> None:
    built: list[TurnEnv] = []

    def build_env(*, sample: Any, args: Any) -> TurnEnv:
        built.append(TurnEnv())
        return built[-1]

    trace = tmp_path / "run.jsonl"
    config = make_config(max_turns=4, trace=str(trace), record=True)
    fake_vllm.script([ScriptedTurn(text=CALL), ScriptedTurn(text="Five.<|im_end|>")])
    async with RolloutRunner(config, sampling_params=SAMPLING, tokenizer=tokenizer, env_factory=build_env) as runner:
        (sample,) = await runner.run_batch([Sample(prompt="2+3?", index=0)])
    assert (sample.status.value, sample.metadata["rollout_reason"], sample.reward) == (
        "truncated",
        "env_truncated",
        1.5,
    )
    first, second = built[0].turns
    assert first.text == CALL and first.finish_reason == "stop"
    assert [(call.name, call.arguments) for call in first.tool_calls] == [("add", {"a": 2, "b": 3})]
    assert second.tool_calls == ()
    # each turn's tokens are the sample's own, trained, at the position the turn says its request ended
    assert sample.loss_mask is not None and sample.rollout_log_probs is not None
    prompt_length = len(sample.tokens) - sample.response_length
    for turn in (first, second):
        start = turn.prompt_tokens
        assert list(sample.tokens[start : start + len(turn.token_ids)]) == list(turn.token_ids)
        offsets = range(start - prompt_length, start - prompt_length + len(turn.token_ids))
        assert [sample.loss_mask[i] for i in offsets] == [1] * len(turn.token_ids)
        assert [sample.rollout_log_probs[i] for i in offsets] == list(turn.logprobs)
    assert tokenizer.decode(list(second.token_ids)) == second.text == "Five.<|im_end|>"
    # the tape holds the typed step; today's rollout replays it identically
    tape = (tmp_path / "run.tape.jsonl").read_text()
    assert '"step":{"observation":"stop","done":true,"reward":1.5,"truncated":true,"end":null' in tape
    report = await asyncio.to_thread(replay, trace, tokenizer=tokenizer)
    assert report.counts() == {"identical": 1}, report.render(verbose=True)
