"""Gymnasium and GEM text environments as rollout environments: :func:`gym_env`.

One episode per sample. The foreign environment is made and reset when the sample's environment is built, with the
seed ``sample.metadata["seed"]`` (else ``sample.index``), so a group's samples play the same game and a replay
gets the same one. The initial observation becomes the prompt's last user message (after the sample's own prompt
messages, if any, e.g. a system message); ``obs_to_text`` turns an observation into that text, called with
``(observation, info)`` when it takes two arguments (text games that keep their text in ``info``). Each turn's text,
without the end-of-turn token the model wrote last (``<|im_end|>``), goes through ``action_parser`` (default: the
text as it is) into ``env.step``; the next observation comes back as a user message. ``terminated`` ends the sample
``completed`` (reason ``env_done``); ``truncated`` (a time limit) ends it ``truncated`` with the reason
``env_truncated``; which one is also in ``sample.metadata["env_stop"]``. The rewards of the steps are summed
(``reward="sum"``) or the last one taken (``reward="last"``) into ``sample.reward``, every step, so a sample cut off
by the rollout's turn limit keeps what it earned; each step's reward is in ``sample.metadata["gym"]["rewards"]``.

An id is resolved when :func:`gym_env` is called, so a wrong one is an error before anything starts: Gymnasium's
registry, then its ``module:EnvId-v0`` form (``gymnasium.make`` imports ``module``, which registers the id), then
GEM's registry (``game:GuessTheNumber-v0-easy``).

Every call into the foreign environment runs in the environment worker pool, under the step timeout.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import re
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from fsm_rollout.envs.adapters._common import (
    ENV_STOP_KEY,
    action_text,
    describe,
    import_extra,
    prompt_messages,
    reward_value,
    root_logging_kept,
    run_sync,
)
from fsm_rollout.errors import AdapterProtocolError, EnvironmentNotFoundError

ADAPTER = "gym"
RewardMode = Literal["sum", "last"]


def _gymnasium() -> Any:
    return import_extra("gymnasium", adapter=ADAPTER, package="gymnasium", extra="gym")


def _gem() -> Any:
    with warnings.catch_warnings():
        # GEM imports cellpylib, whose source compiles with SyntaxWarnings ('is' with a literal) on every import that
        # finds no cached bytecode: noise on the user's terminal about code that is neither theirs nor ours
        warnings.simplefilter("ignore", SyntaxWarning)
        return import_extra("gem", adapter=ADAPTER, package="gem-llm", extra="gym")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a dotted name whose parent is no package, or an odd string
        return False


def _gem_may_register(prefix: str) -> bool:
    """Whether GEM may register ids under ``prefix:``, read from its installed source without importing it: some
    file of the package writes the prefix in a string (``"game:...``, ``f"rg:...``). True when GEM is not
    installed (its import then says how to install it) or its files cannot be read."""
    try:
        spec = importlib.util.find_spec("gem")
    except (ImportError, ValueError):
        return True
    if spec is None or not spec.submodule_search_locations:
        return True
    literal = re.compile(rb"""["']""" + re.escape(prefix.encode()) + rb":")
    try:
        return any(
            literal.search(path.read_bytes())
            for location in spec.submodule_search_locations
            for path in Path(location).rglob("*.py")
        )
    except OSError:
        return True


def gym_maker(env_id: str) -> Callable[..., Any]:
    """What makes ``env_id`` (see the module docstring), found now; an
    :class:`~fsm_rollout.errors.EnvironmentNotFoundError` naming what was tried when nothing registers it."""
    gymnasium = _gymnasium()
    if env_id in gymnasium.envs.registry:
        return functools.partial(gymnasium.make, env_id)
    module, colon, name = env_id.partition(":")
    if colon and module and name and _importable(module):
        # Gymnasium's own form: make() imports the module, whose import registers the id
        with root_logging_kept():
            importlib.import_module(module)
        if name not in gymnasium.envs.registry:
            raise EnvironmentNotFoundError(
                f"gym adapter: importing {module!r} registered no Gymnasium environment {name!r}", name=env_id
            )
        return functools.partial(gymnasium.make, env_id)
    # every GEM id has a prefix (game:, math:, ...): an id without one, or with one GEM's source never writes, is
    # not looked for there, sparing GEM's import (seconds) before the error
    gem = _gem() if colon and _gem_may_register(module) else None
    if gem is not None and env_id in gem.envs.registration.ENV_REGISTRY:
        return functools.partial(gem.make, env_id)
    hint = f" (no module {module!r} to import for the form module:EnvId)" if colon and module else ""
    raise EnvironmentNotFoundError(
        f"gym adapter: no Gymnasium or GEM environment is registered as {env_id!r}{hint}", name=env_id
    )


