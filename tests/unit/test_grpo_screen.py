"""The GRPO example's screen: which practice questions become the pool."""

from __future__ import annotations

import io

from fsm_rollout import Sample
from fsm_rollout.examples.grpo import GRPOOptions
from fsm_rollout.examples.grpo_tiny import screen


class FixedRewards:
    """A stand-in for the runner: a question's groups earn that question's fixed rewards, in order (a second group
    of the same question takes the rewards after the first's)."""

    def __init__(self, rewards: dict[int, list[float]]) -> None:
        self.rewards = rewards
        self.taken: dict[int, int] = {}
        self.calls: list[tuple[int, int, int]] = []

    async def run_group(self, sample: Sample, n: int, *, seed: int) -> list[Sample]:
        index = int(sample.index or 0)
        self.calls.append((index, n, seed))
        start = self.taken.get(index, 0)
        self.taken[index] = start + n
        return [Sample(index=sample.index, reward=reward) for reward in self.rewards[index][start : start + n]]


def candidates(count: int) -> list[Sample]:
    return [Sample(index=index, label=str(index)) for index in range(count)]


async def test_the_pool_is_the_best_questions_below_full_marks_in_candidate_order() -> None:
    rewards = {0: [0, 0], 1: [1, 0], 2: [1, 1], 3: [0.5, 0], 4: [1, 0.5], 5: [0, 0]}
    runner = FixedRewards(rewards)
    out = io.StringIO()
    options = GRPOOptions(groups=3, candidates=6, screen_samples=2, screen_finalists=0)
    pool = await screen(runner, candidates(6), options, out=out)  # type: ignore[arg-type]
    # mean rewards 0, .5, 1, .25, .75, 0: question 2 always earns everything (no signal), 4, 1 and 3 are best
    assert [sample.index for sample in pool] == [1, 3, 4]
    assert [call[:2] for call in runner.calls] == [(index, 2) for index in range(6)]
    assert len({call[2] for call in runner.calls}) == 6, "every candidate's group has its own seed"
    assert out.getvalue().startswith("screen: 6 questions x 2 samples")


async def test_the_best_few_get_a_second_look_and_a_lucky_start_does_not_win() -> None:
    # first look (2 samples): 0 has the best rate (one hit); the second look (4 more) shows it was luck
    rewards = {0: [1, 0, 0, 0, 0, 0], 1: [0.5, 0, 1, 0, 1, 0], 2: [0, 0], 3: [0, 0.5, 0.5, 0.5, 0.5, 0.5]}
    runner = FixedRewards(rewards)
    out = io.StringIO()
    options = GRPOOptions(groups=1, candidates=4, screen_samples=2, screen_finalists=3)
    pool = await screen(runner, candidates(4), options, out=out)  # type: ignore[arg-type]
    assert [call[:2] for call in runner.calls] == [(0, 2), (1, 2), (2, 2), (3, 2), (0, 4), (1, 4), (3, 4)]
    assert len({call[2] for call in runner.calls}) == 7, "every group has its own seed"
    # 6-sample rates: 0 -> 1/6, 1 -> 2.5/6, 3 -> 2.5/6 (the tie keeps the candidates' order)
    assert [sample.index for sample in pool] == [1]
    assert out.getvalue().startswith("screen: 4 questions x 2 samples and 3 x 4 more")
    assert "(0.42)" in out.getvalue()


async def test_too_few_candidates_skip_the_screen() -> None:
    runner = FixedRewards({})
    pool = await screen(runner, candidates(5), GRPOOptions(groups=4, candidates=0), out=io.StringIO())  # type: ignore[arg-type]
    assert [sample.index for sample in pool] == [0, 1, 2, 3] and runner.calls == []


async def test_a_screen_without_signal_still_fills_the_pool() -> None:
    runner = FixedRewards({index: [0.0, 0.0] for index in range(4)})
    pool = await screen(runner, candidates(4), GRPOOptions(groups=2, candidates=4, screen_samples=2), out=io.StringIO())  # type: ignore[arg-type]
    assert [sample.index for sample in pool] == [0, 1]


async def test_the_pool_takes_one_question_per_label_while_it_can() -> None:
    samples = [Sample(index=index, label=label) for index, label in enumerate(["10", "10", "7", "10"])]
    runner = FixedRewards({0: [1, 0], 1: [1, 0], 2: [0, 0], 3: [0.5, 0]})
    pool = await screen(runner, samples, GRPOOptions(groups=2, candidates=4, screen_samples=2), out=io.StringIO())  # type: ignore[arg-type]
    assert [sample.index for sample in pool] == [0, 2]
    runner = FixedRewards({0: [1, 0], 1: [1, 0], 2: [0, 0], 3: [0.5, 0]})
    pool = await screen(runner, samples, GRPOOptions(groups=3, candidates=4, screen_samples=2), out=io.StringIO())  # type: ignore[arg-type]
    assert [sample.index for sample in pool] == [0, 1, 2], "labels ran out: the best remaining fill the pool"


async def test_the_pool_prefers_questions_of_different_kinds() -> None:
    samples = [Sample(index=index, label=label, metadata={"kind": kind})
               for index, (label, kind) in enumerate([("10", "a"), ("7", "a"), ("8", "b"), ("9", "c")])]  # fmt: skip
    runner = FixedRewards({0: [1, 0], 1: [1, 0], 2: [0.5, 0], 3: [0, 0]})
    pool = await screen(runner, samples, GRPOOptions(groups=2, candidates=4, screen_samples=2), out=io.StringIO())  # type: ignore[arg-type]
    assert [sample.index for sample in pool] == [0, 2], "question 1 shares question 0's kind"
