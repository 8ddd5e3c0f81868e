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


@pytest.mark.parametrize("share", ["group", "all"])
def test_lists_struct_refuses_build_the_same_tree(share: Any) -> None:
    """Sequences whose arrays are not plain lists (numpy arrays, tuples, numpy numbers) are read one by one, next
    to plain lists read in one pass: the tree is the same either way."""
    samples = []
    for index in range(6):
        sample = Sample(index=index, group_index=0, tokens=[5, 6, 7])
        sample.append_response_tokens([8 + index % 2, 9], [-0.5, -0.25])
        samples.append(sample)
    samples[1].tokens = np.asarray(samples[1].tokens, dtype=np.int32)  # type: ignore[assignment]
    samples[2].rollout_log_probs = tuple(samples[2].rollout_log_probs or ())  # type: ignore[assignment]
    samples[3].tokens = [np.int64(token) for token in samples[3].tokens]  # type: ignore[misc]
    samples[4].rollout_log_probs = [-1, -2]  # ints: read as floats
    samples[5].loss_mask = None
    same_trees(training_tree(samples, share=share), reference_tree(samples, share=share), 100)
