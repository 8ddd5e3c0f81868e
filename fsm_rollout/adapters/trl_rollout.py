"""fsm-rollout as TRL's rollout engine: :func:`trl_rollout_func` builds the function ``GRPOTrainer(rollout_func=...)``
takes.

TRL calls it with the process's slice of prompts, each repeated ``num_generations`` times in a row (its sampler's
groups), and the trainer. Each run of equal prompts is rolled out as one group (:meth:`RolloutRunner.run_group`:
one group index, a session each, seeds ``seed + member`` when ``seed`` is given), every sample through the
environment and the engine as :class:`~fsm_rollout.RolloutRunner` runs them. The answer holds, per sample:

* ``prompt_ids``: the prompt's tokens; ``completion_ids``: the response side (the model's turns and the
  observations between them); ``logprobs``: one per response token (observation tokens 0.0);
* ``env_mask``: the loss mask (1 for the model's tokens, 0 for the observations'), which TRL uses as its tool mask;
* extra keys, passed by TRL to every reward function: ``env_reward`` (the environment's ``sample.reward`` as a
  float, None when it gave none, which TRL ignores), ``rollout_status`` and ``rollout_reason``.

:func:`env_reward` is a TRL reward function that returns ``env_reward``. TRL passes only the prompts: ``make_sample``
turns one into the :class:`~fsm_rollout.Sample` to run (default: the prompt and nothing else), e.g. to look up its
label.

The function is synchronous, as TRL calls it: it runs the rollouts on an event loop of its own for the call, so it
must not be called from a thread whose event loop is running.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fsm_rollout.errors import RolloutError

RolloutFunc = Callable[[list[Any], Any], dict[str, list[Any]]]


def env_reward(env_reward: Sequence[float | None], **_: Any) -> list[float | None]:
    """A TRL reward function: the environment's reward of each completion (None where it gave none)."""
    return list(env_reward)


def _groups(prompts: Sequence[Any], size: int) -> list[tuple[Any, int]]:
    """Runs of equal consecutive prompts, each at most ``size`` long: ``(prompt, count)``."""
    runs: list[tuple[Any, int]] = []
    for prompt in prompts:
        if runs and runs[-1][0] == prompt and runs[-1][1] < size:
            runs[-1] = (prompt, runs[-1][1] + 1)
        else:
            runs.append((prompt, 1))
    return runs


def _reward(value: Any) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def trl_answer(samples: Sequence[Any]) -> dict[str, list[Any]]:
    """The dict TRL's ``rollout_func`` returns, from finished samples (see the module docstring)."""
    answer: dict[str, list[Any]] = {
        key: []
        for key in ("prompt_ids", "completion_ids", "logprobs", "env_mask", "env_reward", "rollout_status",
                    "rollout_reason")
    }  # fmt: skip
    for sample in samples:
        length = sample.response_length
        split = len(sample.tokens) - length
        answer["prompt_ids"].append(list(sample.tokens[:split]))
        answer["completion_ids"].append(list(sample.tokens[split:]))
        answer["logprobs"].append([float(value) for value in (sample.rollout_log_probs or [0.0] * length)])
        answer["env_mask"].append([int(value) for value in (sample.loss_mask or [1] * length)])
        answer["env_reward"].append(_reward(sample.reward))
        answer["rollout_status"].append(sample.status.value)
        answer["rollout_reason"].append((sample.metadata or {}).get("rollout_reason"))
    return answer


def trl_rollout_func(
    config: Any,
    *,
    sampling_params: Mapping[str, Any],
    tokenizer: Any = None,
    env_factory: Any = None,
    engine_urls: Sequence[str] | None = None,
    make_sample: Callable[[Any], Any] | None = None,
    concurrency: int = 64,
    seed: int | None = None,
) -> RolloutFunc:
    """The ``rollout_func`` for TRL's ``GRPOTrainer``: each call rolls the prompts out with a
    :class:`~fsm_rollout.RolloutRunner` built from ``config`` (a :class:`~fsm_rollout.RolloutConfig`),
    ``sampling_params``, ``tokenizer``, ``env_factory`` and ``engine_urls``, as the module docstring says."""
    from fsm_rollout.runner import RolloutRunner
    from fsm_rollout.sample import Sample

    def build(prompt: Any) -> Any:
        return make_sample(prompt) if make_sample is not None else Sample(prompt=prompt)

    async def run(prompts: list[Any], group_size: int) -> list[Any]:
        done: list[Any] = []
        async with RolloutRunner(
            config,
            sampling_params=sampling_params,
            tokenizer=tokenizer,
            env_factory=env_factory,
            engine_urls=engine_urls,
        ) as runner:
            groups = []
            for index, (prompt, count) in enumerate(_groups(prompts, group_size)):
                sample = build(prompt)
                if sample.index is None:
                    sample.index = index
                groups.append(runner.run_group(sample, count, concurrency=concurrency, seed=seed))
            for members in await asyncio.gather(*groups):
                done.extend(members)
        return done

    def rollout_func(prompts: list[Any], trainer: Any = None) -> dict[str, list[Any]]:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RolloutError("trl_rollout_func runs its own event loop: call it from a thread without a running one")
        group_size = 1
        if trainer is not None:
            training = getattr(getattr(trainer, "model", None), "training", True)
            group_size = int(getattr(trainer, "num_generations" if training else "num_generations_eval", 1) or 1)
        return trl_answer(asyncio.run(run(list(prompts), group_size)))

    return rollout_func
