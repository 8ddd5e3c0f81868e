"""The build of :func:`training_tree` (rows stored only where recorded) gives the tree the original build gives
(``reference_tree``, every row stored):
the same nodes in the same order, the same leaves, provenance splits and packed batches, on batches with forks,
groups, images, routed experts and every ``share`` mode."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given

from fsm_rollout import Sample, training_tree
from fsm_rollout.training.tree import reference_tree
from tests.unit.test_training_tree import PROPERTY, batches, image_sample


def same_trees(made: Any, expected: Any, max_tokens: int) -> None:
    assert made.to_dict() == expected.to_dict()
    assert made.stats == expected.stats
    for mine, theirs in zip(made.pack(max_tokens), expected.pack(max_tokens), strict=True):
        for name in ("token_ids", "position_ids", "parent", "loss_mask", "sequence_of_token", "ancestors"):
            assert np.array_equal(getattr(mine, name), getattr(theirs, name))
        assert mine.rollout_log_probs.tobytes() == theirs.rollout_log_probs.tobytes()
        assert mine.weight_versions == theirs.weight_versions and mine.images == theirs.images


@PROPERTY
@given(samples=batches())
def test_the_build_is_the_reference_build(samples: list[Sample]) -> None:
    for share in ("group", "all", "none"):
        expected = reference_tree(samples, share=share)
        longest = max([1, *(leaf.length for leaf in expected.leaves)])
        same_trees(training_tree(samples, share=share), expected, 2 * longest)


@pytest.mark.parametrize("share", ["group", "all", "none"])
def test_images_and_features_build_the_same_tree(share: Any) -> None:
    samples = [image_sample(0.5), image_sample(0.5, answer=8), image_sample(0.25), image_sample(0.5)]
    for index, sample in enumerate(samples):
        sample.index, sample.group_index = index, index // 3
    for image_token_id in (None, 99):
        expected = reference_tree(samples, share=share, image_token_id=image_token_id)
        same_trees(training_tree(samples, share=share, image_token_id=image_token_id), expected, 10_000)
