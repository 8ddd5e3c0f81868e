"""Errors end the sample ``failed`` with its data kept, the environment closed once, and a specific exception."""

from __future__ import annotations

from typing import Any

import pytest

from fsm_rollout import RetryPolicy, Sample, Status
from fsm_rollout.errors import (
    BudgetExceededError,
    ConfigError,
    EngineConnectionError,
    EngineHTTPError,
    EngineTimeoutError,
    EnvironmentContractError,
    GenerationError,
    ImageInputError,
    MalformedTokensError,
    ObservationError,
    RenderError,
    RolloutError,
    RoutingReplayError,
    SampleStateError,
    SamplingParamsError,
)
from fsm_rollout.testing.envs import ScriptedEnvFactory
from fsm_rollout.testing.fake_vllm import GENERATE_PATH, RENDER_PATH, FakeVLLMServer, ScriptedTurn

FAST_RETRY = RetryPolicy(max_attempts=3, base_delay_s=0.001, max_delay_s=0.001)


def raw_choice(**choice: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, **choice}]}


async def run_failing(run_rollout: Any, error: type[BaseException], **kwargs: Any) -> Any:
    from fsm_rollout import capture_transitions

    with capture_transitions() as events, pytest.raises(error) as caught:
        await run_rollout(**kwargs)
    return caught.value, events


async def test_render_client_error_fails_at_once_without_retry(run_rollout: Any, fake_vllm: FakeVLLMServer) -> None:
    fake_vllm.fail_next(RENDER_PATH, status=400)
    envs = ScriptedEnvFactory()
    error, events = await run_failing(run_rollout, EngineHTTPError, envs=envs)
    assert error.status == 400
    assert len(fake_vllm.requests_to(RENDER_PATH)) == 1
    assert events[-1]["dst"] == "failed"
    assert events[-1]["error_type"] == "EngineHTTPError"
    assert events[-1]["failed_trigger"] == "render"
    assert envs.last.close_count == 1


async def test_failed_sample_records_the_error_and_keeps_earlier_turns(
    make_rollout: Any, fake_vllm: FakeVLLMServer
) -> None:
    fake_vllm.script([ScriptedTurn(text="first"), ScriptedTurn(status=400)])
    rollout, envs = make_rollout()
    with pytest.raises(EngineHTTPError):
        await rollout.run()
    sample = rollout.sample
    assert sample.status == Status.FAILED
    assert rollout.state == "failed"
    assert sample.metadata["rollout_error"]["type"] == "EngineHTTPError"
    assert sample.metadata["rollout_error"]["state"] == "generating"
    assert sample.metadata["rollout_reason"] == "error"
    assert sample.response == "first"
    assert sample.response_length == len(sample.loss_mask) == len(sample.rollout_log_probs) > 1
    assert envs.last.close_count == 1


@pytest.mark.parametrize("status", [429, 500, 502, 503, 504])
async def test_transient_statuses_are_retried_and_end_as_if_nothing_happened(
    run_rollout: Any, fake_vllm: FakeVLLMServer, status: int
) -> None:
    fake_vllm.script([ScriptedTurn(text="ok")])
    fake_vllm.fail_next(GENERATE_PATH, status=status, times=2)
    result = await run_rollout(max_turns=1, retry=FAST_RETRY)
    assert result.sample.status == Status.TRUNCATED
    assert result.sample.response == "ok"
    assert len(fake_vllm.requests_to(GENERATE_PATH)) == 3


async def test_persistent_transient_status_fails_after_the_retry_budget(
    run_rollout: Any, fake_vllm: FakeVLLMServer
) -> None:
    fake_vllm.fail_next(GENERATE_PATH, status=503, times=5)
    error, _ = await run_failing(run_rollout, EngineHTTPError, retry=FAST_RETRY)
    assert error.status == 503
    assert len(fake_vllm.requests_to(GENERATE_PATH)) == 3


