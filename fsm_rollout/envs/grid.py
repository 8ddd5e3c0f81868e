"""A visual environment: walk a grid to its goal, seeing the board as an image drawn with Pillow every turn.

The board is ``size`` x ``size`` cells with a few walls, the agent (a red disc) and the goal (a green square). The
prompt shows the first board; each turn the model names a move (``up``, ``down``, ``left`` or ``right``; the last
one it writes counts, ``<move>left</move>`` works too) and the observation is a user message holding a line of text
and the new board as a PIL image, which the rollout has the engine render and encode (images in observations are
encoded by the engine, exactly as the prompt's). Reaching the goal ends the episode with reward 1.0; a move into a
wall or off the board keeps the agent in place and says so.

The maze of a sample comes from ``sample.metadata["grid"]`` (``size``, ``seed``), so the prompt's board and the
environment's agree; :func:`demo_samples` makes such samples, and ``fsm-rollout run --env fsm_rollout.envs.grid``
runs them when no ``--data`` is given. The bundled default model was not trained on this task: the demo shows the
mechanics (an image per turn, its placeholders and features in the sample), not a model that solves mazes.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any, Final

from fsm_rollout.sample import Sample

CELL_PIXELS: Final = 28
"""Pixels per cell side: a multiple of Qwen2-VL's 28-pixel merged patch, so a cell is one placeholder token."""
DEFAULT_SIZE: Final = 4
MOVES: Final = {"up": (0, -1), "down": (0, 1), "left": (-1, 0), "right": (1, 0)}
_MOVE = re.compile(r"\b(up|down|left|right)\b", re.IGNORECASE)

PROMPT: Final = (
    "You are the red disc on the board in the image. Reach the green square; black cells are walls. "
    "Answer each turn with one move: up, down, left or right."
)


@dataclass(frozen=True)
class Maze:
    """A board: its side, walls, the agent's start and the goal."""

    size: int
    walls: frozenset[tuple[int, int]]
    start: tuple[int, int]
    goal: tuple[int, int]

    @classmethod
    def from_seed(cls, size: int = DEFAULT_SIZE, seed: int = 0) -> Maze:
        """A maze drawn from ``seed``: start and goal in opposite corners, about one wall in six cells, and always a
        path between them (the walls never touch the start row or the goal column)."""
        if not isinstance(size, int) or not 2 <= size <= 16:
            raise ValueError(f"grid size must be an integer from 2 to 16, got {size!r}")
        chooser = random.Random(seed)
        start, goal = (0, 0), (size - 1, size - 1)
        free = [(x, y) for x in range(size) for y in range(1, size) if x != size - 1]
        walls = frozenset(chooser.sample(free, k=min(len(free), size * size // 6)))
        return cls(size=size, walls=walls, start=start, goal=goal)

    def draw(self, agent: tuple[int, int]) -> Any:
        """The board as an RGB PIL image, ``size * CELL_PIXELS`` pixels a side."""
        from PIL import Image, ImageDraw

        side = self.size * CELL_PIXELS
        image = Image.new("RGB", (side, side), (245, 245, 245))
        draw = ImageDraw.Draw(image)
        for x, y in self.walls:
            draw.rectangle(self._box(x, y), fill=(30, 30, 30))
        draw.rectangle(self._box(*self.goal, inset=4), fill=(40, 170, 60))
        draw.ellipse(self._box(*agent, inset=5), fill=(210, 40, 40))
        for line in range(0, side + 1, CELL_PIXELS):
            draw.line([(line, 0), (line, side)], fill=(150, 150, 150))
            draw.line([(0, line), (side, line)], fill=(150, 150, 150))
        return image

    def _box(self, x: int, y: int, inset: int = 0) -> tuple[int, int, int, int]:
        return (x * CELL_PIXELS + inset, y * CELL_PIXELS + inset,
                (x + 1) * CELL_PIXELS - 1 - inset, (y + 1) * CELL_PIXELS - 1 - inset)  # fmt: skip

    def move(self, at: tuple[int, int], name: str) -> tuple[tuple[int, int], bool]:
        """Where a move from ``at`` lands, and whether it was legal (walls and edges stop it)."""
        dx, dy = MOVES[name]
        x, y = at[0] + dx, at[1] + dy
        if not (0 <= x < self.size and 0 <= y < self.size) or (x, y) in self.walls:
            return at, False
        return (x, y), True


def maze_of(sample: Any) -> Maze:
    """The maze ``sample.metadata["grid"]`` describes (size and seed; default: size 4, the sample's index)."""
    metadata = getattr(sample, "metadata", None) or {}
    spec = metadata.get("grid") or {}
    seed = spec.get("seed", getattr(sample, "index", None) or 0)
    return Maze.from_seed(int(spec.get("size", DEFAULT_SIZE)), int(seed))


def last_move(text: str) -> str | None:
    """The last move the text names, lower-cased, or None."""
    found = _MOVE.findall(text)
    return found[-1].lower() if found else None


class GridEnv:
    """One episode on one maze; synchronous (drawing a small board takes well under a millisecond)."""

    def __init__(self, maze: Maze) -> None:
        self.maze = maze
        self.agent = maze.start
        self.moves = 0

    def reset(self) -> None:
        self.agent = self.maze.start
        self.moves = 0

    def step(self, response_text: str) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        name = last_move(response_text)
        if name is None:
            return self._observation("No move found: answer with up, down, left or right."), False, {"reward": 0.0}
        self.agent, legal = self.maze.move(self.agent, name)
        self.moves += 1
        if self.agent == self.maze.goal:
            return self._observation(f"{name}: you reached the goal."), True, {"reward": 1.0}
        text = f"{name}: moved." if legal else f"{name}: blocked, you stay where you are."
        return self._observation(text), False, {"reward": 0.0}

    def _observation(self, text: str) -> dict[str, Any]:
        return {"text": text, "agent": self.agent}

    def format_observation(self, observation: dict[str, Any]) -> dict[str, Any]:
        """A user message: the text, then the board after the move as a PIL image."""
        return {
            "role": "user",
            "content": [
                {"type": "text", "text": observation["text"]},
                {"type": "image", "image": self.maze.draw(observation["agent"])},
            ],
        }

    def close(self) -> None:
        pass

    def snapshot(self) -> dict[str, Any]:
        return {"agent": list(self.agent), "moves": self.moves}

    def restore(self, state: dict[str, Any]) -> None:
        self.agent = (int(state["agent"][0]), int(state["agent"][1]))
        self.moves = int(state["moves"])


def build_env(*, sample: Any, args: Any) -> GridEnv:
    """The environment of one sample: its maze from ``sample.metadata["grid"]``."""
    return GridEnv(maze_of(sample))


def demo_samples(count: int = 8, size: int = DEFAULT_SIZE) -> list[Sample]:
    """``count`` grid prompts (seeds 0 to count-1), each with its first board as the prompt's image."""
    samples = []
    for seed in range(count):
        maze = Maze.from_seed(size, seed)
        samples.append(
            Sample(
                prompt=f"<image>{PROMPT}",
                index=seed,
                label="goal",
                metadata={"grid": {"size": size, "seed": seed}},
                multimodal_inputs={"images": [maze.draw(maze.start)]},
            )
        )
    return samples


__all__ = ["CELL_PIXELS", "MOVES", "PROMPT", "GridEnv", "Maze", "build_env", "demo_samples", "last_move", "maze_of"]
