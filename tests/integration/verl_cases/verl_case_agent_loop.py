"""The verl agent loop, with verl's real classes: ``FsmRolloutAgentLoop`` is registered under ``fsm_rollout``, built
as verl's workers build it, and its ``run`` rolls a GEM game out through a server manager that keeps verl's
``generate(request_id, prompt_ids, sampling_params, image_data)`` contract (here backed by the fake engine, so the
turns are scripted). The answer is verl's ``AgentLoopOutput`` with exactly the tokens the server produced.

verl does not install beside the project's pins with pip's resolver, so it is no extra: this file is not collected
by the main run (its name is no ``test_*.py``). ``tests/integration/test_adapters_verl.py`` runs it with a python
that has verl (the layered venv of ``tests/integration/verl_venv.py``, or the running one when it has verl).
"""

from __future__ import annotations

from typing import Any

import pytest
from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import (
    AgentLoopOutput,
    DictConfigWrap,
    _agent_loop_registry,
)
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.workers.rollout.replica import TokenOutput

from fsm_rollout.adapters.verl_agent_loop import AGENT_NAME, FsmRolloutAgentLoop, VerlServerTransport
from fsm_rollout.engine.client import VLLMClient
from fsm_rollout.engine.schema import GENERATE_PATH, RENDER_PATH
from fsm_rollout.errors import EngineHTTPError, RolloutError
from fsm_rollout.testing.fake_vllm import FakeVLLMServer, ScriptedTurn

GAME = "game:GuessTheNumber-v0-easy"
VERL_SAMPLING = {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


class ServerManager:
    """verl's server-manager contract (``generate(request_id, *, prompt_ids, sampling_params, image_data)`` →
    ``TokenOutput``) over an engine client's transport; it keeps every call."""

    def __init__(self, client: VLLMClient, model: str) -> None:
        self.client = client
        self.model = model
        self.calls: list[dict[str, Any]] = []

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], image_data: Any = None,
        **kwargs: Any,
    ) -> TokenOutput:  # fmt: skip
        body = {
            "model": self.model,
            "request_id": f"{request_id}-{len(self.calls)}",
            "token_ids": prompt_ids,
            "sampling_params": {"max_tokens": sampling_params["max_tokens"], "logprobs": 1},
        }
        turn = await self.client.generate(body, request_id=body["request_id"])
        self.calls.append({"request_id": request_id, "prompt_ids": list(prompt_ids), "params": dict(sampling_params),
                           "image_data": image_data, "tokens": list(turn.token_ids)})  # fmt: skip
        return TokenOutput(token_ids=list(turn.token_ids), log_probs=list(turn.logprobs), stop_reason="completed")


def secret_number(seed: int) -> int:
    import gem

    env = gem.make(GAME)
    env.reset(seed=seed)
    return int(env.game_number)


def trainer_config(response_length: int = 256) -> Any:
    rollout = {"prompt_length": 1024, "response_length": response_length, "multi_turn": {"max_assistant_turns": 3}}
    config = {"actor_rollout_ref": {"rollout": rollout, "model": {"path": "fake-model"}}}
    return DictConfigWrap(OmegaConf.create(config))


def agent_loop(server_manager: Any, tokenizer: Any, **kwargs: Any) -> FsmRolloutAgentLoop:
    """The loop built with the arguments verl's ``AgentLoopWorker`` gives it."""
    return FsmRolloutAgentLoop(
        trainer_config=trainer_config(),
        server_manager=server_manager,
        tokenizer=tokenizer,
        processor=None,
        dataset_cls=RLHFDataset,
        data_config=DictConfigWrap(OmegaConf.create({})),
        **kwargs,
    )


def test_the_loop_is_registered_with_verl_under_its_name() -> None:
    target = _agent_loop_registry[AGENT_NAME]["_target_"]
    assert target == "fsm_rollout.adapters.verl_agent_loop.FsmRolloutAgentLoop"


