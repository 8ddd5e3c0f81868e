"""The demo dataset: Geo3K-style geometry questions whose figures Pillow draws at load time.

``demo_samples()`` returns fresh :class:`~fsm_rollout.Sample` objects ready for the built-in Geo3K environment
(:mod:`fsm_rollout.envs.geo3k`): ``prompt`` is ``"<image>\\n"`` followed by the question and the instruction to
answer with the ``calc_score`` tool call, ``multimodal_inputs = {"images": [figure]}`` holds one RGB
``FIGURE_SIZE`` PIL image, ``label`` is the answer as a string (``"70"``, ``"5"``, ``"12\\pi"``, ``"2\\sqrt{2}"``,
``"37.70"``; every form the environment's grader reads as a number), ``index`` is the position in the list and
``metadata = {"source": "fsm-rollout demo"}``.

``demo_records()`` gives the same questions as JSON-able dataset lines, the format ``fsm-rollout run --data``
reads: ``{"prompt": str, "images": ["data:image/png;base64,..."], "label": str, "metadata": {...}}``.

The figures are drawn with Pillow's default font on a white canvas (triangles with labelled sides and angles,
circles with a marked radius or diameter, rectangles, angles on lines), so the package holds no binary files and
every call returns the same pixels and the same PNG bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from fsm_rollout.envs.geo3k import TOOL_CALL_EXAMPLE
from fsm_rollout.multimodal import encode_pil_image
from fsm_rollout.sample import Sample

__all__ = ["DEMO_SOURCE", "FIGURE_SIZE", "demo_records", "demo_samples"]

DEMO_SOURCE = "fsm-rollout demo"
"""``metadata["source"]`` of every demo sample."""

FIGURE_SIZE = (256, 256)
"""Width and height of every figure, in pixels."""

ANSWER_INSTRUCTIONS = (
    "Reason step by step, then submit your answer with the calc_score tool, written exactly as "
    f"{TOOL_CALL_EXAMPLE}. The answer is a number or an exact expression such as 12\\pi or 5\\sqrt{{3}}, "
    "without units."
)

Point = tuple[float, float]
Draw = ImageDraw.ImageDraw

_INK = (20, 20, 20)
_ACCENT = (200, 30, 30)
_LINE_WIDTH = 2


@dataclass(frozen=True)
class _Question:
    """One demo question: its text, its answer as the label, and how to draw its figure."""

    text: str
    label: str
    draw: Callable[[Draw], None]


# --------------------------------------------------------------------------------------------------------------
# Drawing primitives


@lru_cache(maxsize=1)
def _font() -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    return ImageFont.load_default(size=16)


def _text(draw: Draw, at: Point, text: str, color: tuple[int, int, int] = _INK) -> None:
    """Write ``text`` centred on ``at``."""
    draw.text(at, text, fill=color, font=_font(), anchor="mm")


def _unit(start: Point, end: Point) -> Point:
    dx, dy = end[0] - start[0], end[1] - start[1]
    length = math.hypot(dx, dy)
    return dx / length, dy / length


def _away(point: Point, origin: Point, distance: float) -> Point:
    """``point`` moved ``distance`` pixels further from ``origin``."""
    ux, uy = _unit(origin, point)
    return point[0] + ux * distance, point[1] + uy * distance


def _centroid(points: Sequence[Point]) -> Point:
    return sum(p[0] for p in points) / len(points), sum(p[1] for p in points) / len(points)


def _polygon(draw: Draw, points: Sequence[Point]) -> None:
    draw.polygon(list(points), outline=_INK, width=_LINE_WIDTH)


def _vertex_names(draw: Draw, points: Sequence[Point], names: str) -> None:
    centre = _centroid(points)
    for point, name in zip(points, names, strict=True):
        _text(draw, _away(point, centre, 14), name)


def _side_label(draw: Draw, start: Point, end: Point, text: str, inside: Point, offset: float = 14) -> None:
    """Label the segment at its midpoint, on the side away from ``inside``."""
    middle = ((start[0] + end[0]) / 2, (start[1] + end[1]) / 2)
    ux, uy = _unit(start, end)
    normal = (-uy, ux)
    if (inside[0] - middle[0]) * normal[0] + (inside[1] - middle[1]) * normal[1] > 0:
        normal = (uy, -ux)
    _text(draw, (middle[0] + normal[0] * offset, middle[1] + normal[1] * offset), text)


def _direction_degrees(start: Point, end: Point) -> float:
    """Direction from ``start`` to ``end`` in Pillow's arc convention (degrees, clockwise from 3 o'clock)."""
    return math.degrees(math.atan2(end[1] - start[1], end[0] - start[0])) % 360


def _angle_mark(
    draw: Draw, vertex: Point, first: Point, second: Point, text: str, radius: float = 18, label_at: float = 34
) -> None:
    """An arc for the angle ``first``-``vertex``-``second`` and ``text`` along its bisector."""
    start, end = _direction_degrees(vertex, first), _direction_degrees(vertex, second)
    if (end - start) % 360 > 180:
        start, end = end, start
    box = (vertex[0] - radius, vertex[1] - radius, vertex[0] + radius, vertex[1] + radius)
    draw.arc(box, start, end, fill=_ACCENT, width=_LINE_WIDTH)
    middle = math.radians(start + ((end - start) % 360) / 2)
    _text(draw, (vertex[0] + math.cos(middle) * label_at, vertex[1] + math.sin(middle) * label_at), text, _ACCENT)


def _right_angle(draw: Draw, vertex: Point, first: Point, second: Point, size: float = 12) -> None:
    a, b = _unit(vertex, first), _unit(vertex, second)
    corner_a = (vertex[0] + a[0] * size, vertex[1] + a[1] * size)
    corner_b = (vertex[0] + b[0] * size, vertex[1] + b[1] * size)
    corner = (corner_a[0] + b[0] * size, corner_a[1] + b[1] * size)
    draw.line([corner_a, corner, corner_b], fill=_INK, width=1)


def _tick(draw: Draw, start: Point, end: Point) -> None:
    """A short stroke across the segment's midpoint (marks equal sides)."""
    middle = ((start[0] + end[0]) / 2, (start[1] + end[1]) / 2)
    ux, uy = _unit(start, end)
    draw.line([(middle[0] - uy * 6, middle[1] + ux * 6), (middle[0] + uy * 6, middle[1] - ux * 6)], fill=_INK, width=2)


