"""compat.generate's shared resources: one HTTP client per event loop and engine URL."""

from __future__ import annotations

import asyncio

from fsm_rollout import RolloutConfig, VLLMClient, compat


def clients_seen() -> tuple[VLLMClient, VLLMClient, VLLMClient]:
    first = RolloutConfig(engine_url="http://127.0.0.1:8000", model="m", max_turns=1)
    second = RolloutConfig(engine_url="http://127.0.0.1:8001", model="m", max_turns=1)

    async def within_one_loop() -> tuple[VLLMClient, VLLMClient, VLLMClient]:
        return compat._client_for(first), compat._client_for(first), compat._client_for(second)

    return asyncio.run(within_one_loop())


def test_one_loop_shares_a_client_per_engine_url() -> None:
    a, again, other = clients_seen()
    assert a is again
    assert other is not a


def test_a_new_event_loop_gets_new_clients() -> None:
    first_loop, _, _ = clients_seen()
    second_loop, _, _ = clients_seen()
    assert second_loop is not first_loop
