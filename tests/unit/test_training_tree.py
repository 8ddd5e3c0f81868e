"""The token tree (``fsm_rollout.training_tree``): paths equal the flat rows, every generated token once, prefixes
merged only where every provenance field agrees, packing and unpacking, and the JSON format."""

from __future__ import annotations

import json
from typing import Any, cast

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsm_rollout import Sample, TokenTree, training_sequences, training_tree
from fsm_rollout.training import TreeBuildError

TOKEN = st.integers(0, 4)  # a small vocabulary, so identical prefixes (and look-alikes) are common
LOGPROB = st.sampled_from([-0.25, -0.5, -1.0])
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def sequences(draw: Any, prompt: list[int], version: str | None) -> Sample:
    sample = Sample(tokens=list(prompt))
    for _ in range(draw(st.integers(0, 3))):
        tokens = draw(st.lists(TOKEN, min_size=1, max_size=3))
        if draw(st.booleans()):
            sample.append_response_tokens(tokens, draw(st.lists(LOGPROB, min_size=len(tokens), max_size=len(tokens))))
        else:  # an observation, or the EOS the rollout adds
            sample.append_response_tokens(tokens, trainable=False)
    if version is not None:
        prompt_length = len(sample.tokens) - sample.response_length
        sample.metadata["weight_version_spans"] = [
            {"version": version, "start": p - prompt_length, "end": p - prompt_length + 1}
            for p in range(prompt_length, len(sample.tokens))
            if (sample.loss_mask or [])[p - prompt_length] == 1
        ]
    return sample


@st.composite
def rollouts(draw: Any, prompt: list[int], group: int | None, index: int) -> Sample:
    version = draw(st.sampled_from([None, "3", "4"]))
    chain = [draw(sequences(prompt, version))]
    for _ in range(draw(st.integers(0, 2))):  # forks: the next sequence re-renders a prefix of the last as prompt
        before = chain[-1].tokens
        cut = draw(st.integers(0, len(before)))
        chain.append(draw(sequences(before[:cut] + draw(st.lists(TOKEN, max_size=2)), version)))
    routing = draw(st.sampled_from(["none", "by_token", "random"]))
    for sequence in chain:
        rows = max(len(sequence.tokens) - 1, 0)
        if routing == "by_token":  # the same tokens route alike
            sequence.rollout_routed_experts = np.asarray(sequence.tokens[:rows], dtype=np.int32).reshape(rows, 1, 1)
        elif routing == "random":
            values = draw(st.lists(st.integers(0, 1), min_size=rows, max_size=rows))
            sequence.rollout_routed_experts = np.asarray(values, dtype=np.int32).reshape(rows, 1, 1)
    last = chain[-1]
    last.branches = chain[:-1]
    last.group_index, last.index = group, index
    last.reward = float(draw(st.integers(0, 1)))
    last.status = Sample.Status.COMPLETED
    last.metadata["rollout_reason"] = "env_done"
    return cast(Sample, last)


@st.composite
def batches(draw: Any) -> list[Sample]:
    shared = draw(st.lists(TOKEN, max_size=4))  # a prefix every group's prompt may start with
    out: list[Sample] = []
    for group in range(draw(st.integers(1, 3))):
        prompt = shared + draw(st.lists(TOKEN, max_size=3))
        label = None if draw(st.booleans()) and group == 0 else group
        for _ in range(draw(st.integers(1, 3))):
            out.append(draw(rollouts(prompt, label, len(out))))
    return out


SHARE = st.sampled_from(["group", "all", "none"])


def flat(sequence: Sample) -> dict[str, Any]:
    prompt = len(sequence.tokens) - sequence.response_length
    return {
        "token_ids": list(sequence.tokens),
        "loss_mask": [0] * prompt + list(sequence.loss_mask or []),
        "rollout_log_probs": [0.0] * prompt + list(sequence.rollout_log_probs or []),
    }


def routing_of(sequences: list[Sample], node: Any, at: int) -> bytes | None:
    if node.routed_sequence[at] < 0:
        return None
    rows = sequences[int(node.routed_sequence[at])].rollout_routed_experts
    assert rows is not None
    return bytes(np.asarray(rows[int(node.routed_row[at])]).tobytes())