def make_gym_env(env_id: str, **kwargs: Any) -> Any:
    """Make ``env_id``: from Gymnasium's registry, its ``module:EnvId`` form, or GEM's registry."""
    return gym_maker(env_id)(**kwargs)


def takes_info(obs_to_text: Callable[..., Any]) -> bool:
    """Whether ``obs_to_text`` takes ``(observation, info)``: two positional parameters without defaults, or one
    named ``info``."""
    try:
        parameters = list(inspect.signature(obs_to_text).parameters.values())
    except (TypeError, ValueError):  # builtins such as str have no signature to read
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    return len(required) >= 2 or any(p.name == "info" for p in positional[1:])


def _default_text(observation: Any) -> str:
    if not isinstance(observation, str):
        raise AdapterProtocolError(
            ADAPTER,
            "env.reset/env.step",
            f"gave a {type(observation).__name__} observation; pass obs_to_text= to turn it into text",
        )
    return observation


class GymEpisode:
    """One sample's episode of a Gymnasium/GEM environment, behind the rollout's environment protocol."""

    def __init__(
        self,
        env: Any,
        *,
        sample: Any,
        args: Any,
        obs_to_text: Callable[..., str],
        action_parser: Callable[[str], Any] | None,
        reward: RewardMode,
    ) -> None:
        self.env = env
        self.sample = sample
        self.args = args
        self.obs_to_text = obs_to_text
        self.with_info = takes_info(obs_to_text)
        self.action_parser = action_parser
        self.reward_mode = reward
        self.rewards: list[float] = []

    async def start(self, seed: int | None) -> str:
        """Reset the foreign environment and return the initial observation's text."""
        result = await run_sync(self.args, self.env.reset, seed=seed)
        if not isinstance(result, tuple) or len(result) != 2:
            raise AdapterProtocolError(ADAPTER, "env.reset", f"returned {describe(result)}, not (observation, info)")
        return self._text(result[0], result[1])

    def _text(self, observation: Any, info: Any) -> str:
        text = self.obs_to_text(observation, info) if self.with_info else self.obs_to_text(observation)
        if not isinstance(text, str):
            raise AdapterProtocolError(ADAPTER, "obs_to_text", f"returned {type(text).__name__}, not str")
        return text

    async def reset(self) -> None:
        """Nothing: the episode was reset when it was built (its first observation is the prompt)."""

    async def step(self, response_text: str) -> tuple[str, bool, dict[str, Any]]:
        text = action_text(response_text)
        action = self.action_parser(text) if self.action_parser is not None else text
        result = await run_sync(self.args, self.env.step, action)
        if not isinstance(result, tuple) or len(result) != 5:
            raise AdapterProtocolError(
                ADAPTER,
                "env.step",
                f"returned {describe(result)}, not (observation, reward, terminated, truncated, info)",
            )
        observation, reward, terminated, truncated, step_info = result
        self.rewards.append(reward_value(ADAPTER, "env.step", reward))
        total = sum(self.rewards) if self.reward_mode == "sum" else self.rewards[-1]
        done = bool(terminated) or bool(truncated)
        record: dict[str, Any] = {"rewards": list(self.rewards)}
        info: dict[str, Any] = {"reward": total}
        if done:
            stop = "terminated" if terminated else "truncated"  # a terminal state reached counts over a time limit
            record["stop"] = stop
            self.sample.metadata[ENV_STOP_KEY] = stop
            info["truncated"] = stop == "truncated"
        self.sample.metadata[ADAPTER] = record
        return self._text(observation, step_info), done, info

    async def format_observation(self, observation: Any) -> dict[str, Any]:
        return {"role": "user", "content": str(observation)}

    async def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            await run_sync(self.args, close)


