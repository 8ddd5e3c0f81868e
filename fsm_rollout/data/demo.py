"""The demo dataset: Geo3K-style geometry questions whose figures Pillow draws at load time.

``demo_samples()`` returns fresh :class:`~fsm_rollout.Sample` objects ready for the built-in Geo3K environment
(:mod:`fsm_rollout.envs.geo3k`): ``prompt`` is ``"<image>\\n"`` followed by the question and the instruction to
answer with the ``calc_score`` tool call, ``multimodal_inputs = {"images": [figure]}`` holds one RGB
``FIGURE_SIZE`` PIL image, ``label`` is the answer as a string (``"70"``, ``"5"``, ``"12\\pi"``, ``"2\\sqrt{2}"``,
``"37.70"``; every form the environment's grader reads as a number), ``index`` is the position in the list and
``metadata = {"source": "fsm-rollout demo"}``.

``demo_records()`` gives the same questions as JSON-able dataset lines, the format ``fsm-rollout run --data``
reads: ``{"prompt": str, "images": ["data:image/png;base64,..."], "label": str, "metadata": {...}}``.

The figures (:mod:`fsm_rollout.data.figures`) are drawn with Pillow, so the package holds no binary files and
every call returns the same pixels and the same PNG bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from PIL import Image

from fsm_rollout.data.figures import (
    FIGURE_SIZE,
    Figure,
    circle,
    draw_figure,
    exterior_angle,
    isosceles,
    quadrilateral,
    rectangle,
    right_triangle,
    square,
    straight_line,
    triangle_angles,
    triangle_area,
    vertical_angles,
)
from fsm_rollout.envs.geo3k import TOOL_CALL_EXAMPLE
from fsm_rollout.multimodal import encode_pil_image
from fsm_rollout.sample import Sample

__all__ = ["ANSWER_INSTRUCTIONS", "DEMO_SOURCE", "FIGURE_SIZE", "Question", "demo_questions", "demo_records",
           "demo_samples", "question_prompt", "question_sample"]  # fmt: skip

DEMO_SOURCE = "fsm-rollout demo"
"""``metadata["source"]`` of every demo sample."""

ANSWER_INSTRUCTIONS = (
    "Reason step by step, then submit your answer with the calc_score tool, written exactly as "
    f"{TOOL_CALL_EXAMPLE}. The answer is a number or an exact expression such as 12\\pi or 5\\sqrt{{3}}, "
    "without units."
)


@dataclass(frozen=True)
class Question:
    """One question: its text, its answer as the label, and how to draw its figure."""

    text: str
    label: str
    draw: Figure


# --------------------------------------------------------------------------------------------------------------
# The questions

_QUESTIONS: tuple[Question, ...] = (
    Question(
        "In triangle ABC, angle A measures 50° and angle B measures 60°. Find x, the measure of angle C in degrees.",
        "70",
        triangle_angles((50, 60), ("50°", "60°", "x°")),
    ),
    Question(
        "Triangle ABC has a right angle at A and angle B measures 35°. Find x, the measure of angle C in degrees.",
        "55",
        right_triangle((1, math.tan(math.radians(35))), ("", ""), "", angle_b="35°"),
    ),
    Question(
        "Triangle ABC is isosceles with CA = CB and angle C measures 40°. Find x, the measure of angle A in degrees.",
        "70",
        isosceles("40°", "x°"),
    ),
    Question(
        "Side AB of triangle ABC is extended to D. Angle A measures 45° and angle C measures 75°. "
        "Find x, the measure of the exterior angle CBD in degrees.",
        "120",
        exterior_angle("45°", "75°", "x°"),
    ),
    Question(
        "Triangle ABC has a right angle at A, AB = 4 and AC = 3. Find x, the length of the hypotenuse BC.",
        "5",
        right_triangle((4, 3), ("4", "3"), "x"),
    ),
    Question(
        "Triangle ABC has a right angle at A, AB = 12 and AC = 5. Find x, the length of BC.",
        "13",
        right_triangle((12, 5), ("12", "5"), "x"),
    ),
    Question(
        "Triangle ABC has a right angle at A, hypotenuse BC = 10 and AC = 6. Find x, the length of AB.",
        "8",
        right_triangle((8, 6), ("x", "6"), "10"),
    ),
    Question(
        "Triangle ABC has a right angle at A and AB = AC = 2. Find x, the length of BC, in simplest radical form.",
        "2\\sqrt{2}",
        right_triangle((2, 2), ("2", "2"), "x"),
    ),
    Question(
        "Triangle ABC has a right angle at A, angle B measures 30° and the hypotenuse BC = 10. "
        "Find x, the length of AC.",
        "5",
        right_triangle((math.sqrt(3), 1), ("", "x"), "10", angle_b="30°"),
    ),
    Question(
        "The circle with centre O has radius 5. Find its circumference, in terms of \\pi.",
        "10\\pi",
        circle("radius", "5"),
    ),
    Question(
        "The circle with centre O has radius 6. Find its area, in terms of \\pi.",
        "36\\pi",
        circle("radius", "6"),
    ),
    Question(
        "A diameter of the circle with centre O measures 14. Find the radius of the circle.",
        "7",
        circle("diameter", "14"),
    ),
    Question(
        "A diameter of the circle with centre O measures 10. Find the area of the circle, in terms of \\pi.",
        "25\\pi",
        circle("diameter", "10"),
    ),
    Question(
        "A diameter of the circle with centre O measures 12. Find the circumference of the circle, "
        "rounded to the nearest hundredth.",
        "37.70",
        circle("diameter", "12"),
    ),
    Question(
        "Rectangle ABCD has AB = 8 and BC = 5. Find the area of the rectangle.",
        "40",
        rectangle("8", "5"),
    ),
    Question(
        "Rectangle ABCD has AB = 8 and BC = 6. Find x, the length of the diagonal AC.",
        "10",
        rectangle("8", "6", diagonal="x"),
    ),
    Question(
        "Rectangle ABCD has AB = 9 and BC = 4. Find the perimeter of the rectangle.",
        "26",
        rectangle("9", "4"),
    ),
    Question(
        "In triangle ABC the base AB is 10 and the height from C to AB is 6. Find the area of the triangle.",
        "30",
        triangle_area("10", "6"),
    ),
    Question(
        "Points A, O and B lie on a straight line and angle AOC measures 130°. "
        "Find x, the measure of angle COB in degrees.",
        "50",
        straight_line("130°", "x°"),
    ),
    Question(
        "Lines AB and CD intersect at O and angle BOD measures 65°. Find x, the measure of angle AOC in degrees.",
        "65",
        vertical_angles("65°", "x°"),
    ),
    Question(
        "ABCD is a square with side AB = 7. Find the area of the square.",
        "49",
        square("7"),
    ),
    Question(
        "In quadrilateral ABCD, angle A measures 90°, angle B measures 80° and angle C measures 110°. "
        "Find x, the measure of angle D in degrees.",
        "80",
        quadrilateral(("90°", "80°", "110°", "x°")),
    ),
)


def _figure(question: Question) -> Image.Image:
    return draw_figure(question.draw)


def question_prompt(question: Question) -> str:
    """The prompt text of a question: the image marker, the question and the answer instructions."""
    return f"<image>\n{question.text} {ANSWER_INSTRUCTIONS}"


def question_sample(question: Question, index: int, source: str = DEMO_SOURCE) -> Sample:
    """A fresh sample for ``question``: its figure as the one image, its answer as ``label``."""
    return Sample(
        index=index,
        prompt=question_prompt(question),
        multimodal_inputs={"images": [_figure(question)]},
        label=question.label,
        metadata={"source": source},
    )


def demo_questions() -> tuple[Question, ...]:
    """The demo's questions, in dataset order."""
    return _QUESTIONS


def demo_samples() -> list[Sample]:
    """The demo questions as fresh samples: one figure each, the answer as ``label``, ``index`` = position."""
    return [question_sample(question, index) for index, question in enumerate(_QUESTIONS)]


def demo_records() -> list[dict[str, Any]]:
    """The demo questions as dataset lines for ``fsm-rollout run --data`` (figures as PNG data URLs)."""
    return [
        {
            "prompt": question_prompt(question),
            "images": [encode_pil_image(_figure(question))],
            "label": question.label,
            "metadata": {"source": DEMO_SOURCE},
        }
        for question in _QUESTIONS
    ]
