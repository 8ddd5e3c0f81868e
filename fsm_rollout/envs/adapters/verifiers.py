"""verifiers environments (the 0.3 ``MultiTurnEnv``/``ToolEnv``/``SingleTurnEnv`` API) as rollout environments:
:func:`verifiers_env` and :func:`verifiers_samples`.

The environment runs its own ``rollout`` loop, unchanged, once per sample, with a verifiers client of ours in
place of the model: each time the loop asks the model for a response, the client hands the request to the
rollout and answers with the turn the rollout generated. So everything of the environment's runs as written:
``setup_state``, ``env_response`` (its messages are the turn's observation), the stop conditions (the one that
fired is ``sample.metadata["env_stop"]``, e.g. ``no_tools_called``, ``max_turns_reached``, ``has_error``), the
cleanup handlers, and then the rubric: ``score_rollout`` gives ``sample.reward``, its per-function scores are in
``sample.metadata["verifiers"]["metrics"]`` and the JSON-able entries of the final ``state`` in
``sample.metadata["verifiers"]["state"]``.

A turn's ``<tool_call>`` blocks are read by :func:`fsm_rollout.tokens.tool_calls.parse_tool_calls` into the response's
``tool_calls`` (an unreadable block is passed on with its text as the arguments, so a ``ToolEnv`` reports it to
the model as it reports any argument it cannot parse); the tool definitions go in ``sample.metadata["tools"]``.

The first request's prompt becomes the sample's prompt when the environment is built. When the rollout's own turn
limit ends the sample first, the environment's loop is stopped (its cleanup runs) and the rollout is scored as it
stands; so is a sample its token budget cut off, when its environment is closed. Not supported: group rubrics
(``score_group``), environments that change earlier messages between turns (each observation must extend the
previous prompt), and the verifiers 0.4 v1 Taskset/Harness API.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Mapping
from typing import Any

from fsm_rollout.envs.adapters._common import (
    ENV_STOP_KEY,
    import_extra,
    jsonable_items,
    max_turns_of,
    reward_value,
    root_logging_kept,
)
from fsm_rollout.errors import (
    AdapterProtocolError,
    EnvironmentContractError,
    EnvironmentLoadError,
    EnvironmentNotFoundError,
)
from fsm_rollout.tokens.tool_calls import ToolCall, parse_tool_calls

ADAPTER = "verifiers"
MODEL = "fsm-rollout"
"""The model name the environment's loop sees (the rollout's engine decides the real one)."""
STATE_LEFT_OUT = frozenset({
    "prompt", "completion", "trajectory", "client", "model", "sampling_args", "timing", "tool_defs", "input",
    "task", "trajectory_id", "final_env_response", "metrics", "reward", "stop_condition",
})  # fmt: skip
"""State entries not copied into the metadata: messages, clients and timings, a random id, and what the metadata
holds under its own key."""


def _vf() -> Any:
    return import_extra("verifiers", adapter=ADAPTER, package="verifiers<0.4", extra="verifiers")


def _messages(messages: Any) -> list[dict[str, Any]]:
    """verifiers messages (pydantic models or dicts) as plain chat-message dicts."""
    result = []
    for message in messages:
        if hasattr(message, "model_dump"):
            message = message.model_dump(exclude_none=True)
        result.append({key: value for key, value in dict(message).items() if value is not None})
    return result


def openai_tools(tool_defs: Any) -> list[dict[str, Any]]:
    """verifiers ``Tool`` definitions in the OpenAI format the chat template takes."""
    return [
        {
            "type": "function",
            "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters},
        }
        for tool in tool_defs or []
    ]


def _tool_calls(vf: Any, text: str, turn: int) -> tuple[str, list[Any]]:
    """The turn's text without its tool-call blocks, and the blocks as verifiers ``ToolCall`` objects."""
    parsed = parse_tool_calls(text)
    calls = []
    for block in parsed.blocks:
        call_id = f"call_{turn}_{block.index}"
        if isinstance(block, ToolCall):
            calls.append(vf.types.ToolCall(id=call_id, name=block.name, arguments=json.dumps(block.arguments)))
        else:
            calls.append(vf.types.ToolCall(id=call_id, name=str(block.name or ""), arguments=block.raw))
    content = text
    for block in sorted(parsed.blocks, key=lambda block: -block.start):
        content = content[: block.start] + content[block.end :]
    return content.strip(), calls


class _Request:
    """One model request of the environment's loop, waiting for the rollout's turn."""

    def __init__(self, prompt: Any, state: Any) -> None:
        self.prompt = prompt
        self.state = state
        self.answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()


