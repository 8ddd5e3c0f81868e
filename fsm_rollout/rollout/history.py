"""History policies: how the conversation reaches the next turn, and the ``fork`` edge's guard and action.

``RolloutConfig.history_policy`` names one of them (``"auto"`` is resolved once by the runner at start-up):

* ``append``: each observation is appended as boundary tokens cut from the local chat template; history is never
  re-rendered (no render per observation). The model conditions on exactly the tokens it is trained on.
* ``fork``: at each observation the whole conversation is rendered through the engine's ``/render`` (one request:
  the engine's template is the authority, as at deployment) and compared with the tokens so far. A re-render that
  extends them appends its new tokens (loss mask 0). One that writes the history differently takes the table's
  ``fork`` edge (reason ``history_rewritten``): the sequence so far closes into ``sample.branches`` and the
  re-render is the prompt of the next one.
* ``per_turn``: every model call is its own training sequence: the ``fork`` edge at every observation, whose prompt
  is the engine's render of the history at that call.

**No break by meaning.** A re-render that differs from the tokens so far only in how it writes what the model
said is no break: the text of the tokens so far followed by the append policy's boundary tokens is compared with the
text of the re-render after both are put in a normal form (:func:`canonical_text`): each ``<tool_call>`` body is
replaced by its call's name and parsed arguments as canonical JSON (``false`` and Python's ``False``, spacing and
key order written alike), whitespace around tool-call blocks is dropped, and so is every *empty* think block
(``<think>`` then only whitespace then ``</think>``), which templates add, drop or re-space around turns that did
not reason. A non-empty think block the template dropped is a break. When the forms match, the boundary tokens
are appended, so the model keeps its own tokens.

**A rewritten history.** An agent behind the gateway may send a conversation that does not extend what the model
saw (a step's :class:`~fsm_rollout.envs.step.Rewrite`), under any policy. :func:`rewrite_history` renders the
conversation as sent (one request); a render that extends the tokens so far is appended, anything else takes the
``fork`` edge, and the fork gives the next sequence the call's tools.

The conversation (the prompt's messages, each assistant turn, each observation) is kept in the context
(``history``) for the re-render; an assistant turn is its text without the closing EOS, or, when the sample has
tools and the text's tool calls parse, the text before them plus structured ``tool_calls`` as a deployment's tool
parser would hand them back.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from fsm_rollout.config import response_budget
from fsm_rollout.errors import TemplateError
from fsm_rollout.multimodal import decode_train_features
from fsm_rollout.sample.branches import split_branch
from fsm_rollout.tokens.chat_messages import wire_messages, wire_tool_call
from fsm_rollout.tokens.tool_calls import ToolCall, parse_tool_calls
from fsm_rollout.types import RenderedPrompt, TokenIds

if TYPE_CHECKING:
    from fsm_rollout.config import RolloutConfig
    from fsm_rollout.envs.step import Rewrite
    from fsm_rollout.rollout.context import RolloutContext

RESOLVED_POLICIES: tuple[str, ...] = ("append", "fork", "per_turn")
"""The policies a rollout runs under (``auto`` is resolved before)."""

_EMPTY_THINK = re.compile(r"<think>\s*</think>\s*")
_TOOL_CALL = re.compile(r"\s*<tool_call>(.*?)</tool_call>\s*", re.DOTALL)

Render = Callable[[dict[str, Any]], Awaitable[RenderedPrompt]]
"""Sends one render request (through the rollout's cancel scope) and returns the engine's answer."""


def rollout_policy(config: RolloutConfig) -> str:
    """The policy a rollout runs under. ``auto`` reaching a rollout (one built directly, without the runner's
    start-up choice) is ``append``: today's method, which refuses a template it cannot follow."""
    policy = config.history_policy
    return "append" if policy == "auto" else policy


def keeps_history(config: RolloutConfig) -> bool:
    """Whether rollouts under ``config`` keep the conversation's messages for re-rendering."""
    return rollout_policy(config) != "append"


# ------------------------------------------------------------------------------------------------ meaning


def canonical_text(text: str) -> str:
    """``text`` in the normal form the fork policy compares (see the module docstring)."""
    return _TOOL_CALL.sub(_canonical_call, _EMPTY_THINK.sub("", text))


def _canonical_call(match: re.Match[str]) -> str:
    body = match.group(1).strip()
    value = _load(body)
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return f"<tool_call>{body}</tool_call>"
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        loaded = _load(arguments)
        arguments = loaded if loaded is not None else arguments
    call = json.dumps({"name": value["name"], "arguments": arguments}, sort_keys=True, separators=(",", ":"))
    return f"<tool_call>{call}</tool_call>"


def _load(text: str) -> Any:
    """JSON, or a Python literal (a template that printed a dict writes ``False`` and single quotes); else None."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None


def same_meaning(left: str, right: str) -> bool:
    """Whether two renderings say the same once tool calls and empty think blocks are normalised."""
    return canonical_text(left) == canonical_text(right)


# ------------------------------------------------------------------------------------------------ the conversation


def assistant_message(text: str, *, tools: Any) -> dict[str, Any]:
    """The assistant message of a turn whose text (without its closing EOS) is ``text``, in the wire form an engine
    validates (tool-call arguments as JSON strings: :mod:`fsm_rollout.tokens.chat_messages`)."""
    if tools:
        parsed = parse_tool_calls(text)
        calls = [block for block in parsed.blocks if isinstance(block, ToolCall)]
        if parsed.ok and calls:
            return {
                "role": "assistant",
                "content": text[: calls[0].start].rstrip(),
                "tool_calls": [
                    wire_tool_call(f"call_{number}", call.name, call.arguments) for number, call in enumerate(calls)
                ],
            }
    return {"role": "assistant", "content": text}


def turn_text(ctx: RolloutContext) -> str:
    """The last turn's text without the EOS that closed it."""
    assert ctx.turn is not None
    token_ids = ctx.turn.token_ids
    eos = ctx.deps.encoder.eos_token_id
    if token_ids and token_ids[-1] == eos:
        token_ids = token_ids[:-1]
    return ctx.deps.decode(token_ids) if token_ids else ""


def render_payload(ctx: RolloutContext, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The render request for ``messages``, as the first render of the sample was sent."""
    config = ctx.deps.config
    # the wire form: a prompt or an agent's messages may hold tool-call arguments as objects, which vLLM refuses
    payload: dict[str, Any] = {"model": config.model, "messages": wire_messages(messages)}
    tools = ctx.sample.metadata.get("tools")
    if tools is not None:
        payload["tools"] = tools
    if config.apply_chat_template_kwargs:
        payload["chat_template_kwargs"] = dict(config.apply_chat_template_kwargs)
    return payload


async def reconcile(ctx: RolloutContext, render: Render) -> str | None:
    """Under ``fork`` or ``per_turn``: render the conversation with the new observation and decide how it goes on.

    Returns ``"fork"`` (the re-render, in ``ctx.fork_prompt``, is the next sequence's prompt) or None (the
    ``generate`` edges append ``ctx.observation_tokens``). Sends exactly one render request.
    """
    policy = rollout_policy(ctx.deps.config)
    tools = ctx.sample.metadata.get("tools")
    conversation = [
        *ctx.history,
        assistant_message(turn_text(ctx), tools=tools),
        *(dict(message) for message in ctx.observation_messages),
    ]
    rendered = await render(render_payload(ctx, conversation))
    ctx.history = conversation
    if policy == "per_turn":
        return _fork(ctx, rendered)
    tokens = ctx.sample.tokens
    new = rendered.token_ids
    if len(new) > len(tokens) and new[: len(tokens)] == tokens:
        ctx.observation_tokens = list(new[len(tokens) :])
        ctx.rendered = rendered  # its features cover the whole conversation
        return None
    boundary = _boundary(ctx, tools)
    if boundary is not None:
        decode = ctx.deps.decode
        if same_meaning(decode([*tokens, *boundary]), decode(new)):
            ctx.observation_tokens = boundary
            return None
    return _fork(ctx, rendered)


async def rewrite_history(ctx: RolloutContext, render: Render, rewrite: Rewrite) -> str | None:
    """The agent rewrote the history (the step's :class:`~fsm_rollout.envs.step.Rewrite`): render
    the conversation as sent with the call's tools. Returns ``"fork"`` unless the render extends the tokens so far
    (then its new tokens are appended, as under ``fork``). Sends exactly one render request."""
    messages = [dict(message) for message in rewrite.messages]
    tools = _tool_list(rewrite.tools)
    payload = render_payload(ctx, messages)
    payload.pop("tools", None)
    if tools:
        payload["tools"] = tools
    rendered = await render(payload)
    if keeps_history(ctx.deps.config):
        ctx.history = messages
    tokens = ctx.sample.tokens
    new = rendered.token_ids
    if rollout_policy(ctx.deps.config) != "per_turn" and len(new) > len(tokens) and new[: len(tokens)] == tokens:
        _set_tools(ctx, tools)
        ctx.observation_tokens = list(new[len(tokens) :])
        ctx.rendered = rendered
        return None
    return _fork(ctx, rendered)


def _tool_list(tools: Any) -> list[dict[str, Any]] | None:
    return None if tools is None else [dict(tool) for tool in tools]


def _set_tools(ctx: RolloutContext, tools: Any) -> None:
    if tools:
        ctx.sample.metadata["tools"] = tools
    else:
        ctx.sample.metadata.pop("tools", None)


def _fork(ctx: RolloutContext, rendered: RenderedPrompt) -> str:
    ctx.fork_prompt = rendered
    ctx.observation_tokens = []
    return "fork"


def _boundary(ctx: RolloutContext, tools: Any) -> TokenIds | None:
    """The append policy's boundary tokens for the observation, or None when the template cannot cut them."""
    encoder = ctx.deps.encoder
    tokens = ctx.sample.tokens
    try:
        return encoder.encode(  # type: ignore[no-any-return]
            ctx.observation_messages,
            ends_with_eos=bool(tokens) and tokens[-1] == encoder.eos_token_id,
            tools=tools,
            template_kwargs=ctx.deps.config.apply_chat_template_kwargs,
        )
    except TemplateError:
        return None


# ------------------------------------------------------------------------------------------------ the fork edge


def fork_budget(ctx: RolloutContext, prompt_length: int) -> int | None:
    """The response budget of a sequence opened after ``len(ctx.response_token_ids)`` generated tokens:
    ``max_new_tokens`` bounds what the whole rollout generates, ``rollout_max_context_len`` each request."""
    max_tokens = ctx.deps.params["max_tokens"]
    left = None if max_tokens is None else max(0, max_tokens - len(ctx.response_token_ids))
    return response_budget(left, ctx.deps.config.rollout_max_context_len, prompt_length)


def fork_exceeds_budget(ctx: RolloutContext) -> bool:
    """The re-render leaves no budget for another turn."""
    assert ctx.fork_prompt is not None
    budget = fork_budget(ctx, len(ctx.fork_prompt.token_ids))
    return budget is not None and budget <= 0


def note_fork_truncation(ctx: RolloutContext) -> None:
    assert ctx.fork_prompt is not None
    ctx.sample.metadata["multiturn_truncation"] = {
        "reason": "insufficient_budget_for_next_turn",
        "fork_prompt_tokens": len(ctx.fork_prompt.token_ids),
        "generated_tokens": len(ctx.response_token_ids),
    }
    ctx.fork_prompt = None


def fork_reason(ctx: RolloutContext) -> str:
    """The reason of the fork the step's call asks for: ``compacted`` for a gateway agent's compaction, else
    ``history_rewritten``."""
    call = ctx.step.next_call if ctx.step is not None else None
    return (
        "compacted"
        if call is not None and call.rewrite is not None and call.rewrite.compacted
        else ("history_rewritten")
    )


def fork_history(ctx: RolloutContext) -> None:
    """Close the sequence so far into ``sample.branches``; the re-render is the prompt of the next sequence."""
    prompt = ctx.fork_prompt
    assert prompt is not None
    sample = ctx.sample
    features = ctx.rendered.generate_body.get("features") if ctx.rendered is not None else None
    branch = split_branch(
        sample,
        response=ctx.deps.decode(ctx.response_token_ids[ctx.branch_start :]),
        train_inputs=decode_train_features(features, sample_id=ctx.sample_id),
    )
    call = ctx.step.next_call if ctx.step is not None else None
    if call is not None and call.rewrite is not None:  # the agent's: the closed branch says why, the next has its tools
        branch.metadata[fork_reason(ctx)] = call.rewrite.detail
        _set_tools(ctx, _tool_list(call.rewrite.tools))
    sample.tokens = list(prompt.token_ids)
    ctx.branch_start = len(ctx.response_token_ids)
    ctx.rendered = prompt
    ctx.fork_prompt = None
    ctx.prompt_length = len(sample.tokens)
    ctx.budget = fork_budget(ctx, ctx.prompt_length)
    ctx.observation_messages = []
    ctx.turn_index += 1


def history_to_json(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [dict(message) for message in messages]


def history_from_json(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not all(isinstance(message, Mapping) for message in messages):
        raise TypeError("history must be a list of message objects")
    return [dict(message) for message in messages]


__all__ = [
    "RESOLVED_POLICIES",
    "assistant_message",
    "canonical_text",
    "fork_budget",
    "fork_exceeds_budget",
    "fork_history",
    "fork_reason",
    "keeps_history",
    "note_fork_truncation",
    "reconcile",
    "rewrite_history",
    "rollout_policy",
    "same_meaning",
]
