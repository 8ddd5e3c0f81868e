"""Internal: keeping the engine on the trainer's weights for :func:`~fsm_rollout.adapters.trl_rollout_func`.

TRL's ``GRPOTrainer`` syncs no weights to a ``rollout_func``'s engine (only to its own vLLM, with ``use_vllm=True``),
so without a push here the engine keeps sampling from the initial model and training is off-policy.
:class:`TrainerWeights` pushes the trainer's weights before each call whose ``trainer.state.global_step`` differs from
the one last pushed (the first call included), under the version ``str(global_step)``:

* ``weight_sync="update_weights"`` (the default): the trainer's parameters are written to a ``.safetensors`` file
  and every engine gets ``POST /update_weights {"update_info": {"path": FILE, "weight_version": VERSION}}``, the
  embedded engine's payload (it loads the file between two decode steps, see
  :meth:`~fsm_rollout.engine.local.LocalEngine.load_weights`). The engine must see the file (same machine). An
  engine that refuses it (vLLM takes its weight-transfer backend's payload instead) is a
  :class:`~fsm_rollout.errors.RolloutError` saying to pass a callable.
* a callable ``weight_sync(trainer, version)`` (sync or async) pushes them itself, e.g. through vLLM's weight-transfer
  endpoints (``/init_weight_transfer_engine``, ``/update_weights`` with an NCCL broadcast alongside).
* ``None``: nothing is pushed (the caller keeps the engine in step, or trains off-policy knowingly).

Either push runs inside :meth:`RolloutRunner.weight_update(version) <fsm_rollout.RolloutRunner.weight_update>`, which
then sets every engine's weight version, so the answers label each token with it.
"""

from __future__ import annotations

import inspect
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

from fsm_rollout.errors import ConfigError, EngineHTTPError, RolloutError

WeightSync = Callable[[Any, str], Any]
"""``weight_sync(trainer, version)``: push the trainer's current weights to the engines (may be a coroutine)."""

UPDATE_WEIGHTS: Final = "update_weights"
WEIGHTS_FILE: Final = "model.safetensors"


def check_weight_sync(weight_sync: Any) -> None:
    """Refuse a ``weight_sync`` that is neither ``"update_weights"``, ``None`` nor a callable."""
    if weight_sync is None or weight_sync == UPDATE_WEIGHTS or callable(weight_sync):
        return
    raise ConfigError(
        f"trl_rollout_func: weight_sync must be 'update_weights', None or a callable (trainer, version); "
        f"got {weight_sync!r}"
    )


def trainer_step(trainer: Any) -> int | None:
    """``trainer.state.global_step``, when the trainer has one."""
    step = getattr(getattr(trainer, "state", None), "global_step", None)
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def trainer_state_dict(trainer: Any) -> dict[str, Any]:
    """The trainer's model parameters as CPU tensors of their own (tied parameters copied apart, so safetensors takes
    them), from the model unwrapped of its accelerate wrapper."""
    accelerator = getattr(trainer, "accelerator", None)
    processes = getattr(accelerator, "num_processes", 1)
    if isinstance(processes, int) and processes > 1:
        raise RolloutError(
            f"trl_rollout_func: the trainer runs {processes} processes; weight_sync='update_weights' pushes from one "
            "process only. Pass weight_sync=callable(trainer, version) that gathers and pushes the weights once"
        )
    model = trainer.model
    if accelerator is not None and hasattr(accelerator, "unwrap_model"):
        model = accelerator.unwrap_model(model)
    return {name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in model.state_dict().items()}


class TrainerWeights:
    """Which trainer step the engines hold, and the push that brings them to the trainer's current one."""

    def __init__(self, weight_sync: WeightSync | str | None, config: Any, engine_urls: Sequence[str]) -> None:
        check_weight_sync(weight_sync)
        self.weight_sync = weight_sync
        self.config = config
        # The servers behind a router are the ones that hold weights (the runner's weight updates reach them too).
        self.urls = list(getattr(config, "servers_behind_router", ()) or engine_urls)
        self.synced_step: int | None = None
        self.pushes = 0

    def due(self, trainer: Any) -> str | None:
        """The version to push before this call (``str(global_step)``), or None when the engines hold it."""
        if self.weight_sync is None or trainer is None:
            return None
        step = trainer_step(trainer)
        if step is None or step == self.synced_step:
            return None
        return str(step)

    def prepare(self, trainer: Any) -> Path | None:
        """For the default push: the folder holding the trainer's weights as one safetensors file (written now,
        before the runner starts, so the engines wait for no file)."""
        if self.weight_sync != UPDATE_WEIGHTS:
            return None
        from safetensors.torch import save_file

        folder = Path(tempfile.mkdtemp(prefix="fsm-rollout-trl-weights-"))
        try:
            save_file(trainer_state_dict(trainer), str(folder / WEIGHTS_FILE))
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return folder

    async def push(self, trainer: Any, version: str, folder: Path | None) -> None:
        """Push the weights (called inside the runner's ``weight_update(version)``)."""
        if folder is None:
            assert callable(self.weight_sync)
            pushed = self.weight_sync(trainer, version)
            if inspect.isawaitable(pushed):
                await pushed
        else:
            await self._post(str(folder / WEIGHTS_FILE), version)
        self.synced_step = int(version)
        self.pushes += 1

    async def _post(self, path: str, version: str) -> None:
        import asyncio

        from fsm_rollout.engine.client import VLLMClient
        from fsm_rollout.engine.schema import UPDATE_WEIGHTS_PATH

        async def post(url: str) -> None:
            async with VLLMClient.from_config(self.config, base_url=url) as client:
                try:
                    await client.post_json(
                        UPDATE_WEIGHTS_PATH, {"update_info": {"path": path, "weight_version": version}}
                    )
                except EngineHTTPError as error:
                    raise RolloutError(
                        f"trl_rollout_func: the engine at {url} refused the trainer's weights "
                        f"(POST {UPDATE_WEIGHTS_PATH}: {error.status} {error.body[:300]}). "
                        "weight_sync='update_weights' sends the embedded engine's payload (a local .safetensors "
                        "path); for vLLM pass "
                        "weight_sync=callable(trainer, version) that pushes through its weight-transfer backend"
                    ) from error

        await asyncio.gather(*(post(url) for url in self.urls))


def remove_folder(folder: Path | None) -> None:
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
