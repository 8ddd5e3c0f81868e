"""The demo's geometry figures, drawn with Pillow's default font on a white canvas.

Triangles with labelled sides and angles, circles with a marked radius or diameter, rectangles, angles on lines.
Each builder returns a :data:`Figure`, which :func:`draw_figure` turns into an RGB image; nothing is random, so
every call gives the same pixels and the same PNG bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import lru_cache

from PIL import Image, ImageDraw, ImageFont

FIGURE_SIZE = (256, 256)
"""Width and height of every figure, in pixels."""

Point = tuple[float, float]
Draw = ImageDraw.ImageDraw
Figure = Callable[[Draw], None]
"""Draws one figure on a white ``FIGURE_SIZE`` canvas."""

_INK = (20, 20, 20)
_ACCENT = (200, 30, 30)
_LINE_WIDTH = 2


def draw_figure(figure: Figure) -> Image.Image:
    """``figure`` drawn on a fresh white RGB ``FIGURE_SIZE`` image."""
    image = Image.new("RGB", FIGURE_SIZE, "white")
    figure(ImageDraw.Draw(image))
    return image


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


def triangle_angles(shape: tuple[float, float], labels: tuple[str, str, str]) -> Figure:
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


def right_triangle(
    shape: tuple[float, float], legs: tuple[str, str], hypotenuse: str, angle_b: str | None = None
) -> Figure:
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


def isosceles(apex: str, base: str) -> Figure:
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


def exterior_angle(first: str, second: str, exterior: str) -> Figure:
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


def triangle_area(base: str, height: str) -> Figure:
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


def circle(segment: str, text: str) -> Figure:
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


def rectangle(width: str, height: str, diagonal: str | None = None) -> Figure:
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


def square(side: str) -> Figure:
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


def quadrilateral(angles: tuple[str, str, str, str]) -> Figure:
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


def straight_line(known: str, unknown: str) -> Figure:
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


def vertical_angles(known: str, unknown: str) -> Figure:
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
