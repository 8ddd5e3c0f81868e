"""The results file ``fsm-rollout run`` writes: image features summarised unless asked for, images as data URLs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import orjson
import torch
from PIL import Image

from fsm_rollout.cli.run_report import write_results
from fsm_rollout.multimodal import encode_pil_image
from fsm_rollout.sample import Sample


def samples_sharing_an_image() -> list[Sample]:
    image = Image.new("RGB", (8, 6), (10, 200, 30))
    samples = []
    for index in range(3):
        sample = Sample(index=index, prompt="p", tokens=[1, 2, 3], response_length=1, loss_mask=[1])
        sample.multimodal_inputs = {"images": [image]}
        sample.multimodal_train_inputs = {
            "pixel_values": torch.arange(12, dtype=torch.float32).reshape(3, 4),
            "image_grid_thw": np.array([[1, 2, 2]], dtype=np.int64),
        }
        samples.append(sample)
    return samples


def test_features_are_summarised_and_the_samples_keep_theirs(tmp_path: Path) -> None:
    samples = samples_sharing_an_image()
    write_results(samples, tmp_path / "results.jsonl")
    rows = [orjson.loads(line) for line in (tmp_path / "results.jsonl").read_bytes().splitlines()]
    assert [row["multimodal_train_inputs"] for row in rows] == [
        {"pixel_values": {"dtype": "float32", "shape": [3, 4]}, "image_grid_thw": {"dtype": "int64", "shape": [1, 3]}}
    ] * 3
    url = encode_pil_image(samples[0].multimodal_inputs["images"][0])
    assert [row["multimodal_inputs"]["images"] for row in rows] == [[url]] * 3
    assert all(isinstance(sample.multimodal_train_inputs["pixel_values"], torch.Tensor) for sample in samples)


def test_include_features_writes_them_whole(tmp_path: Path) -> None:
    samples = samples_sharing_an_image()
    write_results(samples, tmp_path / "results.jsonl", include_features=True)
    row = orjson.loads((tmp_path / "results.jsonl").read_bytes().splitlines()[0])
    assert row["multimodal_train_inputs"] == samples[0].to_dict()["multimodal_train_inputs"]
    assert row["multimodal_train_inputs"]["pixel_values"]["data"] == [float(value) for value in range(12)]