@pytest.mark.parametrize("path", [RENDER_PATH, GENERATE_PATH])
async def test_a_transient_500_changes_nothing_in_the_result(
    run_rollout: Any, fake_vllm: FakeVLLMServer, path: str
) -> None:
    fake_vllm.script([ScriptedTurn(text="ok")])
    clean = (await run_rollout(max_turns=1, retry=FAST_RETRY)).sample
    fake_vllm.script([ScriptedTurn(text="ok")])
    fake_vllm.fail_next(path, status=500)
    retried = (await run_rollout(max_turns=1, retry=FAST_RETRY)).sample
    assert len(fake_vllm.requests_to(path)) == 3  # one clean, one failed, one retried
    assert (retried.status, retried.response, retried.tokens, retried.loss_mask, retried.rollout_log_probs) == (
        clean.status,
        clean.response,
        clean.tokens,
        clean.loss_mask,
        clean.rollout_log_probs,
    )


async def test_a_persistent_500_fails_after_the_bounded_attempts_with_the_servers_message(
    run_rollout: Any, fake_vllm: FakeVLLMServer
) -> None:
    fake_vllm.fail_next(GENERATE_PATH, status=500, times=5)
    error, events = await run_failing(run_rollout, EngineHTTPError, retry=FAST_RETRY)
    assert error.status == 500
    assert "attempt 3" in str(error) and "injected" in str(error).lower()
    assert len(fake_vllm.requests_to(GENERATE_PATH)) == 3
    assert events[-1]["dst"] == "failed"


async def test_a_policy_without_500_fails_on_the_first_500(fake_vllm: FakeVLLMServer) -> None:
    from fsm_rollout import VLLMClient

    policy = RetryPolicy(max_attempts=3, base_delay_s=0.001, retry_statuses=frozenset({503}))
    fake_vllm.fail_next(GENERATE_PATH, status=500)
    async with VLLMClient(fake_vllm.url, retry=policy) as client:
        with pytest.raises(EngineHTTPError) as caught:
            await client.post_json(GENERATE_PATH, {"token_ids": [1]})
    assert caught.value.status == 500
    assert len(fake_vllm.requests_to(GENERATE_PATH)) == 1


@pytest.mark.parametrize("statuses", [{400}, {404, 503}, {422}])
def test_a_retry_policy_refuses_to_retry_request_errors(statuses: set[int]) -> None:
    with pytest.raises(ConfigError, match="4xx"):
        RetryPolicy(retry_statuses=frozenset(statuses))


@pytest.mark.parametrize("status", [400, 404, 422])
async def test_non_retryable_statuses_fail_with_the_servers_message(
    run_rollout: Any, fake_vllm: FakeVLLMServer, status: int
) -> None:
    fake_vllm.fail_next(GENERATE_PATH, status=status)
    error, _ = await run_failing(run_rollout, EngineHTTPError, retry=FAST_RETRY)
    assert error.status == status
    assert "answered HTTP" in str(error)
    assert len(fake_vllm.requests_to(GENERATE_PATH)) == 1


async def test_connection_reset_is_retried(run_rollout: Any, fake_vllm: FakeVLLMServer) -> None:
    fake_vllm.script([ScriptedTurn(text="ok")])
    fake_vllm.fail_next(GENERATE_PATH, reset=True)
    result = await run_rollout(max_turns=1, retry=FAST_RETRY)
    assert result.sample.response == "ok"


async def test_unreachable_server_fails_with_a_connection_error(make_config: Any, tokenizer: Any) -> None:
    from fsm_rollout import Rollout, VLLMClient

    config = make_config(engine_url="http://127.0.0.1:9", retry=FAST_RETRY)
    async with VLLMClient(config.engine_url, retry=FAST_RETRY) as client:
        rollout = Rollout(
            Sample(prompt="q"),
            config=config,
            sampling_params={"max_new_tokens": 4, "temperature": 1, "top_p": 1},
            client=client,
            tokenizer=tokenizer,
            env_factory=ScriptedEnvFactory(),
        )
        with pytest.raises(EngineConnectionError, match="3 attempt"):
            await rollout.run()
    assert rollout.state == "failed"