def _dashed(draw: Draw, start: Point, end: Point, dash: float = 6) -> None:
    length = math.hypot(end[0] - start[0], end[1] - start[1])
    ux, uy = _unit(start, end)
    position = 0.0
    while position < length:
        stop = min(position + dash, length)
        draw.line(
            [(start[0] + ux * position, start[1] + uy * position), (start[0] + ux * stop, start[1] + uy * stop)],
            fill=_INK,
            width=1,
        )
        position += 2 * dash


def _dot(draw: Draw, at: Point, radius: float = 3) -> None:
    draw.ellipse((at[0] - radius, at[1] - radius, at[0] + radius, at[1] + radius), fill=_INK)


# --------------------------------------------------------------------------------------------------------------
# Figures

_CIRCLE_CENTRE = (128.0, 128.0)
_CIRCLE_RADIUS = 80.0


def _apex(left: Point, right: Point, left_angle: float, right_angle: float) -> Point:
    """The third vertex above the horizontal base ``left``-``right`` given the base angles in degrees."""
    base = right[0] - left[0]
    left_slope, right_slope = math.tan(math.radians(left_angle)), math.tan(math.radians(right_angle))
    run = base * right_slope / (left_slope + right_slope)
    return left[0] + run, left[1] - run * left_slope


def _triangle_angles(shape: tuple[float, float], labels: tuple[str, str, str]) -> Callable[[Draw], None]:
    """Triangle ABC (A bottom left, B bottom right) drawn with base angles ``shape``, all three angles labelled."""
    a, b = (40.0, 200.0), (216.0, 200.0)
    c = _apex(a, b, *shape)

    def draw(canvas: Draw) -> None:
        _polygon(canvas, (a, b, c))
        _vertex_names(canvas, (a, b, c), "ABC")
        _angle_mark(canvas, a, b, c, labels[0])
        _angle_mark(canvas, b, c, a, labels[1])
        _angle_mark(canvas, c, a, b, labels[2], label_at=36)

    return draw


