"""The Ray pool's group sampling (:mod:`fsm_rollout.distributed.oversampling`) without Ray: each group goes out as a
batch of its own, ``keep_group`` runs in the trainer's process, and the surplus is ended by its batch number with
the typed reason. The workers are stood in for by batches whose results the test puts in."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fsm_rollout.distributed.oversampling import pool_sampling
from fsm_rollout.machine.lifecycle import OVERSAMPLED
from fsm_rollout.runtime.sampling import GroupTarget
from fsm_rollout.sample import Sample, Status


@dataclass
class SentBatch:
    number: int
    samples: list[Sample]
    results: asyncio.Queue[tuple[int, Sample]] = field(default_factory=asyncio.Queue)

    def finish(self, local: int, status: Status, reason: str, response: str = "") -> None:
        sample = Sample.from_dict(self.samples[local].to_dict())
        sample.status, sample.response = status, response
        sample.metadata = {**sample.metadata, "rollout_reason": reason}
        self.results.put_nowait((local, sample))


async def test_groups_go_out_one_batch_each_a_dropped_one_is_refilled_and_the_surplus_ended_by_number() -> None:
    batch = [Sample(prompt=f"q{i}", index=i, group_index=i // 2) for i in range(8)]
    sent: list[SentBatch] = []
    ended: list[tuple[int, str]] = []
    sent_event = asyncio.Event()

    def dispatch(samples: list[Sample], ids: object, seeds: object) -> SentBatch:
        sent.append(SentBatch(len(sent) + 1, samples))
        sent_event.set()
        return sent[-1]

    async def end_batch(number: int, reason: str) -> None:
        ended.append((number, reason))
        for local in range(2):
            sent[number - 1].finish(local, Status.ABORTED, reason)

    def distinct(group: object) -> bool:
        return len({sample.response for sample in group}) > 1  # type: ignore[attr-defined]

    target = GroupTarget.of(1, 1, distinct)
    assert target is not None
    sampling, finished = pool_sampling(batch, (), (), target, dispatch=dispatch, end_batch=end_batch,
                                       stopped=lambda: False)  # fmt: skip
    run = asyncio.ensure_future(sampling.run())
    while len(sent) < 2:
        sent_event.clear()
        await sent_event.wait()
    assert [[s.index for s in b.samples] for b in sent] == [[0, 1], [2, 3]]  # N + M groups, one batch each
    for local in range(2):
        sent[1].finish(local, Status.COMPLETED, "env_done", "same")  # no signal: dropped, the third group refills
    while len(sent) < 3:
        sent_event.clear()
        await sent_event.wait()
    assert [s.index for s in sent[2].samples] == [4, 5]
    sent[0].finish(0, Status.COMPLETED, "env_done", "a")
    sent[0].finish(1, Status.COMPLETED, "env_done", "b")
    await run
    assert ended == [(3, OVERSAMPLED)]  # the third group's batch, still running, is the surplus
    assert (sampling.kept, sampling.dropped, sampling.surplus, sampling.exhausted) == (1, 1, 1, False)
    result = sampling.batch([finished[position] for position in sorted(finished)])
    assert [s.index for s in result] == [0, 1, 2, 3, 4, 5]  # the fourth group never went out
    assert [s.metadata["group_kept"] for s in result] == [True, True, False, False, False, False]
    assert [s.metadata["rollout_reason"] for s in result[4:]] == [OVERSAMPLED] * 2