async def test_a_gem_game_runs_as_a_verl_agent_loop_on_the_server_managers_tokens(tokenizer: Any) -> None:
    target = secret_number(5)
    wrong = 1 if target != 1 else 2
    async with FakeVLLMServer(tokenizer, model="fake-model") as server:
        server.script([ScriptedTurn(text=f"\\boxed{{{wrong}}}"), ScriptedTurn(text=f"\\boxed{{{target}}}")])
        manager = ServerManager(VLLMClient(server.url), "fake-model")
        loop = agent_loop(manager, tokenizer, env=f"gym:{GAME}")
        row = {"raw_prompt": [{"role": "system", "content": "Play well."}], "index": 5, "agent_name": AGENT_NAME}
        output = await loop.run(dict(VERL_SAMPLING), **row)
        await manager.client.close()
    assert isinstance(output, AgentLoopOutput), output
    assert output.extra_fields == {"rollout_status": "completed", "rollout_reason": "env_done"}
    first, second = manager.calls
    assert {first["request_id"]} == {second["request_id"]}  # one sticky session for the rollout
    assert first["params"]["temperature"] == 0.7 and first["params"]["top_p"] == 0.9 and first["params"]["logprobs"]
    assert first["image_data"] is None
    assert output.prompt_ids == first["prompt_ids"]
    observation = second["prompt_ids"][len(first["prompt_ids"]) + len(first["tokens"]) :]
    assert output.response_ids == first["tokens"] + observation + second["tokens"]
    assert output.response_mask == [1] * len(first["tokens"]) + [0] * len(observation) + [1] * len(second["tokens"])
    assert output.response_logprobs is not None and len(output.response_logprobs) == len(output.response_ids)
    assert all(
        value == 0.0 for value, kept in zip(output.response_logprobs, output.response_mask, strict=True) if not kept
    )
    assert f"the target number is {'higher' if wrong < target else 'lower'}" in tokenizer.decode(observation)
    assert output.reward_score is not None and output.reward_score > 0 and output.num_turns == 4
    assert "Play well." in tokenizer.decode(output.prompt_ids)
    assert set(output.as_dict()) >= {"prompts", "responses", "response_mask", "rollout_log_probs"}


async def test_the_response_length_is_the_rollouts_budget(tokenizer: Any) -> None:
    async with FakeVLLMServer(tokenizer, model="fake-model") as server:
        server.script([ScriptedTurn(text="a " * 40)])
        manager = ServerManager(VLLMClient(server.url), "fake-model")
        loop = FsmRolloutAgentLoop(
            trainer_config=trainer_config(response_length=12), server_manager=manager, tokenizer=tokenizer,
            processor=None, dataset_cls=RLHFDataset, data_config=DictConfigWrap(OmegaConf.create({})),
            env=f"gym:{GAME}",
        )  # fmt: skip
        output = await loop.run(dict(VERL_SAMPLING), raw_prompt=[], index=0)
        await manager.client.close()
    assert manager.calls[0]["params"]["max_tokens"] == 12
    assert len(output.response_ids) == 12 and output.extra_fields["rollout_status"] == "truncated"
    assert output.extra_fields["rollout_reason"] == "length"


def test_the_loop_needs_an_environment(tokenizer: Any) -> None:
    with pytest.raises(RolloutError, match="needs env="):
        agent_loop(object(), tokenizer)


class Answering:
    """A server manager that answers every request with fixed tokens and says how it stopped."""

    def __init__(self, tokens: list[int], stop_reason: str | None) -> None:
        self.tokens = tokens
        self.stop_reason = stop_reason

    async def generate(self, request_id: str, **kwargs: Any) -> TokenOutput:
        return TokenOutput(token_ids=self.tokens, log_probs=[-0.5] * len(self.tokens), stop_reason=self.stop_reason)


def transport(tokenizer: Any, manager: Any) -> VerlServerTransport:
    return VerlServerTransport(manager, tokenizer, model="m", max_model_len=64, request_id="r")


@pytest.mark.parametrize(
    "stop_reason, tokens, finish",
    [("aborted", [11, 12], "abort"), ("completed", [11, 12, 13, 14], "length"), ("completed", [11], "stop")],
)
async def test_the_transport_answers_generate_in_vllms_shape_with_the_finish_verl_implies(
    tokenizer: Any, stop_reason: str, tokens: list[int], finish: str
) -> None:
    body = {"model": "m", "token_ids": [1, 2, 3], "request_id": "q", "sampling_params": {"max_tokens": 4}}
    answer = await transport(tokenizer, Answering(tokens, stop_reason)).post_json(GENERATE_PATH, body)
    [choice] = answer["choices"]
    assert (choice["finish_reason"], choice["token_ids"]) == (finish, tokens)
    assert [entry["logprob"] for entry in choice["logprobs"]["content"]] == [-0.5] * len(tokens)


async def test_the_transport_refuses_image_parts_and_paths_it_does_not_serve(tokenizer: Any) -> None:
    seam = transport(tokenizer, Answering([], None))
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = {"model": "m", "messages": [{"role": "user", "content": [image]}]}
    with pytest.raises(EngineHTTPError, match="only text parts") as refused:
        await seam.post_json(RENDER_PATH, body)
    assert refused.value.status == 400
    with pytest.raises(EngineHTTPError, match="not served") as unknown:
        await seam.post_json("/pause?mode=keep", {})
    assert unknown.value.status == 404