def _right_triangle(
    shape: tuple[float, float], legs: tuple[str, str], hypotenuse: str, angle_b: str | None = None
) -> Callable[[Draw], None]:
    """Right triangle ABC with the right angle at A (bottom left), AB along the bottom and AC up the left side.

    ``shape`` gives the proportions of AB and AC; ``legs`` label AB and AC, ``hypotenuse`` labels BC (empty
    strings leave a side unlabelled) and ``angle_b`` marks the angle at B.
    """
    scale = 150 / max(shape)
    a = (60.0, 205.0)
    b = (a[0] + shape[0] * scale, a[1])
    c = (a[0], a[1] - shape[1] * scale)

    def draw(canvas: Draw) -> None:
        inside = _centroid((a, b, c))
        _polygon(canvas, (a, b, c))
        _vertex_names(canvas, (a, b, c), "ABC")
        _right_angle(canvas, a, b, c)
        for (start, end), text in zip(((a, b), (a, c), (b, c)), (*legs, hypotenuse), strict=True):
            if text:
                _side_label(canvas, start, end, text, inside, offset=16)
        if angle_b is not None:
            _angle_mark(canvas, b, c, a, angle_b, radius=22, label_at=46)

    return draw


def _isosceles(apex: str, base: str) -> Callable[[Draw], None]:
    """Isosceles triangle ABC with CA = CB (tick marks), apex angle at C and one base angle marked."""
    a, b = (68.0, 215.0), (188.0, 215.0)
    c = _apex(a, b, 70, 70)
    points = (a, b, c)

    def draw(canvas: Draw) -> None:
        _polygon(canvas, points)
        _vertex_names(canvas, points, "ABC")
        _tick(canvas, c, a)
        _tick(canvas, c, b)
        _angle_mark(canvas, c, a, b, apex, radius=22, label_at=44)
        _angle_mark(canvas, a, b, c, base)

    return draw


def _exterior_angle(first: str, second: str, exterior: str) -> Callable[[Draw], None]:
    """Triangle ABC with side AB extended past B to D; interior angles at A and C, exterior angle at B."""
    a, b = (30.0, 190.0), (170.0, 190.0)
    c = _apex(a, b, 45, 60)
    d = (236.0, 190.0)

    def draw(canvas: Draw) -> None:
        _polygon(canvas, (a, b, c))
        canvas.line([b, d], fill=_INK, width=_LINE_WIDTH)
        _vertex_names(canvas, (a, b, c), "ABC")
        _text(canvas, (d[0] - 4, d[1] + 14), "D")
        _angle_mark(canvas, a, b, c, first)
        _angle_mark(canvas, c, a, b, second, label_at=36)
        _angle_mark(canvas, b, d, c, exterior, radius=20, label_at=38)

    return draw


def _triangle_area(base: str, height: str) -> Callable[[Draw], None]:
    """Triangle ABC with base AB and the dashed altitude from C to AB."""
    a, b, c = (30.0, 200.0), (226.0, 200.0), (160.0, 60.0)
    foot = (160.0, 200.0)

    def draw(canvas: Draw) -> None:
        _polygon(canvas, (a, b, c))
        _vertex_names(canvas, (a, b, c), "ABC")
        _dashed(canvas, c, foot)
        _right_angle(canvas, foot, c, b, size=10)
        _side_label(canvas, a, b, base, c, offset=24)
        _text(canvas, (174.0, 130.0), height)

    return draw