@PROPERTY
@given(batches(), SHARE)
def test_each_path_is_its_flat_row_and_each_generated_token_is_in_the_tree_once(
    samples: list[Sample], share: str
) -> None:
    tree = training_tree(samples, share=share)  # type: ignore[arg-type]
    rows = training_sequences(samples)
    assert len(tree.leaves) == len(rows)
    for number, row in enumerate(rows):
        path = tree.sequence(number)
        assert {key: path[key] for key in ("token_ids", "loss_mask", "rollout_log_probs")} == flat(row)
        leaf = tree.leaves[number]
        assert (leaf.group_index, leaf.index, leaf.reward, leaf.status) == (
            row.group_index, row.index, row.reward, "completed")  # fmt: skip
        assert leaf.reason == "env_done" and leaf.lineage is None
    generated = sum(sum(row.loss_mask or []) for row in rows)
    assert tree.stats["generated_tokens"] == generated
    assert tree.stats["flat_tokens"] == sum(len(row.tokens) for row in rows)
    assert tree.stats["tree_tokens"] == sum(len(node) for node in tree.nodes) <= tree.stats["flat_tokens"]
    for node in tree.nodes:
        assert node.sequences, "a node no sequence passes through"
        if node.loss_mask.any():  # a generated token is trained once, in its own sequence
            assert len(node.sequences) == 1
        if node.parent >= 0:
            parent = tree.nodes[node.parent]
            assert node.parent < node.id and node.depth == parent.depth + len(parent)
            assert set(node.sequences) <= set(parent.sequences)
        owners = {tree.leaves[s].sample for s in node.sequences}
        if share == "none":
            assert len(node.sequences) == 1
        elif share == "group" and len(owners) > 1:
            assert len({rows[s].group_index for s in node.sequences} - {None}) == 1
            assert all(rows[s].group_index is not None for s in node.sequences)
        for at in range(len(node)):  # merged tokens agree on their routing wherever both recorded it
            if node.routed_sequence[at] >= 0:
                mine = routing_of(rows, node, at)
                for s in node.sequences:
                    theirs = rows[s].rollout_routed_experts
                    depth = node.depth + at
                    if theirs is not None and depth < len(theirs):
                        assert bytes(np.asarray(theirs[depth]).tobytes()) == mine
    if share == "none":
        assert tree.stats["tree_tokens"] == tree.stats["flat_tokens"]


@PROPERTY
@given(batches(), SHARE)
def test_the_tree_misses_no_merge(samples: list[Sample], share: str) -> None:
    """Siblings that start with the same token differ in provenance there, and a node only ends where paths part."""
    tree = training_tree(samples, share=share)  # type: ignore[arg-type]
    rows = training_sequences(samples)
    children: dict[int, list[Any]] = {}
    for node in tree.nodes:
        children.setdefault(node.parent, []).append(node)
    for node in tree.nodes:
        ending = [s for s in node.sequences if tree.leaves[s].nodes[-1] == node.id]
        assert len(children.get(node.id, [])) >= 2 or ending
    for parent, group in children.items():
        if parent < 0:
            continue
        for a in group:
            for b in group:
                if a.id >= b.id or a.token_ids[0] != b.token_ids[0]:
                    continue
                routing = routing_of(rows, a, 0), routing_of(rows, b, 0)
                assert (
                    a.loss_mask[0] == b.loss_mask[0] == 1
                    or a.loss_mask[0] != b.loss_mask[0]
                    or a.rollout_log_probs[0] != b.rollout_log_probs[0]
                    or (None not in routing and routing[0] != routing[1])
                )


