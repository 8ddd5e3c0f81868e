"""Scripted environments for tests: answers come from a script, every call is counted, faults on demand.

Usable directly (``env_factory=ScriptedEnvFactory(...)``) or by module path: ``env_path="fsm_rollout.testing.envs"``
loads :func:`build_env`, which reads the script from ``sample.metadata["scripted_env"]``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

CONTINUE = ("Continue the reasoning.", False)
"""The seed's end-to-end test environment answer: never done, always the same text observation."""


@dataclass
class ScriptedEnv:
    """An environment whose ``step`` results come from ``steps`` (then ``default`` forever).

    ``observations_as`` decides the message ``format_observation`` returns: ``"text"`` gives
    ``{"role": "user", "content": observation}``, ``"parts"`` a list with one text part. A dict observation, or a
    list of dicts (several messages, e.g. tool results), is returned unchanged (so tests can feed lists and
    non-text or malformed messages). ``raise_in`` maps a method name
    (``reset``, ``step``, ``format_observation``, ``close``) to an exception it raises.
    """

    steps: Sequence[tuple[Any, bool]] = ()
    default: tuple[Any, bool] = CONTINUE
    observations_as: str = "text"
    raise_in: Mapping[str, BaseException] = field(default_factory=dict)
    step_result: Any = None
    calls: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)

    def _call(self, name: str) -> None:
        self.calls.append(name)
        error = self.raise_in.get(name)
        if error is not None:
            raise error

    @property
    def close_count(self) -> int:
        """How often ``close`` was called."""
        return self.calls.count("close")

    def reset(self) -> None:
        self._call("reset")

    def step(self, response_text: str) -> Any:
        self._call("step")
        self.texts.append(response_text)
        if self.step_result is not None:
            return self.step_result
        index = len(self.texts) - 1
        observation, done = self.steps[index] if index < len(self.steps) else self.default
        return observation, done, {}

    def format_observation(self, observation: Any) -> Any:
        self._call("format_observation")
        if isinstance(observation, dict) or (
            isinstance(observation, list) and observation and all(isinstance(item, dict) for item in observation)
        ):
            return observation
        if self.observations_as == "parts":
            return {"role": "user", "content": [{"type": "text", "text": str(observation)}]}
        return {"role": "user", "content": str(observation)}

    def close(self) -> None:
        self._call("close")


@dataclass
class ScriptedEnvFactory:
    """A ``build_env`` that builds :class:`ScriptedEnv` instances with fixed settings and keeps them."""

    steps: Sequence[tuple[Any, bool]] = ()
    default: tuple[Any, bool] = CONTINUE
    observations_as: str = "text"
    raise_in: Mapping[str, BaseException] = field(default_factory=dict)
    step_result: Any = None
    build_error: BaseException | None = None
    built: list[ScriptedEnv] = field(default_factory=list)

    def __call__(self, *, sample: Any, args: Any) -> ScriptedEnv:
        if self.build_error is not None:
            raise self.build_error
        env = ScriptedEnv(
            steps=list(self.steps),
            default=self.default,
            observations_as=self.observations_as,
            raise_in=dict(self.raise_in),
            step_result=self.step_result,
        )
        self.built.append(env)
        return env

    @property
    def last(self) -> ScriptedEnv:
        """The most recently built environment."""
        return self.built[-1]


BUILT: list[ScriptedEnv] = []
"""Every environment :func:`build_env` built in this process, in order (for assertions)."""


def build_env(*, sample: Any, args: Any) -> ScriptedEnv:
    """Module-level ``build_env``: script from ``sample.metadata["scripted_env"]`` (``steps``, ``default``)."""
    script = dict((getattr(sample, "metadata", None) or {}).get("scripted_env") or {})
    env = ScriptedEnv(
        steps=[(observation, bool(done)) for observation, done in script.get("steps", [])],
        default=tuple(script.get("default", CONTINUE)),
        observations_as=script.get("observations_as", "text"),
    )
    BUILT.append(env)
    return env