def _circle(segment: str, text: str) -> Callable[[Draw], None]:
    """A circle with centre O and a marked radius (``segment="radius"``) or diameter (``"diameter"``)."""
    (x, y), r = _CIRCLE_CENTRE, _CIRCLE_RADIUS

    def draw(canvas: Draw) -> None:
        canvas.ellipse((x - r, y - r, x + r, y + r), outline=_INK, width=_LINE_WIDTH)
        _dot(canvas, (x, y))
        start = (x, y) if segment == "radius" else (x - r, y)
        canvas.line([start, (x + r, y)], fill=_ACCENT, width=_LINE_WIDTH)
        _text(canvas, (x - 6, y + 14) if segment == "radius" else (x, y + 14), "O")
        label_x = (x + r / 2) if segment == "radius" else x - r / 2
        _text(canvas, (label_x, y - 12), text, _ACCENT)

    return draw


def _rectangle(width: str, height: str, diagonal: str | None = None) -> Callable[[Draw], None]:
    """Rectangle ABCD with labelled width (bottom) and height (right); optionally the diagonal AC."""
    a, b, c, d = (48.0, 190.0), (208.0, 190.0), (208.0, 70.0), (48.0, 70.0)

    def draw(canvas: Draw) -> None:
        points = (a, b, c, d)
        inside = _centroid(points)
        _polygon(canvas, points)
        _vertex_names(canvas, points, "ABCD")
        for corner, first, second in ((a, b, d), (b, c, a), (c, d, b), (d, a, c)):
            _right_angle(canvas, corner, first, second, size=10)
        if width:
            _side_label(canvas, a, b, width, inside, offset=16)
        if height:
            _side_label(canvas, b, c, height, inside, offset=18)
        if diagonal is not None:
            canvas.line([a, c], fill=_ACCENT, width=_LINE_WIDTH)
            _text(canvas, (136.0, 116.0), diagonal, _ACCENT)

    return draw


def _square(side: str) -> Callable[[Draw], None]:
    """Square ABCD with one side labelled and equal-side ticks."""
    a, b, c, d = (58.0, 198.0), (198.0, 198.0), (198.0, 58.0), (58.0, 58.0)

    def draw(canvas: Draw) -> None:
        points = (a, b, c, d)
        _polygon(canvas, points)
        _vertex_names(canvas, points, "ABCD")
        for start, end in ((a, b), (b, c), (c, d), (d, a)):
            _tick(canvas, start, end)
        for corner, first, second in ((a, b, d), (b, c, a), (c, d, b), (d, a, c)):
            _right_angle(canvas, corner, first, second, size=10)
        _side_label(canvas, a, b, side, _centroid(points), offset=18)

    return draw


def _quadrilateral(angles: tuple[str, str, str, str]) -> Callable[[Draw], None]:
    """Quadrilateral ABCD drawn with angles 90°, 80°, 110° and 80° (A bottom left, B bottom right), labelled."""
    a, b = (50.0, 200.0), (210.0, 200.0)
    c = (b[0] + 130 * math.cos(math.radians(100)), b[1] - 130 * math.sin(math.radians(100)))
    d = (a[0], c[1] - (c[0] - a[0]) * math.tan(math.radians(10)))
    points = (a, b, c, d)

    def draw(canvas: Draw) -> None:
        _polygon(canvas, points)
        _vertex_names(canvas, points, "ABCD")
        for index, text in enumerate(angles):
            vertex, after, before = points[index], points[(index + 1) % 4], points[index - 1]
            _angle_mark(canvas, vertex, after, before, text, label_at=36)

    return draw


