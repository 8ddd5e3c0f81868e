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

Weights: before each call whose ``trainer.state.global_step`` changed (the first one included) the engines get the
trainer's weights (``weight_sync``, see :mod:`fsm_rollout.adapters.trl_weights`), under the version
``str(global_step)``; every sample's ``weight_version`` in the answer is the version its first generated token was
sampled under (from the engine's answers), so a trainer can check that it trains on-policy.

A call in which every sample failed raises a :class:`~fsm_rollout.errors.RolloutError` naming the first failure
(TRL would otherwise train on empty completions).

The function is synchronous, as TRL calls it: it runs the rollouts on an event loop of its own for the call, so it
must not be called from a thread whose event loop is running.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fsm_rollout.adapters.trl_weights import UPDATE_WEIGHTS, TrainerWeights, WeightSync, remove_folder
from fsm_rollout.errors import ConfigError, RolloutError

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
                    "rollout_reason", "weight_version")
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
        answer["weight_version"].append(sample_weight_version(sample))
    return answer


def sample_weight_version(sample: Any) -> str | None:
    """The weight version a sample's first generated token was sampled under, as the engine labelled it."""
    metadata = sample.metadata or {}
    spans = metadata.get("weight_version_spans") or []
    version = spans[0].get("version") if spans and isinstance(spans[0], Mapping) else None
    if version is None:
        version = metadata.get("start_weight_version")
    return None if version is None else str(version)


def raise_if_all_failed(samples: Sequence[Any]) -> None:
    """A :class:`~fsm_rollout.errors.RolloutError` naming the first failure when every sample failed."""
    if not samples or any(sample.status.value != "failed" for sample in samples):
        return
    error = (samples[0].metadata or {}).get("rollout_error") or {}
    what = f"{error.get('type', 'error')}: {error.get('message', '(no message)')}" if error else "no error recorded"
    raise RolloutError(f"trl_rollout_func: all {len(samples)} samples of the call failed; the first: {what}")


def engine_url_list(engine_urls: str | Sequence[str] | None) -> list[str] | None:
    """``engine_urls`` as a list: a single string is one URL (not its characters)."""
    if engine_urls is None:
        return None
    if isinstance(engine_urls, str):
        return [engine_urls]
    urls = list(engine_urls)
    if not all(isinstance(url, str) and url for url in urls):
        raise ConfigError(f"trl_rollout_func: engine_urls must be URL strings, got {urls!r}")
    return urls


def trl_rollout_func(
    config: Any,
    *,
    sampling_params: Mapping[str, Any],
    tokenizer: Any = None,
    env_factory: Any = None,
    engine_urls: str | Sequence[str] | None = None,
    make_sample: Callable[[Any], Any] | None = None,
    concurrency: int = 64,
    seed: int | None = None,
    weight_sync: WeightSync | str | None = UPDATE_WEIGHTS,
) -> RolloutFunc:
    """The ``rollout_func`` for TRL's ``GRPOTrainer``: each call rolls the prompts out with a
    :class:`~fsm_rollout.RolloutRunner` built from ``config`` (a :class:`~fsm_rollout.RolloutConfig`),
    ``sampling_params``, ``tokenizer``, ``env_factory`` and ``engine_urls`` (a list, or one URL as a string), after
    pushing the trainer's weights when its step changed (``weight_sync``: ``"update_weights"``, a callable
    ``(trainer, version)`` or None; see :mod:`fsm_rollout.adapters.trl_weights`), as the module docstring says."""
    from fsm_rollout.runtime.runner import RolloutRunner
    from fsm_rollout.sample import Sample

    urls = engine_url_list(engine_urls)
    weights = TrainerWeights(weight_sync, config, urls or [config.engine_url])

    def build(prompt: Any) -> Any:
        return make_sample(prompt) if make_sample is not None else Sample(prompt=prompt)

    async def run(prompts: list[Any], group_size: int, trainer: Any, version: str | None) -> list[Any]:
        # Written before the runner starts: no engine connection waits on the file.
        folder = weights.prepare(trainer) if version is not None else None
        try:
            return await rollouts(prompts, group_size, trainer, version, folder)
        finally:
            remove_folder(folder)

    async def rollouts(
        prompts: list[Any], group_size: int, trainer: Any, version: str | None, folder: Any
    ) -> list[Any]:
        done: list[Any] = []
        async with RolloutRunner(
            config,
            sampling_params=sampling_params,
            tokenizer=tokenizer,
            env_factory=env_factory,
            engine_urls=urls,
        ) as runner:
            if version is not None:
                async with runner.weight_update(version=version):
                    await weights.push(trainer, version, folder)
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
        samples = asyncio.run(run(list(prompts), group_size, trainer, weights.due(trainer)))
        raise_if_all_failed(samples)
        return trl_answer(samples)

    return rollout_func
