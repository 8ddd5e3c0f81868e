"""The embedded engine's thinking model: the default model's recipe, trained on the same conversations written in a
shipped thinking chat template's format, and served with that template.

A thinking template (Qwen3.6's, :mod:`fsm_rollout.tokens.chat_templates`) opens every assistant turn with
``<think>\\n`` in its generation prompt, expects the model to reason, close the block with ``</think>`` and then
answer, and drops the reasoning of turns before the last user message when it renders a history. The default model
was trained on another template, so it never closes a think block. This module rewrites the default model's shipped
training data (:func:`~fsm_rollout.engine.local.default_model.read_training_data`) into thinking turns: each turn's
reasoning (the hint before the tool call, or why it stops) inside the think block, the tool call or the boxed answer
after it. It then trains through :func:`~fsm_rollout.engine.local.default_model.train_model_dir`, the default model's
own build (same recipe, progress, Ctrl-C handling and determinism), and publishes a model directory whose tokenizer
wears the template, so the engine renders with it and ``fsm-rollout run`` probes it.

The training encodes conversations as rollouts that append turns see them (every turn's reasoning kept): the
template itself cannot cut a user observation's boundary, since it rewrites the turns before it. The training
tokenizer therefore wears the template with its ``preserve_thinking`` switch set, which renders the same prompt and
the same observation boundaries while keeping earlier reasoning. Rollouts on the served template fork at each user
observation (``history_policy="auto"`` chooses ``fork``), and the model sees the history without earlier reasoning.

Cache layout, under the cache root: ``<name>-training/`` holds the training base (the tiny random model wearing the
training template) and the trained build, and ``<name>-<key>/`` is the served directory (the trained weights, the
tokenizer wearing the template). The key hashes the default model's key inputs (its recipe, this data, its source),
the template's text and the training template's switch. Nothing changes in the default model's cache entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping
from typing import Any, Final

from fsm_rollout.engine.local.cache import cache_dir
from fsm_rollout.engine.local.default_model import (
    DEFAULT_MODEL_NAME,
    RECIPE,
    BuildProgress,
    Conversation,
    TrainingData,
    read_training_data,
    recipe_key,
    train_model_dir,
)
from fsm_rollout.engine.local.errors import ModelLoadError
from fsm_rollout.engine.local.tiny import BUILD_MARKER, TINY_MODEL_NAME, tiny_model_dir

__all__ = [
    "THINKING_TEMPLATES",
    "thinking_model_dir",
    "thinking_model_name",
    "thinking_recipe",
    "thinking_training_data",
]

THINKING_TEMPLATES: Final = ("qwen3_6",)
"""The shipped thinking templates a thinking model is built for (their generation prompt opens ``<think>\\n``, and
they have the ``preserve_thinking`` switch the training needs)."""

THINK_CLOSE: Final = "\n</think>\n\n"
"""What ends a turn's reasoning, as the template writes a kept think block."""

STOP_REASONING: Final = "calc_score said it is correct, so I give the final answer."
RETRY_REASONING: Final = "That answer was wrong. "

_TOOL_CALL: Final = "<tool_call>"
_PRESERVE_THINKING: Final = "{%- set preserve_thinking = true %}\n"
_TOKENIZER_CONFIG: Final = "tokenizer_config.json"


def thinking_model_name(template: str = "qwen3_6") -> str:
    """The served model name of the thinking model for ``template`` (the directory adds the key)."""
    _check(template)
    return f"{DEFAULT_MODEL_NAME}-{template}"


def thinking_turn(turn: str, index: int) -> str:
    """A default-data turn in the thinking format: its reasoning, the closing tag, its answer. A tool-call turn
    reasons with the hint before its call (after a first attempt, saying the last one was wrong); a final turn says
    why it stops."""
    at = turn.find(_TOOL_CALL)
    if at < 0:
        return f"{STOP_REASONING}{THINK_CLOSE}{turn}"
    hint = turn[:at].strip()
    return f"{RETRY_REASONING if index else ''}{hint}{THINK_CLOSE}{turn[at:]}"


def thinking_training_data(data: TrainingData | None = None) -> TrainingData:
    """``data`` (the default model's shipped data by default) with every turn in the thinking format."""
    source = data if data is not None else read_training_data()
    conversations = []
    for each in source.conversations:
        turns = tuple(thinking_turn(turn, index) for index, turn in enumerate(each.turns))
        conversations.append(Conversation(each.prompt, turns, each.observations))
    return TrainingData(tuple(conversations), source.figure_size)