async def test_timeout_fails_with_a_timeout_error(make_rollout: Any, fake_vllm: FakeVLLMServer) -> None:
    from fsm_rollout import VLLMClient

    fake_vllm.script([ScriptedTurn(text="never", hang=True)])
    rollout, _ = make_rollout()
    async with VLLMClient(fake_vllm.url, request_timeout_s=0.2) as slow_client:
        rollout.client = slow_client
        with pytest.raises(EngineTimeoutError):
            await rollout.run()
    assert rollout.state == "failed"


async def test_non_json_answer_is_a_generation_error(run_rollout: Any, fake_vllm: FakeVLLMServer) -> None:
    fake_vllm.fail_next(GENERATE_PATH, malformed_json=True)
    await run_failing(run_rollout, GenerationError)


@pytest.mark.parametrize(
    ("raw", "error", "builtin"),
    [
        ({"choices": []}, GenerationError, ValueError),
        (
            raw_choice(finish_reason="error", token_ids=[1], logprobs={"content": [{"logprob": 0.0}]}),
            GenerationError,
            ValueError,
        ),
        (
            raw_choice(finish_reason=None, token_ids=[1], logprobs={"content": [{"logprob": 0.0}]}),
            GenerationError,
            ValueError,
        ),
        (
            raw_choice(finish_reason="stop", token_ids=[1, "2"], logprobs={"content": [{"logprob": 0.0}] * 2}),
            MalformedTokensError,
            TypeError,
        ),
        (
            raw_choice(finish_reason="stop", token_ids=[1, 2.0], logprobs={"content": [{"logprob": 0.0}] * 2}),
            MalformedTokensError,
            TypeError,
        ),
        (
            raw_choice(finish_reason="stop", token_ids=[1, 2], logprobs={"content": [{"logprob": 0.0}]}),
            GenerationError,
            ValueError,
        ),
        (
            raw_choice(finish_reason="stop", token_ids=[1], logprobs={"content": [{"logprob": "x"}]}),
            MalformedTokensError,
            TypeError,
        ),
        (raw_choice(finish_reason="stop", token_ids=[1], logprobs=None), MalformedTokensError, TypeError),
        (
            raw_choice(finish_reason="stop", token_ids=[1], logprobs={"content": [{"token_id": 2, "logprob": 0.0}]}),
            GenerationError,
            ValueError,
        ),
        (
            raw_choice(
                finish_reason="stop",
                token_ids=[1],
                logprobs={"content": [{"logprob": 0.0}]},
                routed_experts="not base64!",
            ),
            GenerationError,
            ValueError,
        ),
    ],
)
async def test_schema_violations_fail_with_specific_errors(
    run_rollout: Any, fake_vllm: FakeVLLMServer, raw: Any, error: type[Exception], builtin: type[Exception]
) -> None:
    fake_vllm.script([ScriptedTurn(raw=raw)])
    caught, events = await run_failing(run_rollout, error)
    assert isinstance(caught, builtin)
    assert isinstance(caught, RolloutError)
    assert events[-1]["dst"] == "failed"


async def test_more_tokens_than_requested_is_an_error(run_rollout: Any, fake_vllm: FakeVLLMServer) -> None:
    raw = raw_choice(finish_reason="length", token_ids=[1, 2, 3], logprobs={"content": [{"logprob": 0.0}] * 3})
    fake_vllm.script([ScriptedTurn(raw=raw)])
    caught, _ = await run_failing(
        run_rollout, BudgetExceededError, sampling={"max_new_tokens": 2, "temperature": 1.0, "top_p": 1.0}
    )
    assert "generated_tokens=3, remaining_budget=2" in str(caught)