def episode_seed(sample: Any) -> int | None:
    """The seed a sample's episode is reset with: ``metadata["seed"]``, else the sample's index."""
    metadata = getattr(sample, "metadata", None) or {}
    seed = metadata.get("seed") if isinstance(metadata, Mapping) else None
    if seed is None:
        seed = getattr(sample, "index", None)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"gym adapter: the episode seed must be an integer, got {seed!r}")
    return seed


class GymEnvFactory:
    """The ``build_env`` :func:`gym_env` returns (see the module docstring)."""

    def __init__(
        self,
        env_id_or_factory: str | Callable[[], Any],
        obs_to_text: Callable[..., str] | None = None,
        action_parser: Callable[[str], Any] | None = None,
        *,
        reward: RewardMode = "sum",
        make_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if reward not in ("sum", "last"):
            raise ValueError(f"gym_env: reward must be 'sum' or 'last', got {reward!r}")
        self.maker: Callable[..., Any] | None = None
        if isinstance(env_id_or_factory, str):
            # a missing extra or an unknown id is an error now, not at the first sample
            self.maker = gym_maker(env_id_or_factory)
        elif not callable(env_id_or_factory):
            raise TypeError(f"gym_env takes an environment id or a factory, got {type(env_id_or_factory).__name__}")
        self.env_id_or_factory = env_id_or_factory
        self.obs_to_text = obs_to_text or _default_text
        self.action_parser = action_parser
        self.reward: RewardMode = reward
        self.make_kwargs = dict(make_kwargs or {})

    def _make(self) -> Any:
        if self.maker is not None:
            return self.maker(**self.make_kwargs)
        assert callable(self.env_id_or_factory)
        return self.env_id_or_factory()

    async def __call__(self, *, sample: Any, args: Any) -> GymEpisode:
        env = await run_sync(args, self._make)
        for method in ("reset", "step"):
            if not callable(getattr(env, method, None)):
                raise AdapterProtocolError(ADAPTER, "make", f"gave {type(env).__name__}, which has no {method}()")
        episode = GymEpisode(
            env,
            sample=sample,
            args=args,
            obs_to_text=self.obs_to_text,
            action_parser=self.action_parser,
            reward=self.reward,
        )
        text = await episode.start(episode_seed(sample))
        sample.prompt = [*prompt_messages(sample.prompt), {"role": "user", "content": text}]
        return episode


def gym_env(
    env_id_or_factory: str | Callable[[], Any],
    obs_to_text: Callable[..., str] | None = None,
    action_parser: Callable[[str], Any] | None = None,
    *,
    reward: RewardMode = "sum",
    make_kwargs: Mapping[str, Any] | None = None,
) -> GymEnvFactory:
    """An environment factory (``build_env``) for a Gymnasium or GEM environment: a registered id (Gymnasium's
    registry first, then its ``module:EnvId`` form, then GEM's; resolved now) or a zero-argument factory.
    ``obs_to_text`` turns an observation (and the ``info`` beside it, when it takes two arguments) into text
    (default: it must already be a string); ``action_parser`` turns a turn's text into the action (default: the text);
    ``make_kwargs`` go to ``make``."""
    return GymEnvFactory(env_id_or_factory, obs_to_text, action_parser, reward=reward, make_kwargs=make_kwargs)


def gym_samples(count: int, *, first_seed: int = 0) -> list[Any]:
    """``count`` samples, one episode each, seeded ``first_seed``, ``first_seed + 1``, ... (a Gymnasium or GEM
    environment has no dataset: the seed picks the game)."""
    from fsm_rollout.sample import Sample

    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"gym_samples: count must be a positive integer, got {count!r}")
    return [Sample(index=index, metadata={"seed": first_seed + index}) for index in range(count)]
