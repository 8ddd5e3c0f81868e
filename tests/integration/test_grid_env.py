"""The visual grid environment: its maze, moves and image observations, and ``fsm-rollout run --env
fsm_rollout.envs.grid`` end to end against the fake server with its Qwen2-VL-like image render."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from fsm_rollout.envs.grid import CELL_PIXELS, GridEnv, Maze, build_env, demo_samples, last_move, maze_of
from fsm_rollout.testing.fake_vllm import GENERATE_PATH, FakeVLLMServer, QwenLikeImageRender, ScriptedTurn
from fsm_rollout.testing.tokenizer import qwen_tokenizer_dir

PATH = ["right"] * 3 + ["down"] * 3  # along the top row, then down the last column: never walled


@pytest.mark.parametrize("seed", range(20))
def test_every_maze_keeps_the_top_row_and_last_column_open(seed: int) -> None:
    maze = Maze.from_seed(4, seed)
    at = maze.start
    for name in PATH:
        at, legal = maze.move(at, name)
        assert legal
    assert at == maze.goal and maze.walls and maze.start not in maze.walls


def test_moves_stop_at_walls_and_edges_and_the_goal_ends_the_episode() -> None:
    env = build_env(sample=SimpleNamespace(metadata={"grid": {"size": 4, "seed": 3}}, index=0), args=None)
    env.reset()
    observation, done, info = env.step("I go up.")
    assert "blocked" in observation["text"] and observation["agent"] == (0, 0) and not done
    observation, done, _ = env.step("no idea")
    assert "No move found" in observation["text"]
    for name in PATH[:-1]:
        _, done, info = env.step(f"<move>{name}</move>")
        assert not done and info["reward"] == 0.0
    observation, done, info = env.step("Down, finally: down")
    assert done and info["reward"] == 1.0 and "reached the goal" in observation["text"]


def test_the_observation_is_text_and_the_board_as_a_pil_image() -> None:
    env = GridEnv(Maze.from_seed(4, 1))
    message = env.format_observation(env.step("right")[0])
    text, image = message["content"]
    assert message["role"] == "user" and text["type"] == "text" and image["type"] == "image"
    board = image["image"]
    assert board.size == (4 * CELL_PIXELS, 4 * CELL_PIXELS) and board.mode == "RGB"
    assert board.getpixel((CELL_PIXELS + CELL_PIXELS // 2, CELL_PIXELS // 2))[0] > 150  # the agent, red, in (1, 0)


def test_demo_samples_show_the_board_the_environment_plays() -> None:
    (sample,) = demo_samples(1)
    maze = maze_of(sample)
    assert sample.prompt.startswith("<image>")
    assert sample.multimodal_inputs["images"][0].tobytes() == maze.draw(maze.start).tobytes()


def test_snapshot_and_restore_carry_the_agent() -> None:
    env = GridEnv(Maze.from_seed(4, 2))
    env.step("right")
    other = GridEnv(Maze.from_seed(4, 2))
    other.restore(env.snapshot())
    assert (other.agent, other.moves) == (env.agent, env.moves) == ((1, 0), 1)
    assert last_move("left, no: RIGHT") == "right" and last_move("stay") is None


@pytest.fixture
async def image_server(tokenizer: Any) -> AsyncIterator[FakeVLLMServer]:
    async with FakeVLLMServer(tokenizer, model="fake-model", render_features=QwenLikeImageRender(tokenizer)) as server:
        yield server


async def test_fsm_rollout_run_with_the_grid_env_rolls_out_image_observations(
    image_server: FakeVLLMServer, tmp_path: Path
) -> None:
    image_server.script([ScriptedTurn(text=f"<move>{name}</move>") for name in PATH])
    command = [sys.executable, "-m", "fsm_rollout.cli", "run", "--engine-url", image_server.url,
               "--model", "fake-model", "--tokenizer", str(qwen_tokenizer_dir()), "--env", "fsm_rollout.envs.grid",
               "--limit", "1", "--n-samples-per-prompt", "1", "--max-turns", "8", "--max-new-tokens", "800",
               "--image-merge-size", "2", "--out", str(tmp_path / "results.jsonl"), "--quiet"]  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**_env(), "HF_HUB_OFFLINE": "1"}
    )
    _, stderr = await process.communicate()
    assert process.returncode == 0, stderr.decode()
    (row,) = [orjson.loads(line) for line in (tmp_path / "results.jsonl").read_bytes().splitlines()]
    assert (row["status"], row["reward"], row["metadata"]["rollout_reason"]) == ("completed", 1.0, "env_done")
    counts = [len(((r.body.get("features") or {}).get("kwargs_data") or {}).get("image") or [])
              for r in image_server.requests_to(GENERATE_PATH)]  # fmt: skip
    assert counts == [1, 2, 3, 4, 5, 6]  # the prompt's board, then one more board per turn


def _env() -> dict[str, str]:
    import os

    return {key: value for key, value in os.environ.items() if key != "VLLM_API_KEY"}