async def test_render_with_empty_token_ids_is_a_render_error(run_rollout: Any, fake_vllm: FakeVLLMServer) -> None:
    from unittest import mock

    async def empty_render(*_: Any, **__: Any) -> Any:
        from fsm_rollout.engine.schema import parse_render_response

        return parse_render_response({"token_ids": []}, "fake-model")

    with mock.patch("fsm_rollout.engine.client.VLLMClient.render", empty_render):
        await run_failing(run_rollout, RenderError)


async def test_build_env_error_propagates_and_nothing_is_closed(run_rollout: Any, fake_vllm: FakeVLLMServer) -> None:
    envs = ScriptedEnvFactory(build_error=KeyError("label"))
    _, events = await run_failing(run_rollout, KeyError, envs=envs)
    assert envs.built == []
    assert fake_vllm.requests == []
    assert events[-1]["error_type"] == "KeyError"


@pytest.mark.parametrize("method", ["reset", "step", "format_observation"])
async def test_environment_errors_propagate_and_close_once(
    run_rollout: Any, fake_vllm: FakeVLLMServer, method: str
) -> None:
    fake_vllm.script([ScriptedTurn(text="a")])
    envs = ScriptedEnvFactory(raise_in={method: RuntimeError(f"{method} broke")})
    caught, events = await run_failing(run_rollout, RuntimeError, envs=envs)
    assert str(caught) == f"{method} broke"
    assert envs.last.close_count == 1
    assert events[-1]["error"] == f"{method} broke"


async def test_close_error_without_earlier_error_fails_the_sample(run_rollout: Any, fake_vllm: FakeVLLMServer) -> None:
    fake_vllm.script([ScriptedTurn(text="a")])
    envs = ScriptedEnvFactory(steps=[("ok", True)], raise_in={"close": OSError("close broke")})
    caught, events = await run_failing(run_rollout, OSError, envs=envs)
    assert str(caught) == "close broke"
    assert envs.last.close_count == 1
    assert events[-1]["src"] == "stepping"
    assert events[-1]["dst"] == "failed"


async def test_close_error_during_a_failure_is_chained_as_the_cause(
    run_rollout: Any, fake_vllm: FakeVLLMServer
) -> None:
    fake_vllm.script([ScriptedTurn(text="a")])
    envs = ScriptedEnvFactory(raise_in={"step": RuntimeError("step broke"), "close": OSError("close broke")})
    caught, _ = await run_failing(run_rollout, RuntimeError, envs=envs)
    assert str(caught) == "step broke"
    assert isinstance(caught.__cause__, OSError)
    assert envs.last.close_count == 1


@pytest.mark.parametrize(
    ("step_result", "error"),
    [(("obs", False), EnvironmentContractError), (["obs", False, {}], EnvironmentContractError)],
)
async def test_step_must_return_a_three_tuple(
    run_rollout: Any, fake_vllm: FakeVLLMServer, step_result: Any, error: type[Exception]
) -> None:
    fake_vllm.script([ScriptedTurn(text="a")])
    await run_failing(run_rollout, error, envs=ScriptedEnvFactory(step_result=step_result))


@pytest.mark.parametrize(
    ("observation", "error", "builtin"),
    [
        # image observations are taken now; one naming a file that does not exist is refused, naming it
        ({"role": "user", "content": [{"type": "image", "image": "x.png"}]}, ImageInputError, ValueError),
        ({"role": "user", "content": [{"type": "video", "video": "x.mp4"}]}, ObservationError, ValueError),
        ({"role": "user", "content": 42}, ObservationError, TypeError),
        ({"content": "no role"}, ObservationError, ValueError),
    ],
)
async def test_malformed_observations_are_rejected(
    run_rollout: Any, fake_vllm: FakeVLLMServer, observation: Any, error: type[Exception], builtin: type[Exception]
) -> None:
    fake_vllm.script([ScriptedTurn(text="a")])
    envs = ScriptedEnvFactory(steps=[(observation, False)])
    caught, events = await run_failing(run_rollout, error, envs=envs)
    assert isinstance(caught, builtin)
    assert envs.last.close_count == 1
    assert events[-1]["dst"] == "failed"