@PROPERTY
@given(batches(), SHARE, st.integers(0, 12))
def test_packed_batches_attend_along_paths_and_unpack_to_the_flat_rows(
    samples: list[Sample], share: str, slack: int
) -> None:
    tree = training_tree(samples, share=share)  # type: ignore[arg-type]
    rows = training_sequences(samples)
    limit = max([leaf.length for leaf in tree.leaves] + [1]) + slack
    packed = tree.pack(limit)
    assert all(len(batch) <= limit for batch in packed)
    logprobs = tree.unpack([batch.rollout_log_probs for batch in packed], response_only=True)
    assert [values.tolist() for values in logprobs] == [list(row.rollout_log_probs or []) for row in rows]
    assert [ids.tolist() for ids in tree.unpack([b.token_ids for b in packed])] == [row.tokens for row in rows]
    positions = tree.unpack([batch.position_ids for batch in packed])
    assert all(p.tolist() == list(range(len(row.tokens))) for p, row in zip(positions, rows, strict=True))
    assert sum(int(batch.loss_mask.sum()) for batch in packed) == tree.stats["generated_tokens"]
    for batch in packed:
        mask = batch.attention_mask()
        covered = np.zeros(len(batch), dtype=bool)
        for sequence, index in batch.leaf_token_index.items():
            covered[index] = True
            for k, token in enumerate(index):
                assert set(np.flatnonzero(mask[token]).tolist()) == set(index[: k + 1].tolist())
                assert batch.parent[token] == (index[k - 1] if k else -1)
            trained = index[batch.loss_mask[index] == 1]
            assert (batch.sequence_of_token[trained] == sequence).all()
        assert covered.all()  # nothing in a batch that none of its sequences needs


def grpo_group(prompt: list[int], responses: list[list[int]], group: int = 0) -> list[Sample]:
    out = []
    for number, response in enumerate(responses):
        sample = Sample(group_index=group, index=number, tokens=list(prompt))
        sample.append_response_tokens(response, [-0.5] * len(response))
        out.append(sample)
    return out


def test_a_grpo_group_shares_its_prompt_once() -> None:
    samples = grpo_group(list(range(10)), [[11, 12], [11, 13, 14], [15]])
    tree = training_tree(samples)
    assert tree.stats["flat_tokens"] == 36 and tree.stats["tree_tokens"] == 10 + 6
    assert tree.nodes[0].token_ids.tolist() == list(range(10)) and tree.nodes[0].sequences == [0, 1, 2]
    assert tree.stats["provenance_splits"]["generated"] == 1  # token 11 twice: two generations, each trained once
    assert training_tree(samples, share="none").stats["tree_tokens"] == 36


def test_the_tree_renders_its_spans_sharing_and_splits() -> None:
    text = training_tree(grpo_group(list(range(10)), [[11, 12], [11, 13, 14], [15]])).render()
    assert text.splitlines() == [
        "token tree (share=group): 3 sequences, 4 nodes, 16 tokens for 36 flat (0.444), 6 generated",
        "provenance splits: generated 1",
        "node 0: positions 0-9 (10 tokens, 0 generated), shared by 3",
        "  node 1: positions 10-11 (2 tokens, 2 generated), sequence 0",
        "  node 2: positions 10-12 (3 tokens, 3 generated), sequence 1",
        "  node 3: positions 10-10 (1 tokens, 1 generated), sequence 2",
    ]


def test_groups_share_only_with_share_all() -> None:
    samples = grpo_group([1, 2, 3], [[4]], group=0) + grpo_group([1, 2, 3], [[5]], group=1)
    assert training_tree(samples).stats["tree_tokens"] == 8
    assert training_tree(samples, share="all").stats["tree_tokens"] == 5


def test_routing_that_differs_keeps_prefixes_apart_and_missing_routing_does_not() -> None:
    samples = grpo_group([1, 2, 3], [[4], [5], [6]])
    samples[0].rollout_routed_experts = np.asarray([[[0]], [[1]], [[2]]], dtype=np.int32)
    samples[1].rollout_routed_experts = np.asarray([[[0]], [[7]], [[2]]], dtype=np.int32)
    tree = training_tree(samples)
    assert tree.stats["provenance_splits"]["routed_experts"] == 1
    # the third sample recorded no routing: it shares the first's prefix, whose routing the node keeps
    assert [node.token_ids.tolist() for node in tree.nodes] == [[1], [2, 3], [4], [6], [2, 3, 5]]
    assert tree.nodes[1].sequences == [0, 2] and tree.nodes[4].sequences == [1]
    assert tree.nodes[1].routed_sequence.tolist() == [0, 0] and tree.nodes[1].routed_row.tolist() == [1, 2]


