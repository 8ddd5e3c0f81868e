"""The lifecycle end to end against the fake vLLM server over real HTTP, with the real Qwen tokenizer."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fsm_rollout import Sample, Status
from fsm_rollout.machine import lifecycle
from fsm_rollout.testing.envs import ScriptedEnvFactory
from fsm_rollout.testing.fake_vllm import ABORT_PATH, GENERATE_PATH, RENDER_PATH, FakeVLLMServer, ScriptedTurn

EOS = "<|im_end|>"


def paths(server: FakeVLLMServer) -> list[str]:
    return [request.path for request in server.requests]


def generate_bodies(server: FakeVLLMServer) -> list[dict[str, Any]]:
    return [request.body for request in server.requests_to(GENERATE_PATH)]


def assert_path_is_legal(events: list[dict[str, Any]]) -> None:
    """Every traced transition is an edge of the table, consecutive, and the last one ends in a terminal state."""
    edges = {(edge.source, edge.trigger, edge.dest) for edge in lifecycle.TRANSITIONS}
    state = lifecycle.INITIAL
    for event in events:
        assert event["src"] == state
        assert (event["src"], event["trigger"], event["dst"]) in edges
        state = event["dst"]
    assert state in lifecycle.TERMINAL


async def test_two_turn_rollout_sends_render_then_one_generate_per_turn(
    run_rollout: Any, fake_vllm: FakeVLLMServer
) -> None:
    fake_vllm.script([ScriptedTurn(text="Let me think."), ScriptedTurn(text="The answer is 42.")])
    result = await run_rollout(max_turns=2)
    assert paths(fake_vllm) == [RENDER_PATH, GENERATE_PATH, GENERATE_PATH]
    assert_path_is_legal(result.events)


async def test_second_request_extends_first_request_and_response_without_retokenizing(
    run_rollout: Any, fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    fake_vllm.script([ScriptedTurn(text="Let me think."), ScriptedTurn(text="The answer is 42.")])
    result = await run_rollout(max_turns=2)
    first, second = generate_bodies(fake_vllm)
    first_response = tokenizer.encode("Let me think.", add_special_tokens=False)
    assert first["token_ids"]
    prefix = first["token_ids"] + first_response
    assert second["token_ids"][: len(prefix)] == prefix
    suffix = second["token_ids"][len(prefix) :]
    assert tokenizer.decode(suffix) == f"{EOS}\n<|im_start|>user\nContinue the reasoning.{EOS}\n<|im_start|>assistant\n"
    second_response = tokenizer.encode("The answer is 42.", add_special_tokens=False)
    assert result.sample.tokens == second["token_ids"] + second_response


async def test_response_side_arrays_line_up_and_mask_only_model_tokens(
    run_rollout: Any, fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    fake_vllm.script([ScriptedTurn(text="Let me think."), ScriptedTurn(text="Done.")])
    result = await run_rollout(max_turns=2)
    sample = result.sample
    prompt_length = len(generate_bodies(fake_vllm)[0]["token_ids"])
    assert sample.response_length == len(sample.loss_mask) == len(sample.rollout_log_probs)
    assert sample.response_length == len(sample.tokens) - prompt_length
    first = len(tokenizer.encode("Let me think.", add_special_tokens=False))
    second = len(tokenizer.encode("Done.", add_special_tokens=False))
    observation = sample.response_length - first - second
    assert sample.loss_mask == [1] * first + [0] * observation + [1] * second
    assert sample.rollout_log_probs[first : first + observation] == [0.0] * observation
    assert sample.rollout_log_probs[:first] == pytest.approx([-0.01 * (i + 1) for i in range(first)])


async def test_response_text_holds_model_tokens_only(run_rollout: Any, fake_vllm: FakeVLLMServer) -> None:
    fake_vllm.script([ScriptedTurn(text="Let me think."), ScriptedTurn(text=f"Done.{EOS}")])
    result = await run_rollout(max_turns=2)
    assert result.sample.response == f"Let me think.Done.{EOS}"


async def test_env_done_completes_the_sample(run_rollout: Any, fake_vllm: FakeVLLMServer) -> None:
    fake_vllm.script([ScriptedTurn(text=f"42{EOS}")])
    result = await run_rollout(envs=ScriptedEnvFactory(steps=[("correct", True)]))
    assert result.sample.status == Status.COMPLETED
    assert result.rollout.reason == "env_done"
    assert result.sample.metadata["rollout_reason"] == "env_done"
    assert result.events[-1]["reason"] == "env_done"
    assert result.envs.last.calls == ["reset", "step", "close"]
    assert paths(fake_vllm) == [RENDER_PATH, GENERATE_PATH]


async def test_zero_budget_truncates_before_any_generate(run_rollout: Any, fake_vllm: FakeVLLMServer) -> None:
    result = await run_rollout(sampling={"max_new_tokens": 0, "temperature": 1.0, "top_p": 1.0})
    assert result.sample.status == Status.TRUNCATED
    assert result.rollout.reason == "budget_exhausted"
    assert paths(fake_vllm) == [RENDER_PATH]
    assert result.path == [("pending", "render", "rendered"), ("rendered", "generate", "truncated")]


async def test_context_limit_below_prompt_truncates_before_any_generate(
    run_rollout: Any, fake_vllm: FakeVLLMServer
) -> None:
    result = await run_rollout(rollout_max_context_len=5)
    assert result.rollout.reason == "budget_exhausted"
    assert paths(fake_vllm) == [RENDER_PATH]


async def test_length_finish_truncates_without_stepping_the_environment(
    run_rollout: Any, fake_vllm: FakeVLLMServer
) -> None:
    fake_vllm.script([ScriptedTurn(text="one two three four five six seven eight nine ten")])
    result = await run_rollout(sampling={"max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0})
    assert result.sample.status == Status.TRUNCATED
    assert result.rollout.reason == "length"
    assert result.sample.response_length == 4
    assert result.envs.last.calls == ["reset", "close"]
    assert generate_bodies(fake_vllm)[0]["sampling_params"]["max_tokens"] == 4


async def test_turn_limit_truncates_without_appending_an_observation(
    run_rollout: Any, fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    fake_vllm.script([ScriptedTurn(text="a"), ScriptedTurn(text="b")])
    result = await run_rollout(max_turns=2)
    assert result.sample.status == Status.TRUNCATED
    assert result.rollout.reason == "max_turns"
    last_request = generate_bodies(fake_vllm)[-1]["token_ids"]
    assert result.sample.tokens == last_request + tokenizer.encode("b", add_special_tokens=False)
    assert result.envs.last.calls == ["reset", "step", "format_observation", "step", "close"]


async def test_stop_string_appends_a_masked_eos(run_rollout: Any, fake_vllm: FakeVLLMServer, tokenizer: Any) -> None:
    fake_vllm.script([ScriptedTurn(text="x = 1 </answer> trailing"), ScriptedTurn(text="ok")])
    sampling = {"max_new_tokens": 64, "temperature": 1.0, "top_p": 1.0, "stop": ["</answer>"], "no_stop_trim": True}
    result = await run_rollout(sampling=sampling, max_turns=2)
    first, second = generate_bodies(fake_vllm)
    generated = tokenizer.encode("x = 1 </answer>", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    start = len(first["token_ids"])
    assert second["token_ids"][start : start + len(generated) + 1] == [*generated, eos]
    assert result.sample.loss_mask[len(generated)] == 0
    # the boundary after an EOS does not repeat it
    assert second["token_ids"][start + len(generated) + 1] != eos
    assert first["sampling_params"]["stop"] == ["</answer>"]
    assert result.events[2]["eos_inserted"] is True


async def test_stop_token_id_stop_gets_no_extra_eos_but_the_boundary_closes_the_turn(
    run_rollout: Any, fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    stop_id = tokenizer.encode("!", add_special_tokens=False)[0]
    fake_vllm.script([ScriptedTurn(text="Hi! more"), ScriptedTurn(text="ok")])
    sampling = {"max_new_tokens": 64, "temperature": 1.0, "top_p": 1.0, "stop_token_ids": [stop_id]}
    result = await run_rollout(sampling=sampling, max_turns=2)
    first, second = generate_bodies(fake_vllm)
    start = len(first["token_ids"])
    generated = tokenizer.encode("Hi!", add_special_tokens=False)
    assert second["token_ids"][start : start + len(generated) + 1] == [*generated, tokenizer.eos_token_id]
    assert result.events[2]["eos_inserted"] is False


async def test_no_budget_for_stop_eos_truncates(run_rollout: Any, fake_vllm: FakeVLLMServer, tokenizer: Any) -> None:
    text = "x </answer>"
    n = len(tokenizer.encode(text, add_special_tokens=False))
    fake_vllm.script([ScriptedTurn(text=text)])
    sampling = {"max_new_tokens": n, "temperature": 1.0, "top_p": 1.0, "stop": "</answer>"}
    result = await run_rollout(sampling=sampling)
    assert result.sample.status == Status.TRUNCATED
    assert result.rollout.reason == "insufficient_budget_for_stop_eos"
    assert result.sample.metadata["multiturn_truncation"] == {
        "reason": "insufficient_budget_for_stop_eos",
        "remaining_budget": 0,
    }
    assert result.sample.response_length == n
    assert result.envs.last.calls == ["reset", "close"]


async def test_observation_that_does_not_fit_truncates_and_is_not_appended(
    run_rollout: Any, fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    text = f"thinking{EOS}"
    n = len(tokenizer.encode(text, add_special_tokens=False))
    fake_vllm.script([ScriptedTurn(text=text)])
    result = await run_rollout(sampling={"max_new_tokens": n + 3, "temperature": 1.0, "top_p": 1.0})
    assert result.rollout.reason == "insufficient_budget_for_next_turn"
    truncation = result.sample.metadata["multiturn_truncation"]
    assert truncation["reason"] == "insufficient_budget_for_next_turn"
    assert truncation["remaining_budget"] == 3
    assert truncation["observation_tokens"] > 3
    assert result.sample.response_length == n


async def test_observation_needs_one_token_left_for_the_next_turn(
    run_rollout: Any, fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    text = f"thinking{EOS}"
    n = len(tokenizer.encode(text, add_special_tokens=False))
    fake_vllm.script([ScriptedTurn(text=text)])
    probe = await run_rollout(sampling={"max_new_tokens": n + 3, "temperature": 1.0, "top_p": 1.0})
    observation = probe.sample.metadata["multiturn_truncation"]["observation_tokens"]
    fake_vllm.script([ScriptedTurn(text=text)])
    exact = await run_rollout(sampling={"max_new_tokens": n + observation, "temperature": 1.0, "top_p": 1.0})
    assert exact.rollout.reason == "insufficient_budget_for_next_turn"
    fake_vllm.script([ScriptedTurn(text=text), ScriptedTurn(text="z")])
    fits = await run_rollout(sampling={"max_new_tokens": n + observation + 1, "temperature": 1.0, "top_p": 1.0})
    assert fits.sample.response_length == n + observation + 1
    assert generate_bodies(fake_vllm)[-1]["sampling_params"]["max_tokens"] == 1


async def test_server_abort_drops_that_turn_and_keeps_earlier_turns(
    run_rollout: Any, fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    fake_vllm.script([ScriptedTurn(text="first"), ScriptedTurn(text="partial output", finish="abort")])
    result = await run_rollout()
    assert result.sample.status == Status.ABORTED
    assert result.rollout.reason == "server_abort"
    second_request = generate_bodies(fake_vllm)[1]["token_ids"]
    assert result.sample.tokens == second_request
    assert result.sample.response == "first"
    assert result.envs.last.close_count == 1


async def test_each_turn_requests_at_most_the_remaining_budget(run_rollout: Any, fake_vllm: FakeVLLMServer) -> None:
    fake_vllm.script([ScriptedTurn(text="a b c"), ScriptedTurn(text="d")])
    result = await run_rollout(sampling={"max_new_tokens": 60, "temperature": 1.0, "top_p": 1.0}, max_turns=2)
    first, second = generate_bodies(fake_vllm)
    assert first["sampling_params"]["max_tokens"] == 60
    used_before_second = len(second["token_ids"]) - len(first["token_ids"])
    assert second["sampling_params"]["max_tokens"] == 60 - used_before_second
    assert result.sample.response_length <= 60


async def test_max_tokens_is_sent_even_when_it_equals_vllms_default(
    run_rollout: Any, fake_vllm: FakeVLLMServer
) -> None:
    fake_vllm.script([ScriptedTurn(text="a")])
    await run_rollout(sampling={"max_new_tokens": 16, "temperature": 1.0, "top_p": 1.0}, max_turns=1)
    assert generate_bodies(fake_vllm)[0]["sampling_params"]["max_tokens"] == 16


async def test_generate_requests_carry_library_chosen_ids_per_turn(run_rollout: Any, fake_vllm: FakeVLLMServer) -> None:
    fake_vllm.script([ScriptedTurn(text="a"), ScriptedTurn(text="b")])
    await run_rollout(Sample(prompt="q", index=0, session_id="sess-1"), max_turns=2)
    assert [body["request_id"] for body in generate_bodies(fake_vllm)] == ["sess-1-turn0", "sess-1-turn1"]


async def test_consistent_hash_sends_the_session_header_on_every_request(
    run_rollout: Any, fake_vllm: FakeVLLMServer
) -> None:
    fake_vllm.script([ScriptedTurn(text="a"), ScriptedTurn(text="b")], session=None)
    result = await run_rollout(router_policy="consistent_hash", max_turns=2)
    session_id = result.sample.session_id
    assert session_id
    assert all(request.headers.get("x-session-id") == session_id for request in fake_vllm.requests)
    assert all(event["session_id"] == session_id for event in result.events)


async def test_no_session_header_without_consistent_hash(run_rollout: Any, fake_vllm: FakeVLLMServer) -> None:
    fake_vllm.script([ScriptedTurn(text="a")])
    result = await run_rollout(max_turns=1)
    assert result.sample.session_id is None
    assert all("x-session-id" not in request.headers for request in fake_vllm.requests)


async def test_turn_meta_is_applied_per_turn(run_rollout: Any, fake_vllm: FakeVLLMServer, tokenizer: Any) -> None:
    ids = tokenizer.encode("A", add_special_tokens=False)
    fake_vllm.script(
        [
            ScriptedTurn(
                token_ids=ids,
                choice_extra={"sampling_mask": [[ids[0], ids[0] + 1]]},
                top_extra={"weight_version": "7"},
            )
        ]
    )
    result = await run_rollout(max_turns=1)
    assert result.sample.rollout_top_p_token_ids == [ids[0], ids[0] + 1]
    assert result.sample.rollout_top_p_token_offsets == [0, 2]
    assert result.sample.weight_versions == ["7"]


async def test_prompt_tools_and_template_kwargs_reach_render(run_rollout: Any, fake_vllm: FakeVLLMServer) -> None:
    tools = [{"type": "function", "function": {"name": "calc_score", "parameters": {}}}]
    fake_vllm.script([ScriptedTurn(text="a")])
    await run_rollout(
        Sample(prompt="<image>  Solve it", index=0, metadata={"tools": tools}),
        apply_chat_template_kwargs={"enable_thinking": False},
        max_turns=1,
    )
    render = fake_vllm.requests_to(RENDER_PATH)[0].body
    assert render["model"] == "fake-model"
    assert render["tools"] == tools
    assert render["chat_template_kwargs"] == {"enable_thinking": False}
    assert render["messages"] == [{"role": "user", "content": [{"type": "text", "text": "Solve it"}]}]


async def test_message_list_prompt_is_sent_as_is(run_rollout: Any, fake_vllm: FakeVLLMServer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    fake_vllm.script([ScriptedTurn(text="4")])
    result = await run_rollout(Sample(prompt=messages, index=0), max_turns=1)
    assert fake_vllm.requests_to(RENDER_PATH)[0].body["messages"] == messages
    assert result.sample.prompt == messages


async def test_prefilled_tokens_must_equal_the_render(run_rollout: Any, fake_vllm: FakeVLLMServer) -> None:
    with pytest.raises(ValueError, match=r"Initial render token_ids differ from sample\.tokens"):
        await run_rollout(Sample(prompt="q", tokens=[1, 2, 3], index=0))
    assert paths(fake_vllm) == [RENDER_PATH]


async def test_every_transition_is_traced_with_the_schema(run_rollout: Any, fake_vllm: FakeVLLMServer) -> None:
    fake_vllm.script([ScriptedTurn(text="a"), ScriptedTurn(text="b")])
    result = await run_rollout(Sample(prompt="q", index=7), max_turns=2)
    assert [event["trigger"] for event in result.events] == [
        "render",
        "generate",
        "step",
        "observe",
        "generate",
        "step",
        "observe",
    ]
    for event in result.events:
        assert event["sample_id"] == "7"
        assert {"trigger", "src", "dst", "turn", "response_length", "remaining_budget", "dwell_ms"} <= set(event)
        assert event["dwell_ms"] >= 0
    assert result.events[0]["prompt_tokens"] > 0
    assert result.events[2]["generated_tokens"] == 1
    assert result.events[2]["finish"] == "stop"
    assert result.events[4]["observation_tokens"] > 0
    assert [event["turn"] for event in result.events] == [0, 0, 0, 0, 1, 1, 1]
    assert "reason" not in result.events[0]
    assert result.events[-1]["reason"] == "max_turns"


# --------------------------------------------------------------------------- aborts


async def wait_for_generate(server: FakeVLLMServer, count: int = 1) -> None:
    for _ in range(12000):  # up to 120 s: a loaded machine can be slow to get there
        if len(server.requests_to(GENERATE_PATH)) >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("generate request never arrived")


async def test_caller_abort_cancels_the_request_in_flight_and_names_it(
    make_rollout: Any, fake_vllm: FakeVLLMServer
) -> None:
    fake_vllm.script([ScriptedTurn(text="a"), ScriptedTurn(text="never", hang=True)])
    rollout, envs = make_rollout(Sample(prompt="q", index=0, session_id="s"))
    task = asyncio.create_task(rollout.run())
    await wait_for_generate(fake_vllm, 2)
    await rollout.abort("weight_update")
    count = len(fake_vllm.requests)
    assert rollout.state == "aborted"
    assert rollout.sample.status == Status.ABORTED
    assert rollout.sample.metadata["rollout_reason"] == "weight_update"
    assert fake_vllm.aborted_request_ids == ["s-turn1", "generate-tokens-s-turn1"]
    assert paths(fake_vllm)[-1] == ABORT_PATH
    assert await task is rollout.sample
    await asyncio.sleep(0.1)
    assert len(fake_vllm.requests) == count
    assert envs.last.close_count == 1
    assert rollout.sample.response == "a"


async def test_cancelling_the_task_aborts_with_reason_cancelled(make_rollout: Any, fake_vllm: FakeVLLMServer) -> None:
    fake_vllm.script([ScriptedTurn(text="never", hang=True)])
    rollout, envs = make_rollout(Sample(prompt="q", index=0, session_id="s"))
    task = asyncio.create_task(rollout.run())
    await wait_for_generate(fake_vllm)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert rollout.state == "aborted"
    assert rollout.reason == "cancelled"
    assert fake_vllm.aborted_request_ids == ["s-turn0", "generate-tokens-s-turn0"]
    assert envs.last.close_count == 1


async def test_abort_before_start_sends_nothing(make_rollout: Any, fake_vllm: FakeVLLMServer) -> None:
    from fsm_rollout import capture_transitions

    rollout, envs = make_rollout(Sample(prompt="q", index=3, session_id="s3"))
    with capture_transitions() as events:
        await rollout.abort("shutdown")
    assert [(e["sample_id"], e["session_id"], e["trigger"]) for e in events] == [("3", "s3", "abort")]
    assert rollout.state == "aborted"
    assert rollout.reason == "shutdown"
    assert await rollout.run() is rollout.sample
    assert fake_vllm.requests == []
    assert envs.built == []


@pytest.mark.synthetic_paths
@pytest.mark.parametrize("state", lifecycle.NON_TERMINAL)
async def test_abort_is_accepted_from_every_non_terminal_state(
    make_rollout: Any, fake_vllm: FakeVLLMServer, state: str
) -> None:
    rollout, _ = make_rollout()
    rollout.state = state
    await rollout.abort("weight_update")
    assert rollout.state == "aborted"
    assert rollout.sample.status == Status.ABORTED
    assert fake_vllm.requests == []


@pytest.mark.parametrize(
    ("hook", "expected_src", "expected_requests"),
    [
        ("reset", "pending", []),
        ("step", "stepping", [RENDER_PATH, GENERATE_PATH]),
        ("format_observation", "observing", [RENDER_PATH, GENERATE_PATH]),
    ],
)
async def test_abort_asked_for_inside_the_environment_sends_nothing_more(
    make_rollout: Any, fake_vllm: FakeVLLMServer, hook: str, expected_src: str, expected_requests: list[str]
) -> None:
    fake_vllm.script([ScriptedTurn(text="a"), ScriptedTurn(text="b")])
    rollout, _ = make_rollout()

    class AbortingEnv:
        def __init__(self) -> None:
            self.closed = 0

        def reset(self) -> None:
            if hook == "reset":
                rollout.request_abort("weight_update")

        def step(self, text: str) -> tuple[str, bool, dict[str, Any]]:
            if hook == "step":
                rollout.request_abort("weight_update")
            return "obs", False, {}

        def format_observation(self, observation: str) -> dict[str, str]:
            if hook == "format_observation":
                rollout.request_abort("weight_update")
            return {"role": "user", "content": observation}

        def close(self) -> None:
            self.closed += 1

    env = AbortingEnv()
    rollout._env_factory = lambda **_: env
    from fsm_rollout import capture_transitions

    with capture_transitions() as events:
        await rollout.run()
    assert paths(fake_vllm) == expected_requests
    assert events[-1]["src"] == expected_src
    assert events[-1]["dst"] == "aborted"
    assert env.closed == 1


async def test_a_list_of_tool_results_is_one_observation_rendered_together(
    run_rollout: Any, fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    results = [
        {"role": "tool", "content": "42", "tool_call_id": "call_0", "name": "calc"},
        {"role": "tool", "content": "7", "tool_call_id": "call_1", "name": "calc"},
    ]
    fake_vllm.script([ScriptedTurn(text=f"Two calls.{EOS}"), ScriptedTurn(text=f"Done.{EOS}")])
    result = await run_rollout(envs=ScriptedEnvFactory(steps=[(results, False), ("fine", True)]))
    first, second = generate_bodies(fake_vllm)
    start = len(first["token_ids"]) + len(tokenizer.encode(f"Two calls.{EOS}", add_special_tokens=False))
    suffix = tokenizer.decode(second["token_ids"][start:])
    # the bundled template renders each tool result as its own user turn, and the suffix is exactly that
    assert suffix == (
        "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    observation_start = start - len(first["token_ids"])
    assert result.sample.metadata["observations"] == [
        {"start": observation_start, "end": len(second["token_ids"]) - len(first["token_ids"]), "messages": results}
    ]
    assert result.sample.status == Status.COMPLETED


async def test_an_observation_that_is_not_appended_is_not_recorded(
    run_rollout: Any, fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    text = f"thinking{EOS}"
    n = len(tokenizer.encode(text, add_special_tokens=False))
    fake_vllm.script([ScriptedTurn(text=text)])
    result = await run_rollout(sampling={"max_new_tokens": n + 3, "temperature": 1.0, "top_p": 1.0})
    assert result.rollout.reason == "insufficient_budget_for_next_turn"
    assert "observations" not in result.sample.metadata


@pytest.mark.parametrize("template", ["bundled", "grouped"])
@pytest.mark.parametrize("stop", [None, "masked_eos", "no_masked_eos"])
async def test_a_tool_calling_rollout_renders_as_its_tokens(tokenizer: Any, template: str, stop: str | None) -> None:
    from fsm_rollout import RetryPolicy, Rollout, RolloutConfig, VLLMClient
    from fsm_rollout.testing.templates import GROUPED_TOOLS_CHAT_TEMPLATE, qwen_tokenizer_with_template
    from fsm_rollout.tokens.parity import check_template_parity
    from fsm_rollout.tokens.tool_calls import parse_tool_calls

    chosen = tokenizer if template == "bundled" else qwen_tokenizer_with_template(GROUPED_TOOLS_CHAT_TEMPLATE)
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    call = '<tool_call>\n{"name": "calc", "arguments": {"x": "6*7"}}\n</tool_call>'
    calls = f"{call}\n{call}" if stop is None else call  # a stop string ends generation at the first call

    class ToolEnv:
        def reset(self) -> None: ...

        def step(self, text: str) -> tuple[Any, bool, dict[str, Any]]:
            parse = parse_tool_calls(text, read_unclosed=True)
            return [str(len(call.arguments["x"])) for call in parse.calls], not parse.calls, {}

        def format_observation(self, results: list[str]) -> list[dict[str, Any]]:
            return [
                {"role": "tool", "content": result, "tool_call_id": f"call_{i}"} for i, result in enumerate(results)
            ]

        def close(self) -> None: ...

    sampling: dict[str, Any] = {"max_new_tokens": 256, "temperature": 1.0, "top_p": 1.0}
    if stop:  # the masked EOS after the stop string closes the turn, or else the boundary's leading EOS does
        sampling["stop"] = ["</tool_call>"]
    async with FakeVLLMServer(chosen, model="fake-model") as server:
        server.script([ScriptedTurn(text=calls + EOS), ScriptedTurn(text=f"It is 42.{EOS}")])
        config = RolloutConfig(
            engine_url=server.url,
            model="fake-model",
            max_turns=3,
            check_invariants=True,
            retry=RetryPolicy(max_attempts=2, base_delay_s=0.01),
            append_eos_token_after_stop_str_in_multi_turn=stop != "no_masked_eos",
        )
        async with VLLMClient(server.url) as client:
            sample = await Rollout(
                Sample(prompt="What is 6 * 7?", index=0, metadata={"tools": tools}),
                config=config,
                sampling_params=sampling,
                client=client,
                tokenizer=chosen,
                env_factory=lambda **_: ToolEnv(),
            ).run()
    assert sample.status == Status.COMPLETED
    (record,) = sample.metadata["observations"]
    assert [message["content"] for message in record["messages"]] == ["3"] * (1 if stop else 2)
    prompt_length = len(sample.tokens) - sample.response_length
    closing = sample.tokens[prompt_length + record["start"] - 1]
    assert (closing == chosen.eos_token_id) is (stop != "no_masked_eos")
    assert sample.loss_mask[record["start"] - 1] == (0 if stop == "masked_eos" else 1)
    report = check_template_parity(sample, chosen)
    assert report.ok, report.describe()
