"""Gymnasium and GEM text environments as rollout environments: :func:`gym_env`.

One episode per sample. The foreign environment is made and reset when the sample's environment is built, with the
seed ``sample.metadata["seed"]`` (else ``sample.index``), so a group's samples play the same game and a replay
gets the same one. The initial observation becomes the prompt's last user message (after the sample's own prompt
messages, if any, e.g. a system message). Each turn's text goes through ``action_parser`` (default: the text as
it is) into ``env.step``; the next observation comes back as a user message. ``terminated`` and ``truncated`` both
end the episode; which one is in ``sample.metadata["env_stop"]``. The rewards of the steps are summed
(``reward="sum"``) or the last one taken (``reward="last"``) into ``sample.reward``, every step, so a sample cut off
by the rollout's turn limit keeps what it earned; each step's reward is in ``sample.metadata["gym"]["rewards"]``.

Every call into the foreign environment runs in the environment worker pool, under the step timeout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

from fsm_rollout.adapters._common import (
    ENV_STOP_KEY,
    describe,
    import_extra,
    prompt_messages,
    reward_value,
    run_sync,
)
from fsm_rollout.errors import AdapterProtocolError, EnvironmentNotFoundError

ADAPTER = "gym"
RewardMode = Literal["sum", "last"]


def _gymnasium() -> Any:
    return import_extra("gymnasium", adapter=ADAPTER, package="gymnasium", extra="gym")


def _gem() -> Any:
    return import_extra("gem", adapter=ADAPTER, package="gem-llm", extra="gym")


def make_gym_env(env_id: str, **kwargs: Any) -> Any:
    """Make ``env_id`` from Gymnasium's registry, else from GEM's (``game:GuessTheNumber-v0-easy``, ...)."""
    gymnasium = _gymnasium()
    if env_id in gymnasium.envs.registry:
        return gymnasium.make(env_id, **kwargs)
    gem = _gem()
    registry = gem.envs.registration.ENV_REGISTRY
    if env_id in registry:
        return gem.make(env_id, **kwargs)
    raise EnvironmentNotFoundError(
        f"gym adapter: no Gymnasium or GEM environment is registered as {env_id!r}", name=env_id
    )


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
        obs_to_text: Callable[[Any], str],
        action_parser: Callable[[str], Any] | None,
        reward: RewardMode,
    ) -> None:
        self.env = env
        self.sample = sample
        self.args = args
        self.obs_to_text = obs_to_text
        self.action_parser = action_parser
        self.reward_mode = reward
        self.rewards: list[float] = []

    async def start(self, seed: int | None) -> str:
        """Reset the foreign environment and return the initial observation's text."""
        result = await run_sync(self.args, self.env.reset, seed=seed)
        if not isinstance(result, tuple) or len(result) != 2:
            raise AdapterProtocolError(ADAPTER, "env.reset", f"returned {describe(result)}, not (observation, info)")
        return self._text(result[0])

    def _text(self, observation: Any) -> str:
        text = self.obs_to_text(observation)
        if not isinstance(text, str):
            raise AdapterProtocolError(ADAPTER, "obs_to_text", f"returned {type(text).__name__}, not str")
        return text

    async def reset(self) -> None:
        """Nothing: the episode was reset when it was built (its first observation is the prompt)."""

    async def step(self, response_text: str) -> tuple[str, bool, dict[str, Any]]:
        action = self.action_parser(response_text) if self.action_parser is not None else response_text
        result = await run_sync(self.args, self.env.step, action)
        if not isinstance(result, tuple) or len(result) != 5:
            raise AdapterProtocolError(
                ADAPTER,
                "env.step",
                f"returned {describe(result)}, not (observation, reward, terminated, truncated, info)",
            )
        observation, reward, terminated, truncated, _info = result
        self.rewards.append(reward_value(ADAPTER, "env.step", reward))
        total = sum(self.rewards) if self.reward_mode == "sum" else self.rewards[-1]
        done = bool(terminated) or bool(truncated)
        record: dict[str, Any] = {"rewards": list(self.rewards)}
        if done:
            stop = "terminated" if terminated else "truncated"
            record["stop"] = stop
            self.sample.metadata[ENV_STOP_KEY] = stop
        self.sample.metadata[ADAPTER] = record
        return self._text(observation), done, {"reward": total}

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
        obs_to_text: Callable[[Any], str] | None = None,
        action_parser: Callable[[str], Any] | None = None,
        *,
        reward: RewardMode = "sum",
        make_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if reward not in ("sum", "last"):
            raise ValueError(f"gym_env: reward must be 'sum' or 'last', got {reward!r}")
        if isinstance(env_id_or_factory, str):
            _gymnasium()  # a missing extra is an error now, not at the first sample
        elif not callable(env_id_or_factory):
            raise TypeError(f"gym_env takes an environment id or a factory, got {type(env_id_or_factory).__name__}")
        self.env_id_or_factory = env_id_or_factory
        self.obs_to_text = obs_to_text or _default_text
        self.action_parser = action_parser
        self.reward: RewardMode = reward
        self.make_kwargs = dict(make_kwargs or {})

    def _make(self) -> Any:
        if isinstance(self.env_id_or_factory, str):
            return make_gym_env(self.env_id_or_factory, **self.make_kwargs)
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
    obs_to_text: Callable[[Any], str] | None = None,
    action_parser: Callable[[str], Any] | None = None,
    *,
    reward: RewardMode = "sum",
    make_kwargs: Mapping[str, Any] | None = None,
) -> GymEnvFactory:
    """An environment factory (``build_env``) for a Gymnasium or GEM environment: a registered id (Gymnasium's
    registry first, then GEM's) or a zero-argument factory. ``obs_to_text`` turns an observation into text (default:
    it must already be a string); ``action_parser`` turns a turn's text into the action (default: the text);
    ``make_kwargs`` go to ``make``."""
    return GymEnvFactory(env_id_or_factory, obs_to_text, action_parser, reward=reward, make_kwargs=make_kwargs)


def gym_samples(count: int, *, first_seed: int = 0) -> list[Any]:
    """``count`` samples, one episode each, seeded ``first_seed``, ``first_seed + 1``, ... (a Gymnasium or GEM
    environment has no dataset: the seed picks the game)."""
    from fsm_rollout.sample import Sample

    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"gym_samples: count must be a positive integer, got {count!r}")
    return [Sample(index=index, metadata={"seed": first_seed + index}) for index in range(count)]