async def test_routing_replay_requires_routed_experts(run_rollout: Any, fake_vllm: FakeVLLMServer) -> None:
    fake_vllm.script([ScriptedTurn(text="a")])
    caught, _ = await run_failing(
        run_rollout, RoutingReplayError, use_rollout_routing_replay=True, num_layers=2, moe_router_topk=2
    )
    assert isinstance(caught, RuntimeError)


async def test_routing_replay_rows_cover_prompt_plus_output_minus_one(
    run_rollout: Any, fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    import base64
    import io

    import numpy as np

    ids = tokenizer.encode("a b", add_special_tokens=False)
    render_probe = await run_rollout(sampling={"max_new_tokens": 0, "temperature": 1.0, "top_p": 1.0})
    prompt_length = len(render_probe.sample.tokens)
    rows = prompt_length + len(ids) - 1
    buffer = io.BytesIO()
    np.save(buffer, np.arange(rows * 2 * 2, dtype=np.uint8).reshape(rows, 2, 2) % 4, allow_pickle=False)
    experts = base64.b64encode(buffer.getvalue()).decode()
    fake_vllm.script([ScriptedTurn(token_ids=ids, choice_extra={"routed_experts": experts})])
    result = await run_rollout(max_turns=1, use_rollout_routing_replay=True, num_layers=2, moe_router_topk=2)
    assert result.sample.rollout_routed_experts.shape == (len(result.sample.tokens) - 1, 2, 2)


async def test_server_abort_without_routed_experts_under_replay_is_not_an_error(
    run_rollout: Any, fake_vllm: FakeVLLMServer
) -> None:
    fake_vllm.script([ScriptedTurn(text="a", finish="abort")])
    result = await run_rollout(use_rollout_routing_replay=True, num_layers=2, moe_router_topk=2)
    assert result.sample.status == Status.ABORTED


async def test_routing_replay_with_stop_strings_is_rejected_before_any_request(
    make_rollout: Any, fake_vllm: FakeVLLMServer
) -> None:
    with pytest.raises(ConfigError, match="Routing replay"):
        make_rollout(
            sampling={"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0, "stop": ["</a>"]},
            use_rollout_routing_replay=True,
            num_layers=2,
            moe_router_topk=2,
        )
    assert fake_vllm.requests == []


@pytest.mark.parametrize(
    "sample",
    [
        Sample(prompt="q", status=Status.COMPLETED),
        Sample(prompt="q", response="old"),
        Sample(prompt="q", response_length=3),
        Sample(prompt="q", loss_mask=[1]),
        Sample(prompt="q", rollout_log_probs=[0.0]),
    ],
)
async def test_samples_that_cannot_start_are_rejected_untouched(make_rollout: Any, sample: Sample) -> None:
    before = sample.to_dict()
    with pytest.raises(SampleStateError):
        make_rollout(sample)
    assert sample.to_dict() == before


@pytest.mark.parametrize(
    ("sampling", "error"),
    [
        ({"temperature": 1.0, "top_p": 1.0}, SamplingParamsError),
        ({"max_new_tokens": -1, "temperature": 1.0, "top_p": 1.0}, ConfigError),
        ({"max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0, "stop": [1]}, ConfigError),
    ],
)
async def test_bad_sampling_params_are_rejected_before_any_request(
    make_rollout: Any, fake_vllm: FakeVLLMServer, sampling: dict[str, Any], error: type[Exception]
) -> None:
    with pytest.raises(error):
        make_rollout(sampling=sampling)
    assert fake_vllm.requests == []
