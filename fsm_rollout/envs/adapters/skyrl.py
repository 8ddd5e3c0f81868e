"""skyrl-gym environments as rollout environments: :func:`skyrl_env`.

A skyrl-gym environment is made per sample with ``env_config`` and the sample's ``extras``. ``env_config`` is read
by attribute (``env_config.search_url``), so a dict is wrapped as skyrl wraps it, in an OmegaConf ``DictConfig``
(omegaconf is a skyrl-gym dependency). ``extras`` is ``sample.metadata["extras"]`` (a skyrl dataset row's
``reward_spec``, ``extra_info``, ...), where a missing ``reward_spec`` is filled from ``sample.label`` as
``{"method": "rule", "ground_truth": label}``, and a missing ``reward_model`` (which ``aime`` reads instead) as
``{"style": "rule", "ground_truth": label}``. ``init(prompt)`` runs when the sample's environment is built and its
prompt becomes the sample's. Each turn's text, without the end-of-turn token the model wrote last (``<|im_end|>``),
goes to ``step``, whose ``{observations, reward, done, metadata}`` give the next observation messages, the end of the
episode (``sample.metadata["env_stop"] = "done"``) and the turn's reward; the rewards are summed (``reward="sum"``,
skyrl's per-turn rewards) or the last one taken into ``sample.reward``, every turn. The turns' rewards and metadata
and, at the end, ``get_metrics()`` are in ``sample.metadata["skyrl"]``.

skyrl-gym is synchronous: every call runs in the environment worker pool, under the step timeout.
``postprocessed_action`` is not used: the tokens the model generated stay as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

from fsm_rollout.envs.adapters._common import (
    ENV_STOP_KEY,
    action_text,
    describe,
    import_extra,
    jsonable_items,
    prompt_messages,
    reward_value,
    run_sync,
)
from fsm_rollout.errors import AdapterProtocolError, EnvironmentNotFoundError

ADAPTER = "skyrl"
RewardMode = Literal["sum", "last"]


def _skyrl_gym() -> Any:
    return import_extra("skyrl_gym", adapter=ADAPTER, package="skyrl-gym", extra="skyrl")


def sample_extras(sample: Any) -> dict[str, Any]:
    """The ``extras`` a skyrl-gym environment is made with for ``sample`` (see the module docstring)."""
    metadata = getattr(sample, "metadata", None) or {}
    extras = dict(metadata.get("extras") or {}) if isinstance(metadata, Mapping) else {}
    label = getattr(sample, "label", None)
    if "reward_spec" not in extras and label is not None:
        extras["reward_spec"] = {"method": "rule", "ground_truth": label}
    if "reward_model" not in extras and label is not None:  # aime reads the label from there
        extras["reward_model"] = {"style": "rule", "ground_truth": label}
    extras.setdefault("extra_info", {})
    return extras


class SkyRLEpisode:
    """One sample's episode of a skyrl-gym environment, behind the rollout's environment protocol."""

    def __init__(self, env: Any, *, sample: Any, args: Any, reward: RewardMode) -> None:
        self.env = env
        self.sample = sample
        self.args = args
        self.reward_mode = reward
        self.rewards: list[float] = []
        self.step_metadata: list[dict[str, Any]] = []

    async def start(self) -> list[dict[str, Any]]:
        """``init`` the environment with the sample's prompt; the prompt it gives back."""
        result = await run_sync(self.args, self.env.init, prompt_messages(self.sample.prompt))
        if not isinstance(result, tuple) or len(result) != 2:
            raise AdapterProtocolError(ADAPTER, "env.init", f"returned {describe(result)}, not (prompt, metadata)")
        prompt, _metadata = result
        if not isinstance(prompt, list) or not all(isinstance(message, Mapping) for message in prompt):
            raise AdapterProtocolError(ADAPTER, "env.init", f"returned a {type(prompt).__name__} prompt, not messages")
        return [dict(message) for message in prompt]

    async def reset(self) -> None:
        """Nothing: ``init`` ran when the episode was built (it gives the prompt)."""

    async def step(self, response_text: str) -> tuple[list[dict[str, Any]], bool, dict[str, Any]]:
        output = await run_sync(self.args, self.env.step, action_text(response_text))
        if not isinstance(output, Mapping) or not {"observations", "reward", "done"} <= set(output):
            raise AdapterProtocolError(
                ADAPTER, "env.step", f"returned {describe(output)}, not a dict of observations, reward, done, metadata"
            )
        observations = output["observations"] or []
        if not isinstance(observations, list) or not all(isinstance(message, Mapping) for message in observations):
            raise AdapterProtocolError(ADAPTER, "env.step", "returned observations that are not a list of messages")
        reward = output["reward"]
        self.rewards.append(0.0 if reward is None else reward_value(ADAPTER, "env.step", reward))
        self.step_metadata.append(jsonable_items(output.get("metadata") or {}))
        done = bool(output["done"])
        record: dict[str, Any] = {"rewards": list(self.rewards), "metadata": list(self.step_metadata)}
        if done:
            get_metrics = getattr(self.env, "get_metrics", None)
            if callable(get_metrics):
                record["metrics"] = jsonable_items(await run_sync(self.args, get_metrics))
            self.sample.metadata[ENV_STOP_KEY] = "done"
        elif not observations:
            raise AdapterProtocolError(ADAPTER, "env.step", "returned no observations for an episode that goes on")
        self.sample.metadata[ADAPTER] = record
        total = sum(self.rewards) if self.reward_mode == "sum" else self.rewards[-1]
        return [dict(message) for message in observations], done, {"reward": total}

    async def format_observation(self, observation: Any) -> list[dict[str, Any]]:
        return list(observation)

    async def close(self) -> None:
        await run_sync(self.args, self.env.close)


