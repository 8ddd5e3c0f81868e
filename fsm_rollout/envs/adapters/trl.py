"""TRL ``environment_factory`` classes as rollout environments: :func:`trl_env`.

What TRL's ``GRPOTrainer(environment_factory=...)`` does with such a class, done the same way per sample:

* one instance per sample, made by calling the class (or factory) with no arguments;
* ``reset(**row)`` with the sample's dataset row: ``{"prompt": ..., **sample.metadata["row"]}``. A string it
  returns is appended to the prompt's last message, as TRL appends it;
* the public methods (not ``reset``, ``get_reward`` or ``_private``) are the tools, their schemas built from the
  signatures and Google-style docstrings by ``transformers.utils.get_json_schema``, as TRL's chat template call
  builds them; they go in ``sample.metadata["tools"]``;
* each turn's text (without the end-of-turn token the model wrote last, ``<|im_end|>``) is the completion TRL's
  reward functions see, and its ``<tool_call>`` blocks (read by :func:`fsm_rollout.tokens.tool_calls.parse_tool_calls`)
  call the methods;
  each result comes back as a ``{"role": "tool", "name", "content"}`` message, ``str(result)``, or
  ``str({"error": ...})`` when the call raised, the tool is unknown or the block is unreadable, as TRL words it;
* a turn without tool calls ends the episode (``sample.metadata["env_stop"] = "no_tool_calls"``); the reward is
  ``get_reward()`` plus the ``reward_funcs`` given (TRL's reward functions, called with one-item lists of
  ``prompts``, ``completions``, ``environments`` and the row's columns), each weighted 1 as TRL weighs an
  environment's reward. It is also computed on the last turn the rollout allows, so a sample cut off by the
  turn limit is scored as TRL scores one cut off by ``max_tool_calling_iterations``, and a sample cut off by its
  token budget is scored when its environment is closed (``sample.reward`` set there).

Synchronous methods run in the environment worker pool, under the step timeout; coroutine methods are awaited.
Not supported: a dict of several environment factories (one adapter per factory), multimodal tool results (they
are sent as text).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from fsm_rollout.envs.adapters._common import (
    ENV_STOP_KEY,
    action_text,
    import_extra,
    max_turns_of,
    prompt_messages,
    reward_value,
    run_sync,
)
from fsm_rollout.errors import AdapterProtocolError
from fsm_rollout.tokens.tool_calls import parse_tool_calls

ADAPTER = "trl"
NOT_TOOLS = frozenset({"reset", "get_reward"})


def tool_methods(env: Any) -> list[Callable[..., Any]]:
    """The environment's tools as TRL picks them: the public functions of its class, by name, bound to it."""
    return [
        getattr(env, name)
        for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
        if name not in NOT_TOOLS and not name.startswith("_")
    ]


def tool_schemas(methods: Sequence[Callable[..., Any]]) -> list[dict[str, Any]]:
    """The tools' JSON schemas, as the chat template gets them from TRL (transformers builds them)."""
    utils = import_extra("transformers.utils", adapter=ADAPTER, package="transformers", extra="trl")
    schemas: list[dict[str, Any]] = []
    for method in methods:
        try:
            schemas.append(utils.get_json_schema(method))
        except Exception as error:  # transformers' DocstringParsingException / TypeHintParsingException
            raise AdapterProtocolError(
                ADAPTER, f"tool {method.__name__}", f"has no schema transformers can build: {error}"
            ) from None
    return schemas


async def _call(args: Any, function: Callable[..., Any], *call_args: Any, **kwargs: Any) -> Any:
    if inspect.iscoroutinefunction(function):
        return await function(*call_args, **kwargs)
    result = await run_sync(args, function, *call_args, **kwargs)
    return await result if inspect.isawaitable(result) else result


def _tool_message(name: str, result: Any) -> dict[str, Any]:
    return {"role": "tool", "name": name, "content": str(result)}


