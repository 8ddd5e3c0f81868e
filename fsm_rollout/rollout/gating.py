"""Where a rollout meets the weight-update gate (:mod:`fsm_rollout.weights.suspension`): around its generate request.

:meth:`GatePoint.generate` is the one place a running rollout consults the gate: it suspends before sending when
the gate is closed, registers the request while it is in flight, and tells a suspension's abort answer from the
server's. The rest is what the gate knows (the weight version, the suspension's reason) and the two waits: a
rollout that has not started waits for the gate to open; a suspended one waits for the resume, or is handed back.
A rollout without a gate gets one that never closes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fsm_rollout.rollout.cancel import CancelScope
from fsm_rollout.types import GeneratedTurn
from fsm_rollout.weights.suspension import SuspensionGate


class GatePoint:
    """One rollout's side of its gate (None: a gate that never closes)."""

    def __init__(self, gate: SuspensionGate | None) -> None:
        self.gate = gate

    @property
    def weight_version(self) -> str | None:
        return self.gate.weight_version if self.gate is not None else None

    @property
    def weight_updates(self) -> int:
        return self.gate.weight_updates if self.gate is not None else 0

    @property
    def reason(self) -> str:
        """Why the gate closed (``weight_update`` unless it says otherwise)."""
        return getattr(self.gate, "reason", None) or "weight_update"

    def version_at(self, updates: int) -> str | None:
        return self.gate.version_at(updates) if self.gate is not None else None

    def closed(self) -> bool:
        """Whether a rollout about to start or send must wait or suspend instead."""
        return self.gate is not None and self.gate.should_suspend()

    async def generate(
        self, scope: CancelScope, send: Callable[[str], Awaitable[GeneratedTurn]], request_id: str, client: Any
    ) -> GeneratedTurn:
        """The answer of ``send(request_id)``, awaited in ``scope`` while the gate counts it in flight (an
        ``abort`` answer for which :meth:`cut` is true when the gate's suspension aborted it)."""
        gate = self.gate
        if gate is None:
            return await scope.run(send(request_id), request_id=request_id)
        gate.request_started(client, request_id)
        try:
            answer = await scope.run(send(request_id), request_id=request_id)
        finally:
            gate.request_ended(request_id)
        spans = answer.meta.weight_version_spans
        first = spans[0][0] if spans else answer.meta.weight_version
        if first is not None:
            gate.saw_version(answer.meta.weight_version or first)
        return answer

    def cut(self, answer: GeneratedTurn, request_id: str) -> bool:
        """Whether ``answer`` is the abort answer of this gate's suspension (not the server's)."""
        return self.gate is not None and answer.finish == "abort" and self.gate.suspended_request(request_id)

    async def wait_to_start(self) -> None:
        if self.gate is not None:
            await self.gate.wait_to_start()

    async def wait_resumed(self) -> None:
        """Return when the rollout may go on; :class:`~fsm_rollout.weights.suspension.HandBack` when it goes back."""
        if self.gate is not None:
            await self.gate.wait_resumed()


__all__ = ["GatePoint"]
