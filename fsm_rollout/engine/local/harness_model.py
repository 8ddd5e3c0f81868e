"""The embedded engine's harness model: the tiny Qwen2 trained to drive Codex CLI and Claude Code through the gateway.

Given a harness's real prompt (its system prompt, tools and environment as the gateway renders them on the embedded
engine) with a task "create a file named NAME containing TEXT", the model calls the harness's shell tool once in
that harness's argument format (Codex's ``exec_command`` with ``cmd``, Claude Code's ``Bash`` with ``command``),
then, after the tool's report, answers a short sentence and ends its turn. The conversations are written by
:mod:`~fsm_rollout.engine.local.harness_data` from the harnesses' recorded requests.

The prompts are long (thousands of tokens) and only the endings are trained, so a step runs the model's body over
each conversation's prompt once without gradients (its keys and values kept) and trains on the endings alone, over
that cache; the caches are computed again now and then (``refresh_at``) from the weights being trained, and
the loss is taken on the endings' positions only, over the vocabulary the conversations use (the other embedding
rows are zero, as the default model's are, so their logits are exactly 0).

Built once (a child process, deterministic, killed when the caller stops the build), published as
``<cache>/tiny-qwen2-harness-<key>`` by one atomic rename; the key hashes the recipe, the shipped templates and the
source of this module and the data module.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any, Final

from fsm_rollout.engine.local import harness_data
from fsm_rollout.engine.local.build_watch import BuildEstimate, end_when_stopped, progress_report, train_threads
from fsm_rollout.engine.local.cache import cache_dir
from fsm_rollout.engine.local.default_model import BuildInterrupted, BuildProgress
from fsm_rollout.engine.local.errors import ModelLoadError
from fsm_rollout.engine.local.tiny import BUILD_MARKER, tiny_model_dir

__all__ = ["HARNESS_MODEL_NAME", "HARNESS_RECIPE", "harness_model_dir", "harness_model_key"]

HARNESS_MODEL_NAME: Final = "tiny-qwen2-harness"
"""The served model name of the harness model (the cache directory adds the key)."""

HARNESS_RECIPE: Final[dict[str, Any]] = {
    "version": 1,
    "conversations": {"codex": 64, "claude": 16},
    "environments": 3,
    "data_seed": 4_217,
    "torch_seed": 23,
    "steps": 600,
    "batch_size": 1,
    "learning_rate": 6e-3,
    "warmup_steps": 10,
    "refresh_at": [1, 50, 200, 420],
    "prompt_tail": 64,
    "drills": 2000,
    "drills_per_step": 4,
}
"""Everything the weights depend on besides the code and the shipped templates (``conversations``: per harness;
a Claude Code conversation costs more, since its task is followed by a long system message that each refresh
computes again)."""


def harness_model_key(recipe: dict[str, Any] = HARNESS_RECIPE) -> str:
    """The build's cache key: the recipe, the shipped templates, this module's and the data module's source."""
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode())
    for path in (harness_data.SHIPPED_TEMPLATES, pathlib.Path(harness_data.__file__), pathlib.Path(__file__)):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def harness_model_dir(
    cache: pathlib.Path | None = None,
    *,
    log: Callable[[str], None] | None = None,
    progress: Callable[[BuildProgress], None] | None = None,
    stop: threading.Event | None = None,
) -> pathlib.Path:
    """Build (once) and return the harness model's directory; a finished build returns at once.

    ``log``, ``progress`` and ``stop`` are as the default model build's
    (:func:`~fsm_rollout.engine.local.default_model.train_model_dir`).

    Raises:
        ModelLoadError: If the build fails, or the target exists but is not a complete build.
        BuildInterrupted: If ``stop`` was set during the build.
    """
    root = cache if cache is not None else cache_dir()
    key = harness_model_key()
    target = root / f"{HARNESS_MODEL_NAME}-{key}"
    if (target / BUILD_MARKER).is_file():
        return target
    base = tiny_model_dir(root)
    if log is not None:
        log(f"training the harness model once ({HARNESS_RECIPE['steps']} steps on the CPU; cached in {target})")
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
    try:
        _train_in_child(staging, base, key, progress, stop)
        staging.chmod(0o755)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / BUILD_MARKER).is_file():
                raise ModelLoadError(
                    f"{target} exists but is not a complete model build; delete it and retry"
                ) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _train_in_child(
    directory: pathlib.Path,
    base: pathlib.Path,
    key: str,
    progress: Callable[[BuildProgress], None] | None,
    stop: threading.Event | None,
) -> None:
    """Train in a child process (this process keeps its torch settings); its progress lines become
    :class:`BuildProgress`; ``stop`` or an interruption of this call kills it."""
    if stop is not None and stop.is_set():
        raise BuildInterrupted("the harness model's build was interrupted before training started")
    command = [sys.executable, "-m", __name__, str(directory), str(base), key, str(train_threads())]
    started = time.monotonic()
    estimate = BuildEstimate()
    with tempfile.TemporaryFile("w+", encoding="utf-8") as errors:
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True)
        assert child.stdout is not None  # stdout=PIPE
        if stop is not None:
            threading.Thread(target=end_when_stopped, args=(child, stop), daemon=True).start()
        with child:
            try:
                for line in child.stdout:
                    report = progress_report(line)
                    now = time.monotonic() - started
                    if report is None or progress is None:
                        continue
                    if isinstance(report, str):
                        progress(BuildProgress(0, 0, None, now, None, phase=report))
                    else:
                        step, steps, loss = report
                        progress(BuildProgress(step, steps, loss, now, estimate.remaining(step, steps, now)))
            except BaseException:  # an interrupted caller: the child must not train on
                child.kill()
                raise
        if stop is not None and stop.is_set():
            raise BuildInterrupted("the harness model's build was interrupted")
        if child.returncode != 0:
            errors.seek(0)
            tail = "\n".join(errors.read().strip().splitlines()[-15:])
            raise ModelLoadError(f"training the harness model failed (exit {child.returncode}):\n{tail}")


