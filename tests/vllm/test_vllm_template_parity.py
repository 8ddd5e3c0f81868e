"""Template parity against the real server: rollouts whose observations are user messages, one tool result, or
several tool results per turn, with tools in the sample's metadata. Each finished sample must be what the local
template renders for its rebuilt conversation (:func:`check_template_parity`) and what vLLM's own render gives.

The environment ignores the model's text, but both checks render a turn from its decoded text, so a turn must
encode back to its own tokens; the random model's favourite tokens are byte fragments that do not. Each turn is
therefore one token from a short list of whole words (``allowed_token_ids``, which the library has no sampling key
for, so it is set on the rollout's request parameters), picked greedily: the run is deterministic. How a turn ends
is varied too: on the EOS itself, on a stop token (the observation boundary then closes the turn with EOS), or on a
stop string (the library appends a masked EOS).
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm_helpers import ASCII_STOPS, GENERATE_PATH, RENDER_PATH, SERVED_MODEL, post

from fsm_rollout import Sample, Status, capture_transitions
from fsm_rollout.envs.calculator import TOOL_NAME, TOOLS
from fsm_rollout.testing.envs import ScriptedEnvFactory
from fsm_rollout.tokens.parity import Conversation, check_template_parity, rebuild_conversation

pytestmark = pytest.mark.vllm

MAX_TURNS = 4
CONTEXT_TOKENS = 12


def tool_results(first: int, count: int) -> list[dict[str, Any]]:
    return [
        {"role": "tool", "content": str(6 * (first + n)), "tool_call_id": f"call_{first + n}", "name": TOOL_NAME}
        for n in range(count)
    ]


#: Per shape, the observation after each turn but the last (the rollout stops on max_turns).
OBSERVATIONS: dict[str, list[Any]] = {
    "user": [{"role": "user", "content": f"Check step {n} again."} for n in range(MAX_TURNS - 1)],
    "one-tool": [tool_results(n, 1) for n in range(MAX_TURNS - 1)],
    "several-tools": [tool_results(10 * n, count) for n, count in enumerate((2, 3, 4))],
}


WORDS = (" ok", " yes", " no", " Sure", " done", " fine")
ENDINGS = ("eos", "stop-token", "stop-string")


def turn_params(ending: str, tokenizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The sampling parameters of a run ending its turns this way, and what to add to its request parameters."""
    words = [token for word in WORDS for token in tokenizer.encode(word, add_special_tokens=False)]
    assert len(words) == len(WORDS)  # one token each
    sampling: dict[str, Any] = {"max_new_tokens": 256, "temperature": 0.0, "top_p": 1.0}
    if ending == "eos":
        return sampling, {"allowed_token_ids": [tokenizer.eos_token_id]}
    if ending == "stop-token":
        return sampling | {"stop_token_ids": words}, {"allowed_token_ids": words}
    return sampling | {"stop": ASCII_STOPS, "no_stop_trim": True}, {"allowed_token_ids": words}


def first_difference(tokens: list[int], rendered: list[int]) -> int | None:
    shorter = min(len(tokens), len(rendered))
    position = next((i for i in range(shorter) if tokens[i] != rendered[i]), shorter)
    return None if position == shorter and len(tokens) == len(rendered) else position


def assert_render_agrees(rendered: list[int], sample: Sample, conversation: Conversation, tokenizer: Any) -> None:
    """check_template_parity's rule: equal, or the rendering goes on after the sample only to close its last turn."""
    tokens = list(sample.tokens)
    position = first_difference(tokens, rendered)
    if position is None or (position == len(tokens) and conversation.segments[-1].kind == "turn"):
        return

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=False))

    segment = next((part.label for part in conversation.segments if part.start <= position < part.end), "the end")
    raise AssertionError(
        f"vLLM's render differs at token {position} of {len(tokens)} (rendered {len(rendered)}; in {segment}): "
        f"after {decode(tokens[max(0, position - CONTEXT_TOKENS) : position])!r} the sample has "
        f"{decode(tokens[position : position + CONTEXT_TOKENS])!r} where vLLM renders "
        f"{decode(rendered[position : position + CONTEXT_TOKENS])!r}"
    )


@pytest.mark.parametrize("ending", ENDINGS)
@pytest.mark.parametrize("shape", list(OBSERVATIONS))
async def test_rollout_matches_local_template_and_vllm_render(
    make_real_rollout: Any, proxy: Any, vllm_tokenizer: Any, shape: str, ending: str
) -> None:
    sampling, extra = turn_params(ending, vllm_tokenizer)
    sample = Sample(prompt=f"What is 6 * 7? ({shape})", index=0, metadata={"tools": TOOLS})
    envs = ScriptedEnvFactory(steps=[(observation, False) for observation in OBSERVATIONS[shape]])
    rollout, _ = make_real_rollout(sample, sampling=sampling, envs=envs, max_turns=MAX_TURNS)
    rollout.inference_params.update(extra)
    with capture_transitions() as events:
        await rollout.run()
    sample = rollout.sample
    assert sample.status == Status.TRUNCATED and rollout.reason == "max_turns"

    # the run took the path it was set up for: every turn one token, the EOS after it where due
    generated = [choice["token_ids"] for choice in (e.response["choices"][0] for e in proxy.to(GENERATE_PATH))]
    assert len(generated) == MAX_TURNS and all(len(ids) == 1 for ids in generated), generated
    inserted = [event["eos_inserted"] for event in events if event["trigger"] == "step"]
    assert inserted == [ending == "stop-string"] * MAX_TURNS
    assert proxy.to(RENDER_PATH)[0].body["tools"] == TOOLS
    records = sample.metadata["observations"]
    expected = [[o] if isinstance(o, dict) else o for o in OBSERVATIONS[shape]]
    assert [record["messages"] for record in records] == expected

    report = check_template_parity(sample, vllm_tokenizer)
    assert report.ok, report.describe()

    conversation = rebuild_conversation(sample, vllm_tokenizer)
    assert not conversation.add_generation_prompt  # the rollout ends on a turn
    rendered = await post(
        proxy.url + RENDER_PATH,
        {"model": SERVED_MODEL, "messages": conversation.messages, "tools": TOOLS,
         "add_generation_prompt": conversation.add_generation_prompt},
    )  # fmt: skip
    assert_render_agrees(rendered["token_ids"], sample, conversation, vllm_tokenizer)
