"""Practice questions: the demo's question kinds with freshly drawn numbers, never the demo's own items.

Each kind is one of the demo's (angles of a triangle, a right triangle's missing angle, Pythagorean sides, circle
measures, rectangle and square measures, angles on lines, a quadrilateral's fourth angle); the numbers come from a
seeded :class:`random.Random`, so the same seed gives the same questions. A drawn question whose text equals a demo
question is drawn again, so training on practice questions never sees a demo item.

The default model of the embedded engine is trained on conversations about these questions
(:mod:`fsm_rollout.engine.local.default_model`), and the GRPO example rolls them out.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fsm_rollout.data.demo import Question, demo_questions, question_sample
from fsm_rollout.data.figures import (
    circle,
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
from fsm_rollout.sample import Sample

__all__ = ["KINDS", "PRACTICE_SOURCE", "PracticeQuestion", "practice_questions", "practice_samples"]

PRACTICE_SOURCE = "fsm-rollout practice"
"""``metadata["source"]`` of every practice sample."""


@dataclass(frozen=True)
class PracticeQuestion:
    """A drawn question and the name of its kind (a key of :data:`KINDS`)."""

    kind: str
    question: Question


def _triangle_angles(rng: random.Random) -> Question:
    a = rng.randrange(30, 80, 5)
    b = rng.randrange(30, 150 - a, 5)
    return Question(
        f"In triangle ABC, angle A measures {a}° and angle B measures {b}°. Find x, the measure of angle C in degrees.",
        str(180 - a - b),
        triangle_angles((a, b), (f"{a}°", f"{b}°", "x°")),
    )


def _right_angle(rng: random.Random) -> Question:
    b = rng.randrange(20, 71, 5)
    return Question(
        f"Triangle ABC has a right angle at A and angle B measures {b}°. Find x, the measure of angle C in degrees.",
        str(90 - b),
        right_triangle((1, math.tan(math.radians(b))), ("", ""), "", angle_b=f"{b}°"),
    )


def _isosceles(rng: random.Random) -> Question:
    c = rng.randrange(20, 141, 10)
    return Question(
        f"Triangle ABC is isosceles with CA = CB and angle C measures {c}°. Find x, the measure of angle A in degrees.",
        str((180 - c) // 2),
        isosceles(f"{c}°", "x°"),
    )


def _exterior(rng: random.Random) -> Question:
    a = rng.randrange(25, 86, 5)
    c = rng.randrange(25, 86, 5)
    return Question(
        f"Side AB of triangle ABC is extended to D. Angle A measures {a}° and angle C measures {c}°. "
        "Find x, the measure of the exterior angle CBD in degrees.",
        str(a + c),
        exterior_angle(f"{a}°", f"{c}°", "x°"),
    )


_TRIPLES = ((3, 4, 5), (5, 12, 13), (8, 15, 17), (7, 24, 25), (20, 21, 29))


def _triple(rng: random.Random) -> tuple[int, int, int]:
    a, b, c = rng.choice(_TRIPLES)
    scale = rng.choice((1, 1, 2, 3))
    legs = [a * scale, b * scale]
    rng.shuffle(legs)
    return legs[0], legs[1], c * scale


def _hypotenuse(rng: random.Random) -> Question:
    ab, ac, bc = _triple(rng)
    return Question(
        f"Triangle ABC has a right angle at A, AB = {ab} and AC = {ac}. Find x, the length of the hypotenuse BC.",
        str(bc),
        right_triangle((ab, ac), (str(ab), str(ac)), "x"),
    )


def _leg(rng: random.Random) -> Question:
    ab, ac, bc = _triple(rng)
    return Question(
        f"Triangle ABC has a right angle at A, hypotenuse BC = {bc} and AC = {ac}. Find x, the length of AB.",
        str(ab),
        right_triangle((ab, ac), ("x", str(ac)), str(bc)),
    )


def _isosceles_right(rng: random.Random) -> Question:
    leg = rng.randrange(3, 13)
    return Question(
        f"Triangle ABC has a right angle at A and AB = AC = {leg}. Find x, the length of BC, in simplest radical form.",
        f"{leg}\\sqrt{{2}}",
        right_triangle((leg, leg), (str(leg), str(leg)), "x"),
    )


def _thirty_sixty(rng: random.Random) -> Question:
    hypotenuse = 2 * rng.randrange(2, 13)
    return Question(
        f"Triangle ABC has a right angle at A, angle B measures 30° and the hypotenuse BC = {hypotenuse}. "
        "Find x, the length of AC.",
        str(hypotenuse // 2),
        right_triangle((math.sqrt(3), 1), ("", "x"), str(hypotenuse), angle_b="30°"),
    )


def _circumference(rng: random.Random) -> Question:
    r = rng.randrange(2, 16)
    return Question(
        f"The circle with centre O has radius {r}. Find its circumference, in terms of \\pi.",
        f"{2 * r}\\pi",
        circle("radius", str(r)),
    )


def _circle_area(rng: random.Random) -> Question:
    r = rng.randrange(2, 13)
    return Question(
        f"The circle with centre O has radius {r}. Find its area, in terms of \\pi.",
        f"{r * r}\\pi",
        circle("radius", str(r)),
    )


def _radius(rng: random.Random) -> Question:
    d = 2 * rng.randrange(2, 16)
    return Question(
        f"A diameter of the circle with centre O measures {d}. Find the radius of the circle.",
        str(d // 2),
        circle("diameter", str(d)),
    )


def _diameter_area(rng: random.Random) -> Question:
    d = 2 * rng.randrange(2, 11)
    return Question(
        f"A diameter of the circle with centre O measures {d}. Find the area of the circle, in terms of \\pi.",
        f"{(d // 2) ** 2}\\pi",
        circle("diameter", str(d)),
    )


def _rounded_circumference(rng: random.Random) -> Question:
    d = rng.randrange(3, 21)
    return Question(
        f"A diameter of the circle with centre O measures {d}. Find the circumference of the circle, "
        "rounded to the nearest hundredth.",
        f"{math.pi * d:.2f}",
        circle("diameter", str(d)),
    )


def _rectangle_area(rng: random.Random) -> Question:
    w, h = rng.randrange(3, 13), rng.randrange(2, 10)
    return Question(
        f"Rectangle ABCD has AB = {w} and BC = {h}. Find the area of the rectangle.",
        str(w * h),
        rectangle(str(w), str(h)),
    )


def _diagonal(rng: random.Random) -> Question:
    w, h, d = _triple(rng)
    return Question(
        f"Rectangle ABCD has AB = {w} and BC = {h}. Find x, the length of the diagonal AC.",
        str(d),
        rectangle(str(w), str(h), diagonal="x"),
    )


def _perimeter(rng: random.Random) -> Question:
    w, h = rng.randrange(3, 16), rng.randrange(2, 12)
    return Question(
        f"Rectangle ABCD has AB = {w} and BC = {h}. Find the perimeter of the rectangle.",
        str(2 * (w + h)),
        rectangle(str(w), str(h)),
    )


def _triangle_area(rng: random.Random) -> Question:
    base, height = 2 * rng.randrange(2, 9), rng.randrange(3, 13)
    return Question(
        f"In triangle ABC the base AB is {base} and the height from C to AB is {height}. "
        "Find the area of the triangle.",
        str(base * height // 2),
        triangle_area(str(base), str(height)),
    )


def _straight_line(rng: random.Random) -> Question:
    known = rng.randrange(95, 171, 5)
    return Question(
        f"Points A, O and B lie on a straight line and angle AOC measures {known}°. "
        "Find x, the measure of angle COB in degrees.",
        str(180 - known),
        straight_line(f"{known}°", "x°"),
    )


def _vertical(rng: random.Random) -> Question:
    known = rng.randrange(25, 86, 5)
    return Question(
        f"Lines AB and CD intersect at O and angle BOD measures {known}°. Find x, the measure of angle AOC in degrees.",
        str(known),
        vertical_angles(f"{known}°", "x°"),
    )


def _square_area(rng: random.Random) -> Question:
    side = rng.randrange(2, 16)
    return Question(
        f"ABCD is a square with side AB = {side}. Find the area of the square.",
        str(side * side),
        square(str(side)),
    )


def _quadrilateral(rng: random.Random) -> Question:
    a = rng.randrange(60, 121, 10)
    b = rng.randrange(60, 121, 10)
    c = rng.randrange(60, 121, 10)
    return Question(
        f"In quadrilateral ABCD, angle A measures {a}°, angle B measures {b}° and angle C measures {c}°. "
        "Find x, the measure of angle D in degrees.",
        str(360 - a - b - c),
        quadrilateral((f"{a}°", f"{b}°", f"{c}°", "x°")),
    )


KINDS: dict[str, Callable[[random.Random], Question]] = {
    "triangle_angles": _triangle_angles,
    "right_angle": _right_angle,
    "isosceles": _isosceles,
    "exterior_angle": _exterior,
    "hypotenuse": _hypotenuse,
    "leg": _leg,
    "isosceles_right": _isosceles_right,
    "thirty_sixty": _thirty_sixty,
    "circumference": _circumference,
    "circle_area": _circle_area,
    "radius": _radius,
    "diameter_area": _diameter_area,
    "rounded_circumference": _rounded_circumference,
    "rectangle_area": _rectangle_area,
    "diagonal": _diagonal,
    "perimeter": _perimeter,
    "triangle_area": _triangle_area,
    "straight_line": _straight_line,
    "vertical_angles": _vertical,
    "square_area": _square_area,
    "quadrilateral": _quadrilateral,
}
"""The question kinds of the demo, each a function drawing one question from a random generator."""


def practice_questions(count: int, *, seed: int, kinds: Sequence[str] | None = None) -> list[PracticeQuestion]:
    """``count`` questions drawn with ``seed``, kinds taken in turn (all of :data:`KINDS` by default).

    Raises:
        ValueError: For a negative count or an unknown kind.
    """
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    names = list(KINDS) if kinds is None else list(kinds)
    unknown = sorted(set(names) - set(KINDS))
    if unknown or not names:
        raise ValueError(f"unknown question kind(s) {unknown or names}; the kinds are {', '.join(KINDS)}")
    demo_texts = {question.text for question in demo_questions()}
    rng = random.Random(seed)
    drawn: list[PracticeQuestion] = []
    while len(drawn) < count:
        kind = names[len(drawn) % len(names)]
        question = KINDS[kind](rng)
        if question.text not in demo_texts:
            drawn.append(PracticeQuestion(kind, question))
    return drawn


def practice_samples(count: int, *, seed: int, kinds: Sequence[str] | None = None) -> list[Sample]:
    """:func:`practice_questions` as fresh samples for the Geo3K environment (figure, label, ``index``), with
    ``metadata = {"source": "fsm-rollout practice", "kind": ...}``."""
    samples = []
    for index, drawn in enumerate(practice_questions(count, seed=seed, kinds=kinds)):
        sample = question_sample(drawn.question, index, source=PRACTICE_SOURCE)
        sample.metadata["kind"] = drawn.kind
        samples.append(sample)
    return samples