def thinking_recipe(template: str = "qwen3_6") -> dict[str, Any]:
    """The default recipe plus what else decides the weights: the template's text and the switch the training
    template sets (the thinking turns are in the data, which the key hashes too; this module's source is not hashed,
    so a change to it that changes the weights must change one of these)."""
    from fsm_rollout.tokens.chat_templates import chat_template

    _check(template)
    return {
        **RECIPE,
        "chat_template": template,
        "chat_template_sha256": hashlib.sha256(chat_template(template).encode()).hexdigest(),
        "training_template_prefix": _PRESERVE_THINKING,
    }


def thinking_model_dir(
    template: str = "qwen3_6",
    cache: pathlib.Path | None = None,
    *,
    data: TrainingData | None = None,
    log: Callable[[str], None] | None = None,
    progress: Callable[[BuildProgress], None] | None = None,
    stop: threading.Event | None = None,
) -> pathlib.Path:
    """Build (once) and return the thinking model's directory for the shipped ``template``: the default model's
    recipe trained on ``data`` (the shipped data by default) in the template's thinking format.

    ``log``, ``progress`` and ``stop`` are the default model build's (see
    :func:`~fsm_rollout.engine.local.default_model.train_model_dir`); a finished build returns at once.

    Raises:
        ValueError: If ``template`` is not one of :data:`THINKING_TEMPLATES`.
        ModelLoadError: If a build fails, or a target path exists but is not a complete build.
        BuildInterrupted: If ``stop`` was set during the build.
    """
    from fsm_rollout.tokens.chat_templates import chat_template

    name = thinking_model_name(template)
    root = cache if cache is not None else cache_dir()
    thinking = thinking_training_data(data)
    recipe = thinking_recipe(template)
    key = recipe_key(thinking, recipe)
    target = root / f"{name}-{key}"
    if (target / BUILD_MARKER).is_file():
        return target
    training_root = root / f"{name}-training"
    if log is not None and not (training_root / f"{name}-{key}" / BUILD_MARKER).is_file():
        log(f"training the {template} thinking model once ({recipe['steps']} steps on the CPU; cached in {target})")
    _publish(training_root / TINY_MODEL_NAME, lambda staging: _training_base(staging, tiny_model_dir(root), template))
    trained = train_model_dir(training_root, name, thinking, recipe, progress=progress, stop=stop)
    _publish(target, lambda staging: _served(staging, trained, chat_template(template), target.name))
    return target


def _check(template: str) -> None:
    if template not in THINKING_TEMPLATES:
        raise ValueError(
            f"no thinking model for chat template {template!r}; the choices are {list(THINKING_TEMPLATES)}"
        )


def _publish(target: pathlib.Path, fill: Callable[[pathlib.Path], None]) -> None:
    """Fill a temporary directory beside ``target`` and rename it there (once; a racing process's build wins)."""
    if (target / BUILD_MARKER).is_file():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        fill(staging)
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


def _copy_with_template(source: pathlib.Path, directory: pathlib.Path, template: str) -> None:
    """Every file of ``source`` (not its marker) into ``directory``, the tokenizer wearing ``template``; the
    weights hard-linked where the file system allows."""
    for each in sorted(source.iterdir()):
        if not each.is_file() or each.name == BUILD_MARKER:
            continue
        copy = directory / each.name
        if each.name == _TOKENIZER_CONFIG:
            config = json.loads(each.read_text(encoding="utf-8"))
            config["chat_template"] = template
            copy.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        elif each.suffix == ".safetensors":
            try:
                os.link(each, copy)
            except OSError:
                shutil.copyfile(each, copy)
        else:
            shutil.copyfile(each, copy)
    for written in directory.iterdir():
        written.chmod(0o644)


def _marker(directory: pathlib.Path, fields: Mapping[str, Any]) -> None:
    (directory / BUILD_MARKER).write_text(json.dumps(dict(fields), indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _training_base(directory: pathlib.Path, tiny: pathlib.Path, template: str) -> None:
    """The tiny random model wearing the template with ``preserve_thinking`` set (see the module docstring)."""
    from fsm_rollout.tokens.chat_templates import chat_template

    _copy_with_template(tiny, directory, _PRESERVE_THINKING + chat_template(template))
    base = json.loads((tiny / BUILD_MARKER).read_text(encoding="utf-8"))
    _marker(directory, {**base, "training_chat_template": f"{template} (preserve_thinking)"})


def _served(directory: pathlib.Path, trained: pathlib.Path, template_text: str, name: str) -> None:
    """The trained weights with the tokenizer wearing the template as shipped (``name``: the published one)."""
    _copy_with_template(trained, directory, template_text)
    built = json.loads((trained / BUILD_MARKER).read_text(encoding="utf-8"))
    _marker(directory, {**built, "build_version": name, "trained": trained.name})
