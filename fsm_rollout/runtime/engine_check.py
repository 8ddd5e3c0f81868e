"""Internal: the engines a runner is given, checked once when it is entered (each answers ``/health`` and its model
list), so a wrong URL fails there, naming it, rather than in every sample."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from fsm_rollout.config import RolloutConfig
from fsm_rollout.errors import ModelListError
from fsm_rollout.types import ServedModel


async def check_engines(urls: Sequence[str], config: RolloutConfig) -> list[ServedModel] | ModelListError | None:
    """The first engine's model list (None without a models endpoint; the error for a list of an odd shape, no
    reason to refuse an engine); raises the error, naming the URL, of the first of ``urls`` that does not answer
    ``GET /health`` and ``GET /v1/models`` within ``config.connect_timeout_s`` (down, timed out, an error status
    such as a refused API key)."""
    from fsm_rollout.engine.probe import probe_engine

    answers = await asyncio.gather(
        *(probe_engine(url, api_key=config.api_key, timeout_s=config.connect_timeout_s) for url in urls),
        return_exceptions=True,
    )
    for answer in answers:
        if isinstance(answer, BaseException) and not isinstance(answer, ModelListError):
            raise answer
    first = answers[0]
    assert not isinstance(first, BaseException) or isinstance(first, ModelListError)
    return first


def served_context_len(served: Sequence[ServedModel] | None, model: str | None) -> int | None:
    """The context length the engine gives ``model`` in its model list (the only model listed, when ``model`` is not
    named), or None when the list does not say."""
    if not served:
        return None
    cards = [card for card in served if card.name == model] if model else list(served)
    if len(cards) != 1:
        return None
    return cards[0].max_model_len
