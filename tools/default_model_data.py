"""The default model's training data: conversations about practice questions in the Geo3K task's format.

The embedded engine trains its default model (:mod:`fsm_rollout.engine.local.default_model`) on the data it is given,
and ships one copy of this module's output beside itself, so that the engine needs neither the questions nor the
environment. This module writes that copy (``python -m tools.default_model_data`` from a checkout), and a test checks
that the shipped copy is what it would write today.

Each conversation is about a practice question of the demo's kinds (:mod:`fsm_rollout.data.practice`), never a demo
item: a short reason and a ``calc_score`` tool call with an answer, the built-in Geo3K environment's feedback
(:mod:`fsm_rollout.envs.geo3k`, which grades the attempt itself), then another attempt after ``Incorrect`` or a final
``\\boxed{}`` answer after ``Correct``. An attempt is right with the probabilities the recipe names, else it gives
another question's answer of the same kind: the model learns the format, when to try again and when to stop, and each
kind's usual answers, not geometry.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from fsm_rollout.data.demo import question_prompt
from fsm_rollout.data.figures import FIGURE_SIZE
from fsm_rollout.data.practice import KINDS, practice_questions
from fsm_rollout.engine.local.default_model import (
    RECIPE,
    SHIPPED_DATA,
    Conversation,
    TrainingData,
    write_training_data,
)
from fsm_rollout.envs.geo3k import Geo3KEnv
from fsm_rollout.sample import Sample

__all__ = ["PracticeConversation", "recipe_training_data", "training_conversations", "training_data"]

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


@dataclass(frozen=True)
class PracticeConversation:
    """One training conversation: the practice question's prompt, kind and label, the assistant turns and the
    environment's feedback after each turn but the last."""

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
                           max_turns: int) -> list[PracticeConversation]:  # fmt: skip
    """``count`` conversations about practice questions, graded by the Geo3K environment itself.

    Each attempt answers right with probability ``first_correct`` (first turn) or ``retry_correct`` (later turns),
    otherwise with the answer of another question of the same kind. After ``Correct`` the next turn gives the
    final ``\\boxed{}`` answer; the conversation ends there or at ``max_turns`` turns.
    """
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
            PracticeConversation(question_prompt(drawn.question), drawn.kind, label, tuple(turns), tuple(feedback))
        )
    return conversations


def _wrong_answer(kind: Callable[[random.Random], Any], label: str, rng: random.Random) -> str:
    for _ in range(64):
        answer: str = kind(rng).label
        if answer != label:
            return answer
    return label + "1"


def training_data(conversations: Sequence[PracticeConversation]) -> TrainingData:
    """The engine's training data for ``conversations``: each prompt with the demo's figure size, and each feedback
    as the Geo3K environment formats it into the message a rollout appends."""
    formatter = Geo3KEnv(sample=Sample(), label="0", max_turns=1)
    return TrainingData(
        figure_size=FIGURE_SIZE,
        conversations=tuple(
            Conversation(
                prompt=conversation.prompt,
                turns=conversation.turns,
                observations=tuple(formatter.format_observation(text) for text in conversation.feedback),
            )
            for conversation in conversations
        ),
    )


def recipe_training_data() -> TrainingData:
    """The default model's training data as :data:`~fsm_rollout.engine.local.default_model.RECIPE` asks for it."""
    conversations = training_conversations(
        RECIPE["conversations"], seed=RECIPE["data_seed"], first_correct=RECIPE["first_correct"],
        retry_correct=RECIPE["retry_correct"], max_turns=RECIPE["max_turns"],
    )  # fmt: skip
    return training_data(conversations)


if __name__ == "__main__":
    target = write_training_data(recipe_training_data(), SHIPPED_DATA)
    print(f"wrote {target}", file=sys.stderr)
