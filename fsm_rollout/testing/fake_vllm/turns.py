"""Which scripted turn a fake vLLM generate request answers: the sessions' script queues, and the interrupted turns
that a continuation request takes up (see :class:`~fsm_rollout.testing.fake_vllm.scripting.ScriptedTurn`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from fsm_rollout.engine.schema import RequestError
from fsm_rollout.testing.fake_vllm.scripting import ScriptedTurn, check_turns


@dataclass(frozen=True)
class Job:
    """What a generate request answers: its scripted turn's output from ``offset`` on.

    ``waits`` says whether the request waits (the turn's ``hang`` or ``delay``) and ``held_after`` how many new
    tokens it has produced by then (None: none, and an abort does not leave the turn to be continued).
    ``continued`` counts the continuations of the turn up to this request (0: the turn's first request).
    """

    turn: ScriptedTurn
    offset: int
    waits: bool
    held_after: int | None
    continued: int


@dataclass(frozen=True)
class _Interrupted:
    """An aborted turn that a continuation can take up: ``offset`` tokens of it were answered so far."""

    turn: ScriptedTurn
    offset: int
    continued: int


class TurnQueues:
    """The scripted turns per session (``None``: the default queue) and the interrupted turns per session, by the
    prompt ids that continue them."""

    def __init__(self) -> None:
        self._queues: dict[str | None, deque[ScriptedTurn]] = {None: deque()}
        self._interrupted: dict[str | None, dict[tuple[int, ...], deque[_Interrupted]]] = {}

    def script(self, turns: Sequence[ScriptedTurn], session: str | None) -> None:
        """Append turns to a session's queue, once they are checked."""
        check_turns(turns)
        self._queues.setdefault(session, deque()).extend(turns)

    def next_job(self, session: str | None, prompt_ids: Sequence[int]) -> Job:
        """The interrupted turn these prompt ids continue, else the next scripted turn of the session (the default
        queue's for a session never scripted)."""
        by_ids = self._interrupted.get(session, {})
        pending = by_ids.get(key := tuple(prompt_ids))
        if pending:
            interrupted = pending.popleft()
            if not pending:
                del by_ids[key]
            holds = interrupted.turn.held_again_after
            held_after = holds[interrupted.continued] if interrupted.continued < len(holds) else None
            return Job(
                interrupted.turn,
                offset=interrupted.offset,
                waits=held_after is not None,
                held_after=held_after,
                continued=interrupted.continued + 1,
            )
        queue = self._queues[session if session in self._queues else None]
        if not queue:
            name = "<default>" if session is None else session
            raise RequestError(500, f"fake vLLM: no scripted turn left for session {name}")
        turn = queue.popleft()
        return Job(turn, offset=0, waits=turn.hang or turn.delay > 0, held_after=turn.held_after, continued=0)

    def interrupt(self, session: str | None, job: Job, continued_by: Sequence[int], produced: int) -> None:
        """Leave the job's turn for the request whose prompt ids are ``continued_by``, ``produced`` tokens on."""
        self._interrupted.setdefault(session, {}).setdefault(tuple(continued_by), deque()).append(
            _Interrupted(job.turn, offset=job.offset + produced, continued=job.continued)
        )