def test_a_fork_shares_its_prompt_but_not_the_tokens_it_generated_before() -> None:
    first = Sample(index=0, group_index=0, tokens=[1, 2])
    first.append_response_tokens([3, 4], [-0.1, -0.2])
    last = Sample(index=0, group_index=0, tokens=[1, 2, 3, 4, 9])  # re-rendered: the old turn is now context
    last.append_response_tokens([5], [-0.3])
    last.branches = [first]
    tree = training_tree([last])
    assert [node.token_ids.tolist() for node in tree.nodes] == [[1, 2], [3, 4], [3, 4, 9, 5]]
    assert tree.stats["provenance_splits"]["loss_mask"] == 1
    assert [leaf.branch for leaf in tree.leaves] == [0, 1]


def test_context_tokens_with_different_logprobs_do_not_merge() -> None:
    a = Sample(group_index=0, tokens=[1, 2], response_length=1, loss_mask=[0], rollout_log_probs=[0.0])
    b = Sample(group_index=0, tokens=[1, 2], response_length=1, loss_mask=[0], rollout_log_probs=[-0.3])
    tree = training_tree([a, b])
    assert tree.stats["provenance_splits"]["log_probs"] == 1 and tree.stats["tree_tokens"] == 3


def image_sample(pixels: float, answer: int = 7) -> Sample:
    sample = Sample(group_index=0, tokens=[1, 99, 99, 2])
    sample.append_response_tokens([answer], [-0.5])
    sample.multimodal_train_inputs = {
        "pixel_values": np.full((4, 3), pixels, dtype=np.float32),
        "image_grid_thw": np.asarray([[1, 2, 2]]),
    }
    return sample


def test_images_merge_by_content_hash_and_keep_their_placeholder_offsets() -> None:
    same = training_tree([image_sample(0.5), image_sample(0.5)], image_token_id=99)
    assert same.nodes[0].token_ids.tolist() == [1, 99, 99, 2] and len(same.nodes[0].sequences) == 2
    [ref] = same.nodes[0].images
    assert (ref.offset, ref.length, ref.first, ref.sequence, ref.image) == (1, 2, 0, 0, 0)
    assert ref.hash.startswith("sha256:")
    other = training_tree([image_sample(0.5), image_sample(0.25)], image_token_id=99)
    assert [node.token_ids.tolist() for node in other.nodes] == [[1], [99, 99, 2, 7], [99, 99, 2, 7]]
    assert other.stats["provenance_splits"]["images"] == 1
    unplaced = training_tree([image_sample(0.5), image_sample(0.25)])  # placeholders unknown: features as a whole
    assert unplaced.stats["provenance_splits"]["multimodal"] == 1 and len(unplaced.nodes) == 2
    with pytest.raises(TreeBuildError, match="1 images in multimodal_train_inputs but 2 runs of the image placeholder"):
        training_tree([image_sample(0.5, answer=99)], image_token_id=99)


def test_packing_names_what_cannot_fit() -> None:
    tree = training_tree(grpo_group(list(range(6)), [[7], [8]]))
    with pytest.raises(TreeBuildError, match=r"tree node 0 .* 6 tokens, more than max_tokens=5"):
        tree.pack(5)
    with pytest.raises(TreeBuildError, match=r"training sequence 0 .* 7 tokens, more than max_tokens=6"):
        tree.pack(6)
    batches = tree.pack(7)  # the prompt goes again, untrained, with the second sequence
    assert [len(batch) for batch in batches] == [7, 7]
    assert tree.stats["tree_tokens"] == 8


def test_bad_input_is_a_clear_error() -> None:
    with pytest.raises(TreeBuildError, match="share must be"):
        training_tree([], share="some")  # type: ignore[arg-type]
    with pytest.raises(TreeBuildError, match="item 0 is"):
        training_tree([3])  # type: ignore[list-item]
    bad = Sample(tokens=[1], response_length=1, loss_mask=[1, 1], rollout_log_probs=[0.0])
    with pytest.raises(TreeBuildError, match="loss_mask has 2 entries for response_length 1"):
        training_tree([bad])
    with pytest.raises(TreeBuildError, match="call pack"):
        training_tree([]).unpack([])