class TRLEpisode:
    """One sample's episode of a TRL environment class, behind the rollout's environment protocol."""

    def __init__(
        self, env: Any, *, sample: Any, args: Any, row: dict[str, Any], reward_funcs: Sequence[Callable[..., Any]]
    ) -> None:
        self.env = env
        self.sample = sample
        self.args = args
        self.row = row
        self.reward_funcs = list(reward_funcs)
        self.tools = {method.__name__: method for method in tool_methods(env)}
        self.completion: list[dict[str, Any]] = []
        self.turns = 0
        self.scored = False

    async def reset(self) -> None:
        """Nothing: ``reset(**row)`` ran when the episode was built (what it returns is part of the prompt)."""

    async def step(self, response_text: str) -> tuple[list[dict[str, Any]], bool, dict[str, Any]]:
        self.turns += 1
        text = action_text(response_text)
        self.completion.append({"role": "assistant", "content": text})
        parsed = parse_tool_calls(text)
        if not parsed.calls and not parsed.problems:
            self.sample.metadata[ENV_STOP_KEY] = "no_tool_calls"
            return [], True, {"reward": await self.reward()}
        results: list[dict[str, Any]] = []
        for block in parsed.blocks:
            if not hasattr(block, "arguments"):  # a block the parser could not read
                results.append(_tool_message(str(block.name or "unknown"), {"error": block.message}))
                continue
            method = self.tools.get(block.name)
            try:
                if method is None:
                    raise ValueError(f"Tool {block.name} not found.")
                result = await _call(self.args, method, **block.arguments)
            except Exception as error:  # as TRL: the error goes back to the model
                result = {"error": str(error)}
            results.append(_tool_message(block.name, result))
        self.completion.extend(results)
        info: dict[str, Any] = {}
        max_turns = max_turns_of(self.args)
        if max_turns is not None and self.turns >= max_turns:  # the rollout stops here: score it now
            info["reward"] = await self.reward()
        return results, False, info

    async def reward(self) -> float:
        """``get_reward()`` plus the reward functions, each weighted 1."""
        total = 0.0
        scores: dict[str, float] = {}
        get_reward = getattr(self.env, "get_reward", None)
        if callable(get_reward):
            scores[type(self.env).__name__] = reward_value(ADAPTER, "get_reward", await _call(self.args, get_reward))
        columns = {key: [value] for key, value in self.row.items() if key != "prompt"}
        for function in self.reward_funcs:
            name = getattr(function, "__name__", type(function).__name__)
            values = await _call(
                self.args,
                function,
                prompts=[self.row["prompt"]],
                completions=[list(self.completion)],
                environments=[self.env],
                **columns,
            )
            if not isinstance(values, list | tuple) or len(values) != 1:
                raise AdapterProtocolError(ADAPTER, f"reward function {name}", "must return a list of one reward")
            scores[name] = reward_value(ADAPTER, f"reward function {name}", values[0])
        total = sum(scores.values())
        self.scored = True
        self.sample.metadata[ADAPTER] = {"rewards": scores, "turns": self.turns}
        return total

    async def format_observation(self, observation: Any) -> list[dict[str, Any]]:
        return list(observation)

    async def close(self) -> None:
        if not self.scored and _ended_with_data(self.sample):  # cut off before a verdict (its budget ran out)
            self.sample.reward = await self.reward()
        close = getattr(self.env, "close", None)
        if callable(close):
            await _call(self.args, close)


def _ended_with_data(sample: Any) -> bool:
    """The sample ended completed or truncated (not failed or aborted): it is scored as it stands, as TRL scores
    a completion cut off by its length limit."""
    status = getattr(getattr(sample, "status", None), "value", None)
    return status in ("completed", "truncated")


def sample_row(sample: Any) -> dict[str, Any]:
    """The dataset row ``reset`` gets for ``sample``: its prompt (as messages) and ``sample.metadata["row"]``."""
    metadata = getattr(sample, "metadata", None) or {}
    row = dict(metadata.get("row") or {}) if isinstance(metadata, dict) else {}
    row["prompt"] = prompt_messages(sample.prompt)
    return row


def _with_reset_text(prompt: list[dict[str, Any]], observation: Any) -> list[dict[str, Any]]:
    """The prompt with what ``reset`` returned appended to its last message, as TRL appends it."""
    if observation is None:
        return prompt
    if not prompt:
        raise AdapterProtocolError(ADAPTER, "reset", "returned text for a sample without a prompt to append it to")
    content = prompt[-1]["content"]
    if isinstance(observation, str) and isinstance(content, str):
        content = content + observation
    elif isinstance(observation, str):
        content = [*content, {"type": "text", "text": observation}]
    elif isinstance(observation, list):
        content = [*([{"type": "text", "text": content}] if isinstance(content, str) else content), *observation]
    else:
        raise AdapterProtocolError(ADAPTER, "reset", f"returned {type(observation).__name__}, not None, str or list")
    return [*prompt[:-1], {**prompt[-1], "content": content}]


class TRLEnvFactory:
    """The ``build_env`` :func:`trl_env` returns (see the module docstring)."""

    def __init__(self, cls: Callable[[], Any], reward_funcs: Sequence[Callable[..., Any]] = ()) -> None:
        if not callable(cls):
            raise TypeError(f"trl_env takes an environment class or factory, got {type(cls).__name__}")
        self.cls = cls
        self.reward_funcs = list(reward_funcs)

    async def __call__(self, *, sample: Any, args: Any) -> TRLEpisode:
        env = await _call(args, self.cls)
        if not callable(getattr(env, "reset", None)):
            raise AdapterProtocolError(
                ADAPTER, "environment_factory()", f"returned {type(env).__name__}, which has no callable reset"
            )
        if not self.reward_funcs and not callable(getattr(env, "get_reward", None)):
            raise AdapterProtocolError(
                ADAPTER, "environment_factory()", f"returned {type(env).__name__}: no get_reward and no reward_funcs"
            )
        row = sample_row(sample)
        observation = await _call(args, env.reset, **row)
        episode = TRLEpisode(env, sample=sample, args=args, row=row, reward_funcs=self.reward_funcs)
        sample.prompt = _with_reset_text(row["prompt"], observation)
        schemas = tool_schemas(list(episode.tools.values()))
        if schemas:
            sample.metadata["tools"] = schemas
        return episode


def trl_env(cls: Callable[[], Any], reward_funcs: Sequence[Callable[..., Any]] = ()) -> TRLEnvFactory:
    """An environment factory (``build_env``) for a TRL ``environment_factory`` class (or zero-argument factory),
    rewarded by its ``get_reward`` and/or TRL-style ``reward_funcs``."""
    return TRLEnvFactory(cls, reward_funcs)
