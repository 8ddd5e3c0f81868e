"""The default model's training data: the copy the engine ships is what the recipe-data module writes today."""

from __future__ import annotations

import ast
import pathlib

import fsm_rollout
from fsm_rollout.engine.local.default_model import (
    RECIPE,
    SHIPPED_DATA,
    TrainingData,
    read_training_data,
    write_training_data,
)
from tools.default_model_data import recipe_training_data


def test_the_shipped_data_is_what_the_recipe_writes_today(tmp_path: pathlib.Path) -> None:
    fresh = recipe_training_data()
    assert len(fresh.conversations) == RECIPE["conversations"]
    # on failure: python -m tools.default_model_data
    assert fresh.to_json() == read_training_data().to_json()
    assert write_training_data(fresh, tmp_path / "data.json.gz").read_bytes() == SHIPPED_DATA.read_bytes()


def test_training_data_round_trips_through_json_and_refuses_other_json() -> None:
    import pytest

    shipped = read_training_data()
    assert TrainingData.from_json(shipped.to_json()) == shipped
    with pytest.raises(ValueError, match="not training data"):
        TrainingData.from_json({"conversations": []})


def test_the_engine_imports_nothing_from_testing_data_or_envs() -> None:
    engine = pathlib.Path(fsm_rollout.__file__).parent / "engine"
    found = []
    for path in sorted(engine.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else ([node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            )
            found += [
                f"{path.name}: {name}"
                for name in names
                if name.startswith(("fsm_rollout.testing", "fsm_rollout.data", "fsm_rollout.envs"))
            ]
    assert found == []