def attribute_config(env_config: Any) -> Any:
    """``env_config`` as skyrl-gym environments read it (by attribute): a mapping becomes an OmegaConf
    ``DictConfig``, as skyrl builds it; anything else (None, a DictConfig, a dataclass) is passed as it is."""
    if not isinstance(env_config, Mapping):
        return env_config
    omegaconf = import_extra("omegaconf", adapter=ADAPTER, package="skyrl-gym", extra="skyrl")
    if isinstance(env_config, omegaconf.DictConfig):
        return env_config
    return omegaconf.OmegaConf.create(dict(env_config))


class SkyRLEnvFactory:
    """The ``build_env`` :func:`skyrl_env` returns (see the module docstring)."""

    def __init__(
        self,
        name_or_env: str | Callable[..., Any],
        env_config: Any = None,
        *,
        reward: RewardMode = "sum",
    ) -> None:
        if reward not in ("sum", "last"):
            raise ValueError(f"skyrl_env: reward must be 'sum' or 'last', got {reward!r}")
        if isinstance(name_or_env, str):
            registry = _skyrl_gym().envs.registration.registry
            if name_or_env not in registry:
                raise EnvironmentNotFoundError(
                    f"skyrl adapter: no skyrl-gym environment is registered as {name_or_env!r}; "
                    f"registered: {', '.join(sorted(registry))}",
                    name=name_or_env,
                )
        elif not callable(name_or_env):
            raise TypeError(f"skyrl_env takes an environment name or class, got {type(name_or_env).__name__}")
        self.name_or_env = name_or_env
        self.env_config = attribute_config(env_config)
        self.reward: RewardMode = reward

    def _make(self, extras: dict[str, Any]) -> Any:
        try:
            if isinstance(self.name_or_env, str):
                return _skyrl_gym().make(self.name_or_env, env_config=self.env_config, extras=extras)
            return self.name_or_env(env_config=self.env_config, extras=extras)
        except AttributeError as error:
            if self.env_config is not None:
                raise
            # an environment that reads settings from its config (search's search_url) got none
            name = self.name_or_env if isinstance(self.name_or_env, str) else self.name_or_env.__name__
            raise AdapterProtocolError(
                ADAPTER,
                "make",
                f"of {name!r} read its env_config, and none was given ({error}): pass env_config= to skyrl_env "
                "(--env-args JSON on the command line)",
            ) from error

    async def __call__(self, *, sample: Any, args: Any) -> SkyRLEpisode:
        env = await run_sync(args, self._make, sample_extras(sample))
        for method in ("init", "step", "close"):
            if not callable(getattr(env, method, None)):
                raise AdapterProtocolError(ADAPTER, "make", f"gave {type(env).__name__}, which has no {method}()")
        episode = SkyRLEpisode(env, sample=sample, args=args, reward=self.reward)
        sample.prompt = await episode.start()
        return episode


def skyrl_env(
    name_or_env: str | Callable[..., Any], env_config: Any = None, *, reward: RewardMode = "sum"
) -> SkyRLEnvFactory:
    """An environment factory (``build_env``) for a skyrl-gym environment: a registered name (``gsm8k``,
    ``gsm8k_multi_turn``, ...) or a class called as ``cls(env_config=..., extras=...)``; a dict ``env_config``
    becomes an OmegaConf ``DictConfig``, which skyrl-gym environments read by attribute."""
    return SkyRLEnvFactory(name_or_env, env_config, reward=reward)