def _straight_line(known: str, unknown: str) -> Callable[[Draw], None]:
    """Line AB through O with ray OC, splitting the straight angle into ``unknown`` (left) and ``known``."""
    a, b, o = (24.0, 170.0), (232.0, 170.0), (128.0, 170.0)
    c = (128.0 + 110 * math.cos(math.radians(-50)), 170.0 + 110 * math.sin(math.radians(-50)))

    def draw(canvas: Draw) -> None:
        canvas.line([a, b], fill=_INK, width=_LINE_WIDTH)
        canvas.line([o, c], fill=_INK, width=_LINE_WIDTH)
        _dot(canvas, o)
        _text(canvas, (a[0] + 4, a[1] + 16), "A")
        _text(canvas, (b[0] - 4, b[1] + 16), "B")
        _text(canvas, (o[0], o[1] + 16), "O")
        _text(canvas, _away(c, o, 12), "C")
        _angle_mark(canvas, o, c, b, unknown, radius=20, label_at=40)
        _angle_mark(canvas, o, a, c, known, radius=26, label_at=48)

    return draw


def _vertical_angles(known: str, unknown: str) -> Callable[[Draw], None]:
    """Lines AB and CD crossing at O, with an angle and its vertical (opposite) angle marked."""
    o = (128.0, 128.0)
    rise = math.tan(math.radians(32.5))
    a, b = (36.0, 128.0 + 92 * rise), (220.0, 128.0 - 92 * rise)
    c, d = (36.0, 128.0 - 92 * rise), (220.0, 128.0 + 92 * rise)

    def draw(canvas: Draw) -> None:
        canvas.line([a, b], fill=_INK, width=_LINE_WIDTH)
        canvas.line([c, d], fill=_INK, width=_LINE_WIDTH)
        _dot(canvas, o)
        for point, name in ((a, "A"), (b, "B"), (c, "C"), (d, "D")):
            _text(canvas, _away(point, o, 12), name)
        _text(canvas, (o[0], o[1] + 18), "O")
        _angle_mark(canvas, o, b, d, known, radius=24, label_at=48)
        _angle_mark(canvas, o, c, a, unknown, radius=24, label_at=48)

    return draw


# --------------------------------------------------------------------------------------------------------------
# The questions