class VerifiersEpisode:
    """One sample's run of a verifiers environment's loop, behind the rollout's environment protocol."""

    def __init__(self, env: Any, *, sample: Any, args: Any) -> None:
        self.vf = _vf()
        self.env = env
        self.sample = sample
        self.args = args
        self.requests: asyncio.Queue[_Request] = asyncio.Queue()
        self.task: asyncio.Task[Any] | None = None
        self.pending: _Request | None = None
        self.state: Any = None
        self.turns = 0
        self.scored = False

    # the environment's loop calls this through the client
    async def model_request(self, prompt: Any, state: Any) -> Any:
        request = _Request(prompt, state)
        self.state = state
        await self.requests.put(request)
        return await request.answer

    async def start(self, rollout_input: dict[str, Any]) -> list[dict[str, Any]]:
        """Start the environment's loop; the prompt of its first model request."""
        client = _bridge_client(self.vf, self)
        self.task = asyncio.ensure_future(self.env.rollout(rollout_input, client, MODEL, {}))
        request = await self._next("env.rollout")
        if request is None:
            stop = (self.state or {}).get("stop_condition") if isinstance(self.state, Mapping) else None
            raise AdapterProtocolError(
                ADAPTER, "env.rollout", f"ended before its first model request (stop condition {stop!r})"
            )
        self.pending = request
        tools = openai_tools(request.state.get("tool_defs"))
        if tools:
            self.sample.metadata["tools"] = tools
        return _messages(request.prompt)

    async def _next(self, call: str) -> _Request | None:
        """The loop's next model request, or None when the loop ended (its final state kept)."""
        assert self.task is not None
        getter = asyncio.ensure_future(self.requests.get())
        try:
            await asyncio.wait({getter, self.task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not getter.done():
                getter.cancel()
        if getter.done() and not getter.cancelled():
            return getter.result()
        error = self.task.exception()
        if error is not None:
            raise AdapterProtocolError(ADAPTER, call, f"raised {type(error).__name__}: {error}") from error
        self.state = self.task.result()
        return None

    async def reset(self) -> None:
        """Nothing: the loop started when the episode was built (its first prompt is the sample's)."""

    async def step(self, response_text: str) -> tuple[list[dict[str, Any]], bool, dict[str, Any]]:
        if self.pending is None:
            raise AdapterProtocolError(ADAPTER, "env.rollout", "has no model request waiting for this turn")
        self.turns += 1
        content, calls = _tool_calls(self.vf, response_text, self.turns)
        message = self.vf.types.ResponseMessage(
            content=content or None,
            tool_calls=calls or None,
            finish_reason="tool_calls" if calls else "stop",
            is_truncated=False,
        )
        previous = self.pending
        self.pending = None
        response = self.vf.types.Response(id=f"turn-{self.turns}", created=0, model=MODEL, message=message)
        previous.answer.set_result(response)
        request = await self._next("env_response")
        if request is None:
            return [], True, {"reward": await self._score()}
        self.pending = request
        observation = _messages(request.prompt[len(previous.prompt) + 1 :])
        if not observation:
            raise AdapterProtocolError(ADAPTER, "env_response", "returned no messages for a rollout that goes on")
        info: dict[str, Any] = {}
        max_turns = max_turns_of(self.args)
        if max_turns is not None and self.turns >= max_turns:  # the rollout stops here: stop the loop, score it
            await self._stop_loop()
            info["reward"] = await self._score()
        return observation, False, info

    async def _stop_loop(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task  # its cleanup handlers run on the way out

    async def _score(self) -> float:
        state = self.state
        await self.env.rubric.score_rollout(state)
        await self.env.rubric.cleanup(state)
        self.scored = True
        stop = state.get("stop_condition")
        if isinstance(stop, str):
            self.sample.metadata[ENV_STOP_KEY] = stop
        error = state.get("error")
        self.sample.metadata[ADAPTER] = {
            "stop_condition": stop,
            "metrics": jsonable_items(state.get("metrics") or {}),
            "error": None if error is None else f"{type(error).__name__}: {error}",
            "state": jsonable_items({key: value for key, value in state.items() if key not in STATE_LEFT_OUT}),
        }
        return reward_value(ADAPTER, "rubric.score_rollout", state.get("reward"))

    async def format_observation(self, observation: Any) -> list[dict[str, Any]]:
        return list(observation)

    async def close(self) -> None:
        await self._stop_loop()
        status = getattr(getattr(self.sample, "status", None), "value", None)
        if not self.scored and self.state is not None and status in ("completed", "truncated"):
            self.sample.reward = await self._score()  # cut off by its token budget: scored as it stands


_CLIENT_CLASSES: dict[int, type] = {}


def _bridge_client(vf: Any, episode: VerifiersEpisode) -> Any:
    """A verifiers client whose responses are the episode's turns (the class is made once per verifiers module)."""
    cls = _CLIENT_CLASSES.get(id(vf))
    if cls is None:

        class RolloutClient(vf.clients.Client):  # type: ignore[misc]
            """Answers the environment's model requests with the rollout's turns."""

            def setup_client(self, config: Any) -> Any:
                return config

            async def to_native_tool(self, tool: Any) -> Any:
                return tool

            async def to_native_prompt(self, messages: Any) -> tuple[Any, dict[str, Any]]:
                return messages, {}

            async def get_native_response(self, prompt: Any, model: str, sampling_args: Any, tools: Any = None,
                                          **kwargs: Any) -> Any:  # fmt: skip
                return await self.client.model_request(prompt, kwargs.get("state"))

            async def raise_from_native_response(self, response: Any) -> None:
                return None

            async def from_native_response(self, response: Any) -> Any:
                return response

            async def close(self) -> None:
                return None

        cls = _CLIENT_CLASSES[id(vf)] = RolloutClient
    return cls(episode)


def rollout_input(sample: Any) -> dict[str, Any]:
    """The verifiers ``RolloutInput`` of a sample: its prompt and ``sample.metadata["verifiers_row"]``'s fields."""
    from fsm_rollout.envs.adapters._common import prompt_messages

    metadata = getattr(sample, "metadata", None) or {}
    row = dict(metadata.get("verifiers_row") or {}) if isinstance(metadata, Mapping) else {}
    row["prompt"] = prompt_messages(sample.prompt)
    row.setdefault("example_id", getattr(sample, "index", None) or 0)
    if "answer" not in row and getattr(sample, "label", None) is not None:
        row["answer"] = str(sample.label)
    return row


class VerifiersEnvFactory:
    """The ``build_env`` :func:`verifiers_env` returns (see the module docstring)."""

    def __init__(self, env: Any, env_args: Mapping[str, Any] | None = None) -> None:
        vf = _vf()
        if isinstance(env, str):
            env = load_named(vf, env, dict(env_args or {}))
        elif env_args is not None:
            raise TypeError("verifiers_env: env_args are for an environment given by name (load_environment's)")
        if not isinstance(env, vf.MultiTurnEnv):
            raise EnvironmentContractError(
                f"verifiers_env takes a verifiers MultiTurnEnv (ToolEnv, SingleTurnEnv, ...), got {type(env).__name__}"
            )
        self.env = env

    async def __call__(self, *, sample: Any, args: Any) -> VerifiersEpisode:
        episode = VerifiersEpisode(self.env, sample=sample, args=args)
        try:
            sample.prompt = await episode.start(rollout_input(sample))
        except BaseException:
            await episode.close()
            raise
        return episode


def load_named(vf: Any, name: str, env_args: dict[str, Any]) -> Any:
    """``vf.load_environment(name, **env_args)``. An environment that is not installed is an
    :class:`~fsm_rollout.errors.EnvironmentNotFoundError` found before verifiers is asked (which would log a line and
    raise a bare ValueError); one that fails to import or to load is an
    :class:`~fsm_rollout.errors.EnvironmentLoadError` with verifiers' reason."""
    import importlib.util

    module = name.replace("-", "_").split("/")[-1]  # the module verifiers imports for an environment id
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise EnvironmentNotFoundError(
            f"verifiers adapter: no verifiers environment {name!r} is installed (verifiers imports the module "
            f"{module!r}; install its Environments Hub package)",
            name=name,
        )
    try:
        with root_logging_kept():
            return vf.load_environment(name, **env_args)
    except (ValueError, RuntimeError) as error:
        cause = error.__cause__ if error.__cause__ is not None else error
        raise EnvironmentLoadError(
            f"verifiers adapter: loading {name!r} failed: {type(cause).__name__}: {cause}"
        ) from error


def verifiers_env(env: Any, *, env_args: Mapping[str, Any] | None = None) -> VerifiersEnvFactory:
    """An environment factory (``build_env``) for a verifiers environment, or the name its
    ``verifiers.load_environment`` loads (an installed Environments Hub package) with ``env_args`` as its keyword
    arguments (``vf-eval``'s ``-a``)."""
    return VerifiersEnvFactory(env, env_args)


def verifiers_samples(env: Any, *, n: int = -1, eval_split: bool = False) -> list[Any]:
    """The environment's dataset rows as samples: ``prompt`` (with the environment's system prompt) as the
    prompt, ``answer`` as the label, and the row's ``answer``/``info``/``task``/``example_id`` in
    ``sample.metadata["verifiers_row"]``, which :func:`verifiers_env` passes back to the environment."""
    from fsm_rollout.sample import Sample

    factory = env if isinstance(env, VerifiersEnvFactory) else VerifiersEnvFactory(env)
    dataset = factory.env.get_eval_dataset(n) if eval_split else factory.env.get_dataset(n)
    samples = []
    for index, row in enumerate(dataset):
        kept = {key: row[key] for key in ("answer", "info", "task", "example_id") if row.get(key) is not None}
        samples.append(
            Sample(
                index=index,
                prompt=_messages(row["prompt"]),
                label=row.get("answer"),
                metadata={"verifiers_row": jsonable_items(kept)},
            )
        )
    return samples
