"""RolloutConfig validation, slime/vime namespaces, and the sampling-parameter mapping."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from fsm_rollout.config import RolloutConfig, build_inference_sampling_params, response_budget
from fsm_rollout.errors import ConfigError, SamplingParamsError


def config(**overrides: Any) -> RolloutConfig:
    values: dict[str, Any] = {"engine_url": "http://127.0.0.1:8000", "model": "m", "max_turns": 3}
    values.update(overrides)
    return RolloutConfig(**values)


@pytest.mark.parametrize("max_turns", [0, -1, True, 2.0, "3", None])
def test_max_turns_must_be_a_positive_int_and_not_a_bool(max_turns: Any) -> None:
    with pytest.raises(ConfigError, match="max_turns"):
        config(max_turns=max_turns)


def test_partial_rollout_is_accepted_and_the_weight_update_strategy_is_checked() -> None:
    assert config(partial_rollout=True).partial_rollout is True
    assert config(weight_update_strategy="keep").weight_update_strategy == "keep"
    with pytest.raises(ConfigError, match="weight_update_strategy"):
        config(weight_update_strategy="pause")


@pytest.mark.parametrize("limit", [-1, 1.5, True])
def test_context_limit_must_be_a_non_negative_int(limit: Any) -> None:
    with pytest.raises(ConfigError, match="rollout_max_context_len"):
        config(rollout_max_context_len=limit)


@pytest.mark.parametrize("name", ["observation_image_max_bytes", "observation_image_max_pixels"])
@pytest.mark.parametrize("limit", [0, -5, 2.5, True, None])
def test_observation_image_limits_must_be_positive_ints(name: str, limit: Any) -> None:
    with pytest.raises(ConfigError, match=name):
        config(**{name: limit})


@pytest.mark.parametrize("missing", ["num_layers", "moe_router_topk"])
def test_routing_replay_needs_layer_and_topk_counts(missing: str) -> None:
    values = {"use_rollout_routing_replay": True, "num_layers": 2, "moe_router_topk": 2, missing: None}
    with pytest.raises(ConfigError, match=missing):
        config(**values)


def test_routing_replay_with_stop_strings_and_eos_append_is_a_start_up_error() -> None:
    replay = config(use_rollout_routing_replay=True, num_layers=2, moe_router_topk=2)
    with pytest.raises(ConfigError, match="Routing replay"):
        replay.check_sampling({"stop": ["</a>"]})
    replay.check_sampling({"stop": None})
    config(
        use_rollout_routing_replay=True,
        num_layers=2,
        moe_router_topk=2,
        append_eos_token_after_stop_str_in_multi_turn=False,
    ).check_sampling({"stop": ["</a>"]})


@pytest.mark.parametrize("key", ["tokenize", "add_generation_prompt", "tools"])
def test_template_kwargs_must_not_override_what_the_rollout_sets(key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        config(apply_chat_template_kwargs={key: True})


def test_engine_url_must_be_http() -> None:
    with pytest.raises(ConfigError, match="engine_url"):
        config(engine_url="127.0.0.1:8000")


def slime_args(**overrides: Any) -> SimpleNamespace:
    values: dict[str, Any] = {
        "partial_rollout": False,
        "max_turns": 3,
        "rollout_interaction_env_path": "my.env",
        "vllm_router_ip": "10.0.0.5",
        "vllm_router_port": 30000,
        "hf_checkpoint": "/ckpt/qwen",
        "rollout_max_context_len": 4096,
    }
    values.update(overrides)
    return SimpleNamespace(**values)


def test_from_args_reads_the_seeds_attributes() -> None:
    built = RolloutConfig.from_args(
        slime_args(router_policy="consistent_hash", apply_chat_template_kwargs={"enable_thinking": False})
    )
    assert built.engine_url == "http://10.0.0.5:30000"
    assert built.model == "/ckpt/qwen"
    assert built.env_path == "my.env"
    assert built.rollout_max_context_len == 4096
    assert built.router_policy == "consistent_hash"
    assert built.apply_chat_template_kwargs == {"enable_thinking": False}
    assert built.append_eos_token_after_stop_str_in_multi_turn is True


def test_from_args_defaults_the_environment_module_to_the_shipped_geo3k() -> None:
    # the seed's default module (examples.geo3k_vlm_multi_turn.env_geo3k) is not shipped: the port of it is
    env_path = RolloutConfig.from_args(slime_args(rollout_interaction_env_path=None)).env_path
    assert env_path == "fsm_rollout.envs.geo3k"
    from fsm_rollout.envs.protocol import load_env_factory

    assert callable(load_env_factory(env_path))


def test_from_args_names_missing_attributes() -> None:
    args = slime_args()
    del args.hf_checkpoint
    with pytest.raises(ConfigError, match="hf_checkpoint"):
        RolloutConfig.from_args(args)


def test_from_args_rejects_score_centering() -> None:
    with pytest.raises(ConfigError, match="score_centering"):
        RolloutConfig.from_args(slime_args(use_score_centering=True))


def test_sampling_params_map_every_field() -> None:
    params = build_inference_sampling_params(
        {
            "max_new_tokens": 32,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": -1,
            "stop": ["</a>"],
            "no_stop_trim": True,
            "stop_token_ids": [7],
            "seed": 3,
            "min_new_tokens": 2,
            "repetition_penalty": 1.1,
            "skip_special_tokens": 0,
            "spaces_between_special_tokens": False,
        }
    )
    assert params == {
        "max_tokens": 32,
        "temperature": 0.7,
        "top_p": 0.9,
        "logprobs": 1,
        "top_k": -1,
        "stop": ["</a>"],
        "include_stop_str_in_output": True,
        "stop_token_ids": [7],
        "seed": 3,
        "min_tokens": 2,
        "repetition_penalty": 1.1,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
    }


def test_sampling_params_drop_top_k_zero_and_unset_optionals() -> None:
    params = build_inference_sampling_params({"max_new_tokens": None, "temperature": 1, "top_p": 1, "top_k": 0})
    assert params == {"max_tokens": None, "temperature": 1, "top_p": 1, "logprobs": 1}


@pytest.mark.parametrize("missing", ["max_new_tokens", "temperature"])
def test_sampling_params_require_the_two_keys(missing: str) -> None:
    values = {"max_new_tokens": 1, "temperature": 1, "top_p": 1}
    del values[missing]
    with pytest.raises(SamplingParamsError, match=missing) as caught:
        build_inference_sampling_params(values)
    assert isinstance(caught.value, KeyError)


def test_top_p_defaults_to_vllms_1() -> None:
    assert build_inference_sampling_params({"max_new_tokens": 1, "temperature": 0})["top_p"] == 1.0


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_p", float("nan")),
        ("top_p", True),
        ("temperature", -1),
        ("temperature", None),
    ],
)
def test_out_of_range_sampling_values_are_refused(key: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=key):
        build_inference_sampling_params({"max_new_tokens": 1, "temperature": 1, "top_p": 1, key: value})


@pytest.mark.parametrize(
    ("max_new", "context", "prompt", "budget"),
    [(None, None, 10, None), (8, None, 10, 8), (None, 15, 10, 5), (8, 15, 10, 5), (3, 15, 10, 3), (8, 5, 10, 0)],
)
def test_response_budget_is_the_tighter_of_both_limits(
    max_new: int | None, context: int | None, prompt: int, budget: int | None
) -> None:
    assert response_budget(max_new, context, prompt) == budget


def test_retry_delays_grow_and_stay_bounded() -> None:
    from fsm_rollout.config import RetryPolicy

    policy = RetryPolicy(base_delay_s=0.1, max_delay_s=0.3)
    assert all(0 <= policy.delay(1) <= 0.1 for _ in range(50))
    assert all(0 <= policy.delay(10) <= 0.3 for _ in range(50))
    with pytest.raises(ConfigError):
        RetryPolicy(max_attempts=0)


# ---------------------------------------------------------------------------------------------------- to_dict


def every_field_set() -> RolloutConfig:
    """A config whose every field differs from its default (so a field the round trip drops shows)."""
    from pathlib import Path

    from fsm_rollout.config import RetryPolicy

    return config(
        tokenizer_path="/tok",
        rollout_max_context_len=99,
        partial_rollout=True,
        router_policy="consistent_hash",
        apply_chat_template_kwargs={"enable_thinking": False},
        use_rollout_routing_replay=True,
        num_layers=2,
        moe_router_topk=3,
        append_eos_token_after_stop_str_in_multi_turn=False,
        track_speculative_stats=True,
        env_path="my.env",
        connect_timeout_s=3.0,
        request_timeout_s=30.0,
        abort_notice_timeout_s=2.0,
        retry=RetryPolicy(max_attempts=7, base_delay_s=0.5, max_delay_s=9.0, retry_statuses=frozenset({503})),
        trace=Path("/tmp/t.jsonl"),
        record=True,
        check_invariants=True,
        image_placeholder_token="<img>",
        image_merge_size=2,
        observation_image_max_bytes=1000,
        observation_image_max_pixels=500,
        loop_slice_ms=4.0,
        tune_gc=True,
        api_key="secret",
        weight_update_strategy="keep",
        env_executor="thread",
        env_max_workers=3,
        env_step_timeout_s=5.0,
        rollout_timeout_s=50.0,
        servers_behind_router=("http://a:1", "http://b:2"),
        trust_remote_code=True,
        history_policy="per_turn",
        admission="adaptive",
        admission_kv_target=0.75,
        admission_max_waiting=3,
        max_staleness=2,
    )


@pytest.mark.parametrize("policy", ["append", "fork", "per_turn", "auto"])
def test_history_policy_takes_each_policy_and_defaults_to_auto(policy: str) -> None:
    config = RolloutConfig(engine_url="http://h:1", model="m", max_turns=1, history_policy=policy)
    assert RolloutConfig.from_dict(config.to_dict()).history_policy == policy
    assert RolloutConfig(engine_url="http://h:1", model="m", max_turns=1).history_policy == "auto"


@pytest.mark.parametrize("policy", ["Fork", "branch", "", None, 1])
def test_an_unknown_history_policy_is_refused_naming_the_policies(policy: Any) -> None:
    with pytest.raises(ConfigError, match=r"history_policy must be one of 'append', 'fork', 'per_turn', 'auto'"):
        RolloutConfig(engine_url="http://h:1", model="m", max_turns=1, history_policy=policy)


def test_every_field_but_the_reward_function_round_trips_through_to_dict() -> None:
    import dataclasses

    import orjson

    original = every_field_set()
    defaults = config()
    unset = [item.name for item in dataclasses.fields(RolloutConfig)
             if item.name not in ("engine_url", "model", "max_turns", "reward_fn")
             and getattr(original, item.name) == getattr(defaults, item.name)]  # fmt: skip
    assert unset == []  # a new field must be set in every_field_set() too
    data = original.to_dict(include_api_key=True)
    assert orjson.loads(orjson.dumps(data)) == data  # plain JSON
    back = RolloutConfig.from_dict(orjson.loads(orjson.dumps(data)))
    assert back == dataclasses.replace(original, trace="/tmp/t.jsonl")  # a path comes back as its text


def test_to_dict_leaves_out_the_api_key_unless_asked_and_never_holds_the_reward_function() -> None:
    original = dataclasses_replace_reward(every_field_set())
    assert "api_key" not in original.to_dict()
    assert "secret" not in str(original.to_dict())
    assert original.to_dict(include_api_key=True)["api_key"] == "secret"
    assert "reward_fn" not in original.to_dict(include_api_key=True)


def dataclasses_replace_reward(value: RolloutConfig) -> RolloutConfig:
    import dataclasses

    return dataclasses.replace(value, reward_fn=lambda sample: 1.0)


def test_from_dict_refuses_a_key_that_is_no_field_and_names_it() -> None:
    data = config().to_dict()
    with pytest.raises(ConfigError, match=r"no field\(s\) 'max_turn'.*max_turns"):
        RolloutConfig.from_dict({**data, "max_turn": 3})
    with pytest.raises(ConfigError, match="mapping"):
        RolloutConfig.from_dict([("model", "m")])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="retry"):
        RolloutConfig.from_dict({**data, "retry": {"attempts": 2}})


def test_from_dict_reads_former_field_names_and_can_leave_unknown_keys_out() -> None:
    data = {**config().to_dict(), "defer_full_gc": True}
    del data["tune_gc"]
    assert RolloutConfig.from_dict(data).tune_gc is True
    future = {**data, "from_the_future": 1}
    assert RolloutConfig.unknown_keys(future) == ["from_the_future"]
    assert RolloutConfig.from_dict(future, ignore_unknown=True).tune_gc is True


def test_the_ray_worker_the_tape_and_replay_read_and_write_the_config_through_to_dict() -> None:
    from fsm_rollout.distributed.worker import config_from_data, config_to_data
    from fsm_rollout.recording.format import config_to_json
    from fsm_rollout.replay.reexecute import config_from

    original = every_field_set()
    assert config_to_data(original) == original.to_dict(include_api_key=True)
    assert config_from_data(config_to_data(original)) == RolloutConfig.from_dict(config_to_data(original))
    assert config_to_json(original) == original.to_dict()
    replayed, unknown = config_from(config_to_json(original))
    assert unknown == []
    assert replayed.retry == original.retry and replayed.trust_remote_code is True
    with pytest.raises(ConfigError, match="no field"):
        config_from_data({**config_to_data(original), "surprise": 1})


def test_trust_remote_code_is_off_by_default_and_must_be_a_bool() -> None:
    assert config().trust_remote_code is False
    with pytest.raises(ConfigError, match="trust_remote_code"):
        config(trust_remote_code="yes")


def test_admission_defaults_to_fixed_and_checks_its_targets() -> None:
    config = RolloutConfig(engine_url="http://x", model="m", max_turns=1)
    assert (config.admission, config.admission_kv_target) == ("fixed", 0.9)
    with pytest.raises(ConfigError, match="admission must be 'fixed' or 'adaptive'"):
        RolloutConfig(engine_url="http://x", model="m", max_turns=1, admission="auto")
    for target in (0, 1.5, True, float("nan")):
        with pytest.raises(ConfigError, match="admission_kv_target"):
            RolloutConfig(engine_url="http://x", model="m", max_turns=1, admission_kv_target=target)
    with pytest.raises(ConfigError, match="admission_max_waiting"):
        RolloutConfig(engine_url="http://x", model="m", max_turns=1, admission_max_waiting=-1)