# --------------------------------------------------------------------------------------------------------------
# Training (in the child process)


def _say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def _train_into(directory: pathlib.Path, base: pathlib.Path, key: str) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsm_rollout.engine.local.model import quiet_progress_bars
    from fsm_rollout.tokens.chat import ObservationEncoder

    started = time.perf_counter()
    recipe = HARNESS_RECIPE
    _say(phase="loading the random model")
    with quiet_progress_bars():
        tokenizer: Any = AutoTokenizer.from_pretrained(str(base), local_files_only=True)
        model: Any = AutoModelForCausalLM.from_pretrained(
            str(base), dtype=torch.float32, local_files_only=True, attn_implementation="sdpa"
        )
    _say(phase="encoding the harness conversations")
    encoder = ObservationEncoder(tokenizer)
    conversations = harness_data.harness_conversations(
        recipe["conversations"], recipe["data_seed"], recipe["environments"]
    )
    examples = [harness_data.encode_conversation(each, tokenizer, encoder) for each in conversations]
    drills = harness_data.copy_drills(recipe["drills"], recipe["data_seed"] + 2, tokenizer)
    _say(step=0, steps=recipe["steps"], loss=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe["torch_seed"])
        losses = _fit(
            model, examples, drills, recipe, lambda step, loss: _say(step=step, steps=recipe["steps"], loss=loss)
        )
    model.eval()
    with quiet_progress_bars():
        model.save_pretrained(str(directory))
    for source in sorted(base.iterdir()):
        if source.is_file() and not (directory / source.name).exists() and source.name != BUILD_MARKER:
            shutil.copyfile(source, directory / source.name)
    for written in directory.iterdir():
        written.chmod(0o644)
    marker = {
        "build_version": directory.name,
        "recipe": recipe,
        "key": key,
        "base": base.name,
        "loss_first": round(losses[0], 4),
        "loss_last": round(losses[-1], 4),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "build_seconds": round(time.perf_counter() - started, 3),
    }
    (directory / BUILD_MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _fit(
    model: Any,
    examples: list[harness_data.EncodedConversation],
    drills: list[harness_data.EncodedConversation],
    recipe: dict[str, Any],
    on_step: Callable[[int, float], None],
) -> list[float]:
    """AdamW on the endings' next-token cross-entropy over cached prompt keys and values (see the module
    docstring); the loss per step."""
    import torch

    embeddings = model.get_input_embeddings().weight
    vocab = int(embeddings.shape[0])
    used = sorted({token for example in [*examples, *drills] for token in example.token_ids})
    used_ids = torch.tensor(used, dtype=torch.long)
    column = torch.full((vocab,), -1, dtype=torch.long)
    column[used_ids] = torch.arange(len(used))
    compact = torch.nn.Parameter(embeddings.detach()[used_ids].clone())
    zero_rows = math.log(vocab - len(used))
    body = [parameter for name, parameter in model.model.named_parameters() if not name.startswith("embed_tokens")]
    optimizer = torch.optim.AdamW([compact, *body], lr=recipe["learning_rate"], weight_decay=0.0)
    steps = recipe["steps"]
    # decays to almost nothing, so that the weights move little after the last refresh of the caches
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / recipe["warmup_steps"], max(0.02, 1.0 - step / steps))
    )
    local = [column[torch.tensor(example.token_ids)].unsqueeze(0) for example in examples]
    # the prompt's last tokens run with the endings, with gradients (the rest is the cached part)
    cut = [example.prompt_length - recipe["prompt_tail"] for example in examples]
    caches: list[list[tuple[Any, Any]]] = []
    order = random.Random(recipe["data_seed"] + 1)
    pending: list[int] = []
    next_drill = 0
    losses: list[float] = []
    model.train()
    for step in range(1, recipe["steps"] + 1):
        if step in recipe["refresh_at"]:
            with torch.no_grad():
                caches = _prompt_caches(model, compact, local, cut)
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(recipe["batch_size"]):
            if not pending:
                pending = list(range(len(examples)))
                order.shuffle(pending)
            loss = _ending_loss(model, compact, zero_rows, caches, local, cut, examples, pending.pop())
            (loss / recipe["batch_size"]).backward()
            total += float(loss.detach()) / recipe["batch_size"]
        for _ in range(recipe["drills_per_step"]):  # whole, with gradients: they are short
            drill = drills[next_drill % len(drills)]
            next_drill += 1
            ids = column[torch.tensor(drill.token_ids)].unsqueeze(0)
            (_loss(model, compact, zero_rows, ids, drill.trainable[1:], None) / recipe["drills_per_step"]).backward()
        optimizer.step()
        schedule.step()
        losses.append(total)
        on_step(step, total)
    with torch.no_grad():
        embeddings.zero_()
        embeddings[used_ids] = compact.detach()
    return losses