@settings(max_examples=40, deadline=None)
@given(batches(), SHARE)
def test_the_tree_round_trips_through_json_and_builds_from_sample_rows(samples: list[Sample], share: str) -> None:
    tree = training_tree(samples, share=share)  # type: ignore[arg-type]
    data = tree.to_dict()
    assert data["version"] == 1 and data["format"] == "fsm-rollout token tree"
    again = TokenTree.from_dict(json.loads(json.dumps(data)))
    assert again.to_dict() == data
    rows = [json.loads(json.dumps(sample.to_dict())) for sample in samples]
    assert training_tree(rows, share=share).to_dict() == data  # type: ignore[arg-type]
    with pytest.raises(TreeBuildError, match="version 0"):
        TokenTree.from_dict({**data, "version": 0})


def test_inspect_tree_prints_the_tree_of_a_results_file(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from fsm_rollout.cli import main

    results = tmp_path / "results.jsonl"
    rows = grpo_group(list(range(10)), [[11, 12], [11, 13, 14], [15]])
    results.write_text("".join(json.dumps(sample.to_dict()) + "\n" for sample in rows))
    assert main(["inspect", "--tree", str(results)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("token tree (share=group): 3 sequences, 4 nodes, 16 tokens for 36 flat")
    assert "node 0: positions 0-9 (10 tokens, 0 generated), shared by 3" in out
    assert main(["inspect", "--tree", str(results), "--share", "none"]) == 0
    assert "36 tokens for 36 flat" in capsys.readouterr().out
    (tmp_path / "bad.jsonl").write_text("{nope\n")
    assert main(["inspect", "--tree", str(tmp_path / "bad.jsonl")]) == 2
    assert "line 1 is not JSON" in capsys.readouterr().err
    assert main(["inspect"]) == 2
    assert "give a TRACE" in capsys.readouterr().err


def test_feature_summaries_from_a_results_file_compare_by_their_text() -> None:
    """``fsm-rollout run`` writes features as dtype and shape unless asked for the values: those still compare."""
    rows = grpo_group([1, 2], [[3], [4], [5]])
    for sample, shape in zip(rows, ([4, 3], [4, 3], [8, 3]), strict=True):
        sample.multimodal_train_inputs = {"pixel_values": {"dtype": "float32", "shape": shape}}
    tree = training_tree([json.loads(json.dumps(sample.to_dict())) for sample in rows])
    assert [node.sequences for node in tree.nodes] == [[0, 1], [0], [1], [2]]
    assert tree.stats["provenance_splits"]["multimodal"] == 1


def test_rows_with_summarised_features_share_only_when_their_images_are_equal() -> None:
    """A results file writes image features as summaries (dtype and shape): the tree builds, and the rows' images
    (data URLs) decide what may share."""
    summary = {"pixel_values": {"dtype": "float32", "shape": [4, 8]}, "image_grid_thw": {"dtype": "int64",
               "shape": [1, 3]}}  # fmt: skip

    def row(image: str, answer: int) -> dict[str, object]:
        made = Sample(group_index=0, index=answer, tokens=[5, 6, 7, 8])
        made.append_response_tokens([answer, answer + 1], [-1.0, -1.0])
        data = made.to_dict()
        data["multimodal_train_inputs"] = summary
        data["multimodal_inputs"] = {"images": [image]}
        return data

    same = training_tree([row("data:image/png;base64,AAAA", 10), row("data:image/png;base64,AAAA", 20)])
    apart = training_tree([row("data:image/png;base64,AAAA", 10), row("data:image/png;base64,BBBB", 20)])
    assert same.stats["tree_tokens"] == 4 + 2 + 2 < same.stats["flat_tokens"]
    assert apart.stats["tree_tokens"] == apart.stats["flat_tokens"] == 12
    assert apart.stats["provenance_splits"]["multimodal"] == 1
