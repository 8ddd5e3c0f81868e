"""Practice questions: the demo's kinds with fresh numbers, reproducible, graded right by the Geo3K grader."""

from __future__ import annotations

import re

import pytest

from fsm_rollout.data.demo import demo_questions
from fsm_rollout.data.figures import FIGURE_SIZE
from fsm_rollout.data.practice import KINDS, PRACTICE_SOURCE, practice_questions, practice_samples
from fsm_rollout.envs.geo3k import parse_number, score_answer


def test_the_same_seed_draws_the_same_questions_and_another_seed_others() -> None:
    first = [drawn.question.text for drawn in practice_questions(40, seed=3)]
    assert first == [drawn.question.text for drawn in practice_questions(40, seed=3)]
    assert first != [drawn.question.text for drawn in practice_questions(40, seed=4)]


def test_no_practice_question_is_a_demo_item() -> None:
    demo = {question.text for question in demo_questions()}
    drawn = practice_questions(2_000, seed=11)
    assert not demo & {item.question.text for item in drawn}
    assert {item.kind for item in drawn} == set(KINDS)


def test_every_kind_of_the_demo_is_drawn_in_turn() -> None:
    drawn = practice_questions(len(KINDS) * 2, seed=1)
    assert [item.kind for item in drawn] == list(KINDS) * 2


@pytest.mark.parametrize("kind", list(KINDS))
def test_labels_are_answers_the_grader_reads_and_accepts(kind: str) -> None:
    for item in practice_questions(30, seed=5, kinds=[kind]):
        label = item.question.label
        assert score_answer(label, label) == 1.0, label
        assert parse_number(label) is not None, label


def test_some_answers_check_out_against_their_questions() -> None:
    # the arithmetic behind a few kinds, checked from the numbers in the question's text
    def numbers(text: str) -> list[int]:
        return [int(number) for number in re.findall(r"\d+", text)]

    for item in practice_questions(20, seed=9, kinds=["triangle_angles"]):
        a, b = numbers(item.question.text)
        assert int(item.question.label) == 180 - a - b
    for item in practice_questions(20, seed=9, kinds=["hypotenuse"]):
        ab, ac = numbers(item.question.text)
        assert int(item.question.label) ** 2 == ab**2 + ac**2
    for item in practice_questions(20, seed=9, kinds=["quadrilateral"]):
        a, b, c = numbers(item.question.text)
        assert int(item.question.label) == 360 - a - b - c


def test_samples_are_ready_for_the_geo3k_environment() -> None:
    samples = practice_samples(5, seed=2)
    assert [sample.index for sample in samples] == list(range(5))
    for sample in samples:
        assert sample.prompt.startswith("<image>\n") and "calc_score" in sample.prompt
        (image,) = sample.multimodal_inputs["images"]
        assert image.size == FIGURE_SIZE
        assert sample.metadata["source"] == PRACTICE_SOURCE and sample.metadata["kind"] in KINDS
        assert sample.label


def test_bad_requests_are_refused_with_the_kinds_named() -> None:
    with pytest.raises(ValueError, match="unknown question kind"):
        practice_questions(3, seed=1, kinds=["cube_volume"])
    with pytest.raises(ValueError, match="count"):
        practice_questions(-1, seed=1)