def _ending_loss(model: Any, compact: Any, zero_rows: float, caches: list[list[tuple[Any, Any]]], local: list[Any],
                 cut: list[int], examples: list[harness_data.EncodedConversation], index: int) -> Any:  # fmt: skip
    """One conversation's mean cross-entropy on its trained tokens, its tail run over its cached prompt."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer, (keys, values) in enumerate(caches[index]):
        cache.update(keys.clone(), values.clone(), layer)
    at, ids = cut[index], local[index]
    return _loss(model, compact, zero_rows, ids[:, at:], examples[index].trainable[at + 1 :], cache)


def _loss(model: Any, compact: Any, zero_rows: float, ids: Any, targets: list[bool], cache: Any) -> Any:
    """Mean next-token cross-entropy of ``ids`` (compact ids, after ``cache``) where ``targets`` (from the second
    token on) is set."""
    import torch

    hidden = model.model(inputs_embeds=compact[ids], past_key_values=cache, use_cache=cache is not None)
    chosen = torch.tensor(targets)
    logits = hidden.last_hidden_state[0, :-1][chosen] @ compact.T
    constant = torch.full((logits.shape[0], 1), zero_rows)
    normaliser = torch.logsumexp(torch.cat([logits, constant], dim=1), dim=1)
    picked = logits.gather(1, ids[0, 1:][chosen].unsqueeze(1)).squeeze(1)
    return (normaliser - picked).mean()


def _shared(first: Any, second: Any, limit: int) -> int:
    """How many leading tokens two rows of ids share, up to ``limit``."""
    length = min(first.shape[1], second.shape[1], limit)
    differ = (first[0, :length] != second[0, :length]).nonzero()
    return int(differ[0, 0]) if len(differ) else length


def _prompt_caches(model: Any, compact: Any, local: list[Any], cut: list[int]) -> list[list[tuple[Any, Any]]]:
    """Each conversation's keys and values up to its cut, every shared prefix computed once: a conversation
    continues the cache of the earlier one it shares the most leading tokens with."""
    from transformers import DynamicCache

    caches: list[list[tuple[Any, Any]]] = []
    for index, (ids, at) in enumerate(zip(local, cut, strict=True)):
        shared, donor = max(((_shared(ids, local[other], at - 1), other) for other in range(index)), default=(0, -1))
        cache = DynamicCache()
        if shared:
            for layer, (keys, values) in enumerate(caches[donor]):
                cache.update(keys[:, :, :shared], values[:, :, :shared], layer)
        out = model.model(inputs_embeds=compact[ids[:, shared:at]], past_key_values=cache, use_cache=True)
        caches.append([(layer.keys, layer.values) for layer in out.past_key_values.layers])
    return caches


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent ends this process when its user interrupts
    _say(phase="importing torch")
    import torch

    torch.set_num_threads(int(sys.argv[4]))
    torch.use_deterministic_algorithms(True)
    _train_into(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3])