_QUESTIONS: tuple[_Question, ...] = (
    _Question(
        "In triangle ABC, angle A measures 50° and angle B measures 60°. Find x, the measure of angle C in degrees.",
        "70",
        _triangle_angles((50, 60), ("50°", "60°", "x°")),
    ),
    _Question(
        "Triangle ABC has a right angle at A and angle B measures 35°. Find x, the measure of angle C in degrees.",
        "55",
        _right_triangle((1, math.tan(math.radians(35))), ("", ""), "", angle_b="35°"),
    ),
    _Question(
        "Triangle ABC is isosceles with CA = CB and angle C measures 40°. Find x, the measure of angle A in degrees.",
        "70",
        _isosceles("40°", "x°"),
    ),
    _Question(
        "Side AB of triangle ABC is extended to D. Angle A measures 45° and angle C measures 75°. "
        "Find x, the measure of the exterior angle CBD in degrees.",
        "120",
        _exterior_angle("45°", "75°", "x°"),
    ),
    _Question(
        "Triangle ABC has a right angle at A, AB = 4 and AC = 3. Find x, the length of the hypotenuse BC.",
        "5",
        _right_triangle((4, 3), ("4", "3"), "x"),
    ),
    _Question(
        "Triangle ABC has a right angle at A, AB = 12 and AC = 5. Find x, the length of BC.",
        "13",
        _right_triangle((12, 5), ("12", "5"), "x"),
    ),
    _Question(
        "Triangle ABC has a right angle at A, hypotenuse BC = 10 and AC = 6. Find x, the length of AB.",
        "8",
        _right_triangle((8, 6), ("x", "6"), "10"),
    ),
    _Question(
        "Triangle ABC has a right angle at A and AB = AC = 2. Find x, the length of BC, in simplest radical form.",
        "2\\sqrt{2}",
        _right_triangle((2, 2), ("2", "2"), "x"),
    ),
    _Question(
        "Triangle ABC has a right angle at A, angle B measures 30° and the hypotenuse BC = 10. "
        "Find x, the length of AC.",
        "5",
        _right_triangle((math.sqrt(3), 1), ("", "x"), "10", angle_b="30°"),
    ),
    _Question(
        "The circle with centre O has radius 5. Find its circumference, in terms of \\pi.",
        "10\\pi",
        _circle("radius", "5"),
    ),
    _Question(
        "The circle with centre O has radius 6. Find its area, in terms of \\pi.",
        "36\\pi",
        _circle("radius", "6"),
    ),
    _Question(
        "A diameter of the circle with centre O measures 14. Find the radius of the circle.",
        "7",
        _circle("diameter", "14"),
    ),
    _Question(
        "A diameter of the circle with centre O measures 10. Find the area of the circle, in terms of \\pi.",
        "25\\pi",
        _circle("diameter", "10"),
    ),
    _Question(
        "A diameter of the circle with centre O measures 12. Find the circumference of the circle, "
        "rounded to the nearest hundredth.",
        "37.70",
        _circle("diameter", "12"),
    ),
    _Question(
        "Rectangle ABCD has AB = 8 and BC = 5. Find the area of the rectangle.",
        "40",
        _rectangle("8", "5"),
    ),
    _Question(
        "Rectangle ABCD has AB = 8 and BC = 6. Find x, the length of the diagonal AC.",
        "10",
        _rectangle("8", "6", diagonal="x"),
    ),
    _Question(
        "Rectangle ABCD has AB = 9 and BC = 4. Find the perimeter of the rectangle.",
        "26",
        _rectangle("9", "4"),
    ),
    _Question(
        "In triangle ABC the base AB is 10 and the height from C to AB is 6. Find the area of the triangle.",
        "30",
        _triangle_area("10", "6"),
    ),
    _Question(
        "Points A, O and B lie on a straight line and angle AOC measures 130°. "
        "Find x, the measure of angle COB in degrees.",
        "50",
        _straight_line("130°", "x°"),
    ),
    _Question(
        "Lines AB and CD intersect at O and angle BOD measures 65°. Find x, the measure of angle AOC in degrees.",
        "65",
        _vertical_angles("65°", "x°"),
    ),
    _Question(
        "ABCD is a square with side AB = 7. Find the area of the square.",
        "49",
        _square("7"),
    ),
    _Question(
        "In quadrilateral ABCD, angle A measures 90°, angle B measures 80° and angle C measures 110°. "
        "Find x, the measure of angle D in degrees.",
        "80",
        _quadrilateral(("90°", "80°", "110°", "x°")),
    ),
)


def _figure(question: _Question) -> Image.Image:
    image = Image.new("RGB", FIGURE_SIZE, "white")
    question.draw(ImageDraw.Draw(image))
    return image


def _prompt(question: _Question) -> str:
    return f"<image>\n{question.text} {ANSWER_INSTRUCTIONS}"


def demo_samples() -> list[Sample]:
    """The demo questions as fresh samples: one figure each, the answer as ``label``, ``index`` = position."""
    return [
        Sample(
            index=index,
            prompt=_prompt(question),
            multimodal_inputs={"images": [_figure(question)]},
            label=question.label,
            metadata={"source": DEMO_SOURCE},
        )
        for index, question in enumerate(_QUESTIONS)
    ]


def demo_records() -> list[dict[str, Any]]:
    """The demo questions as dataset lines for ``fsm-rollout run --data`` (figures as PNG data URLs)."""
    return [
        {
            "prompt": _prompt(question),
            "images": [encode_pil_image(_figure(question))],
            "label": question.label,
            "metadata": {"source": DEMO_SOURCE},
        }
        for question in _QUESTIONS
    ]
