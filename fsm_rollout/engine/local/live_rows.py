"""Sampling from logits whose every row but a few is exactly 0, without drawing over the other rows.

The default model's LM head is zero on most of the vocabulary (:class:`LiveRowsHead`): a zero row's logit is
``0 * h`` summed, exactly 0 whenever the hidden state ``h`` is finite (the head hands out :class:`LiveLogits` only
then). :func:`sample_live` gives what the full-vocabulary path of
:class:`~fsm_rollout.engine.local.model.Generation` gives, bit for bit:

- the logprobs (the sampled token's and the top candidate's) are read from the full vocabulary's float32
  log-softmax. That one pass stays: torch's float32 sum over ~150k terms rounds in its own way (each zero row adds a
  term far below the running sum's last bit), a shorter or more exact sum would differ from it in the fourth decimal,
  and a trainer recomputing logprobs with its own log-softmax gets torch's bits, which the engine's must match;
- the draw is the same inverse-CDF draw over ids in ascending order, with the same uniform number from the
  request's generator, but over the live ids only: the cumulative mass up to a live id adds the zero rows below it
  as ``count * p0``, and a draw that lands between two live ids picks the zero row it lands on. The same token comes
  out unless the uniform number falls within float64 rounding of a boundary;
- the greedy token, the rank and the top candidate count the zero rows (the lowest zero-row id stands for them
  all: an argmax takes the first of equal values).

:func:`sample_live_rows` does the same for the rows of a decode batch at once (one log-softmax call over all of
them; each row's result is the one it gets alone).

Only the settings whose effect on the zero rows is uniform take this path (temperature, greedy, ``min_tokens``, at
most one top candidate); penalties and the ``min_p``/``top_k``/``top_p`` filters run over the full vocabulary.
Ids from ``sampleable`` up (padding rows) are never sampled, as on the full path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy
import torch

__all__ = [
    "LiveLayout",
    "LiveLogits",
    "LiveRowsHead",
    "LiveSample",
    "live_rows_head",
    "sample_live",
    "sample_live_rows",
]


@dataclass
class LiveLogits:
    """One position's logits given as the float32 ``values`` of the ascending ids ``rows``; every other id's logit
    is exactly 0."""

    values: torch.Tensor
    rows: torch.Tensor

    def full(self, vocab_size: int) -> torch.Tensor:
        """The whole vocabulary's float32 logits."""
        logits = torch.zeros(vocab_size, dtype=torch.float32)
        logits[self.rows] = self.values
        return logits


class LiveRowsHead:
    """The LM head computed over the rows of its weight that are not all zero; the other logits are exactly 0.

    The embedded engine's default model leaves the rows of ids its training never used at zero, most of a Qwen
    vocabulary; a zero row's logit is 0 whatever the (finite) hidden state, so computing only the live rows gives the
    same logits for a fraction of a decode step's cost (the full head reads the whole matrix for every token), and
    :func:`sample_live` samples from them without the zero rows. :meth:`refresh` runs after every weight load; while
    fewer than half the rows are zero, :attr:`rows` is None and the engine runs the model's own head.
    """

    def __init__(self, model: Any) -> None:
        self.rows: torch.Tensor | None = None
        self._model = model
        self._weight: torch.Tensor | None = None
        self._vocab = 0
        self.refresh()

    def refresh(self) -> None:
        weight = self._model.get_output_embeddings().weight.detach()
        self._vocab = int(weight.shape[0])
        live = torch.nonzero((weight != 0).any(dim=1)).squeeze(1)  # a NaN row counts as live
        if live.numel() * 2 > self._vocab:
            self.rows, self._weight = None, None
        else:
            self.rows, self._weight = live, weight[live].contiguous()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The float32 logits over the whole vocabulary of one position's final hidden state."""
        live = self.live_logits(hidden)
        return live.full(self._vocab) if isinstance(live, LiveLogits) else live

    def live_logits(self, hidden: torch.Tensor) -> LiveLogits | torch.Tensor:
        """The logits of one position's final hidden state: the live rows' while :attr:`rows` is set and the hidden
        state is finite (a zero row's logit is then exactly 0), else the whole vocabulary's float32 logits."""
        if self.rows is None or self._weight is None or not bool(torch.isfinite(hidden).all()):
            full: torch.Tensor = (self._model.get_output_embeddings().weight.detach() @ hidden).to(torch.float32)
            return full
        return LiveLogits((self._weight @ hidden).to(torch.float32), self.rows)

    def batch_live_logits(self, hidden: torch.Tensor) -> list[LiveLogits | torch.Tensor]:
        """:meth:`live_logits` of each row of ``hidden`` (rows, hidden size), one matrix-vector product per row: the
        very product a request alone makes, so a row's logits do not depend on the others."""
        return [self.live_logits(row) for row in hidden]


def live_rows_head(model: Any) -> LiveRowsHead | None:
    """A :class:`LiveRowsHead` for ``model`` when its logits are a plain bias-free projection of the base model's
    last hidden state, as checked on a probe input against the model's own forward; else None."""
    output = model.get_output_embeddings()
    if not isinstance(output, torch.nn.Linear) or output.bias is not None or model.base_model is model:
        return None
    head = LiveRowsHead(model)
    probe = torch.tensor([[0, 1, 2]], dtype=torch.long)
    with torch.inference_mode():
        full = model(input_ids=probe, use_cache=False).logits[0, -1].to(torch.float32)
        hidden = model.base_model(input_ids=probe, use_cache=False).last_hidden_state[0, -1]
        matches = bool(torch.allclose(head.logits(hidden), full, rtol=1e-4, atol=1e-5))
    return head if matches else None


@dataclass(frozen=True)
class LiveSample:
    """The token :func:`sample_live` picked, its logprob and rank, and the likeliest token with its logprob."""

    token: int
    logprob: float
    rank: int
    best: int
    best_logprob: float


@dataclass(frozen=True)
class LiveLayout:
    """What :func:`sample_live_rows` needs of the live ids, the same for every row: made once per head refresh."""

    rows: torch.Tensor
    listed: numpy.ndarray
    vocab_size: int
    sampleable: int
    inside: int
    """Live ids below ``sampleable``: ``rows[:inside]``."""
    rest: int
    """Zero rows that can be sampled."""
    first_zero: int
    gather: torch.Tensor
    """The live ids, then one zero row (id 0 when there is none): where the log-softmax is read."""
    below: numpy.ndarray
    """Zero rows below each live id (all of them for ids from ``sampleable`` up)."""
    scratch: list[torch.Tensor] = field(default_factory=list)
    """Full-vocabulary logits rows kept from call to call: 0 but at the live ids, -inf from ``sampleable`` up (the
    live ids are written over at every call, so the rest need not be filled again)."""

    def full_logits(self, values: torch.Tensor) -> torch.Tensor:
        """The full-vocabulary logits of the rows of live ``values`` (rows, live ids)."""
        count = values.shape[0]
        if not self.scratch or self.scratch[0].shape[0] < count:
            full = torch.zeros((count, self.vocab_size), dtype=torch.float32)
            full[:, self.sampleable :] = float("-inf")
            self.scratch[:] = [full]
        full = self.scratch[0][:count]
        full[:, self.rows] = values
        return full

    @staticmethod
    def of(rows: torch.Tensor, *, vocab_size: int, sampleable: int) -> LiveLayout:
        listed = rows.numpy()
        inside = int(numpy.searchsorted(listed, sampleable))
        rest = sampleable - inside
        first_zero = _first_zero_row(listed, inside) if rest else -1
        below = numpy.full(listed.shape[0], rest, dtype=numpy.int64)
        below[:inside] = listed[:inside] - numpy.arange(inside)
        gather = torch.cat([rows, torch.tensor([max(first_zero, 0)])])
        return LiveLayout(rows, listed, vocab_size, sampleable, inside, rest, first_zero, gather, below)


def sample_live_rows(
    values: torch.Tensor,
    layout: LiveLayout,
    *,
    temperatures: list[float],
    greedy: list[bool],
    generators: list[torch.Generator],
) -> list[LiveSample]:
    """:func:`sample_live` without ``masked`` for several rows at once: ``values`` (rows, live ids) holds each row's
    live logits (modified in place), the other lists one entry per row.

    Each row gets what :func:`sample_live` gives it alone, bit for bit: the one full-vocabulary log-softmax runs
    over all rows in one call (a row's result does not depend on the others), everything else is elementwise or
    per row.
    """
    count = values.shape[0]
    inside, rest, first_zero = layout.inside, layout.rest, layout.first_zero
    if inside < values.shape[1]:
        values[:, inside:] = float("-inf")
    for row in range(count):
        if not greedy[row] and temperatures[row] != 1.0:
            values[row] = values[row] / temperatures[row]  # a zero row stays 0
    picked = torch.log_softmax(layout.full_logits(values), dim=1)[:, layout.gather]
    logprobs_all = picked.numpy()
    live_values = values.numpy()
    best_columns = numpy.argmax(live_values, axis=1)
    samples = []
    for row in range(count):
        logprobs = logprobs_all[row, :-1]
        zero_logprob = float(logprobs_all[row, -1]) if rest else float("-inf")
        live_best = int(best_columns[row])
        best_id, best_logprob = int(layout.listed[live_best]), float(logprobs[live_best])
        top_value = float(live_values[row, live_best])
        if rest and (top_value < 0.0 or (top_value == 0.0 and first_zero < best_id)):
            best_id, best_logprob = first_zero, zero_logprob
        if greedy[row]:
            token, logprob = best_id, best_logprob
        else:
            probs = picked[row].exp().to(torch.float64).numpy()  # the exp the full path's draw takes
            uniform = float(torch.rand((), generator=generators[row], dtype=torch.float64))
            token, logprob = _draw(layout, logprobs, probs, zero_logprob, uniform)
        rank = int((logprobs > logprob).sum()) + (rest if zero_logprob > logprob else 0) + 1
        samples.append(LiveSample(token=token, logprob=logprob, rank=rank, best=best_id, best_logprob=best_logprob))
    return samples


def sample_live(
    logits: LiveLogits,
    *,
    vocab_size: int,
    sampleable: int,
    masked: torch.Tensor | None,
    temperature: float,
    greedy: bool,
    generator: torch.Generator,
) -> LiveSample:
    """Sample as the full-vocabulary path does (see the module docstring); ``masked`` ids (``min_tokens``) are -inf.

    ``logits.values`` may be modified in place.
    """
    if masked is None or not masked.numel():
        layout = LiveLayout.of(logits.rows, vocab_size=vocab_size, sampleable=sampleable)
        return sample_live_rows(
            logits.values[None], layout, temperatures=[temperature], greedy=[greedy], generators=[generator]
        )[0]
    ids = torch.unique(torch.cat([logits.rows, masked]))  # sorted; a masked zero row becomes an explicit -inf
    merged = torch.zeros(ids.numel(), dtype=torch.float32)
    merged[torch.searchsorted(ids, logits.rows)] = logits.values
    merged[torch.searchsorted(ids, masked)] = float("-inf")
    masked_layout = LiveLayout.of(ids, vocab_size=vocab_size, sampleable=sampleable)
    return sample_live_rows(
        merged[None], masked_layout, temperatures=[temperature], greedy=[greedy], generators=[generator]
    )[0]


def _draw(
    layout: LiveLayout, logprobs: numpy.ndarray, probs: numpy.ndarray, zero_logprob: float, uniform: float
) -> tuple[int, float]:
    """The inverse-CDF draw over ascending ids, zero rows counted in blocks between the listed ids (``probs``: the
    listed ids' probabilities, then a zero row's)."""
    ids, inside, rest, sampleable, below = layout.listed, layout.inside, layout.rest, layout.sampleable, layout.below
    count = ids.shape[0]
    zero_prob = float(probs[-1]) if rest else 0.0
    cumulative = numpy.cumsum(probs[:count])
    cdf = cumulative + zero_prob * below
    total = float(cumulative[-1]) + zero_prob * rest
    threshold = uniform * total
    index = int(numpy.searchsorted(cdf, threshold, side="right"))
    if index < count:
        before = float(cumulative[index - 1]) if index else 0.0  # the listed mass below ids[index]
        zeros_below = int(below[index])
        end = min(int(ids[index]), sampleable)  # the zero rows of this gap end just below ``end``
    else:
        before, zeros_below, end = float(cumulative[-1]), rest, sampleable
    gap_start = int(below[index - 1]) if index else 0
    if zero_prob > 0 and zeros_below > gap_start and threshold < before + zero_prob * zeros_below:
        ordinal = min(max(int((threshold - before) / zero_prob), gap_start), zeros_below - 1)
        return end - (zeros_below - ordinal), zero_logprob
    if index < count and float(logprobs[index]) != float("-inf"):
        return int(ids[index]), float(logprobs[index])
    # The draw hit the very top of the CDF (float rounding): the last id that can be sampled, as the full path does.
    finite = numpy.flatnonzero(logprobs > float("-inf"))
    last_listed = int(ids[finite[-1]]) if finite.size else -1
    last_zero = _last_zero_row(ids, inside, sampleable) if rest else -1
    if last_zero > last_listed:
        return last_zero, zero_logprob
    return last_listed, float(logprobs[finite[-1]])


def _first_zero_row(ids: numpy.ndarray, inside: int) -> int:
    """The lowest id below ``sampleable`` that ``ids`` does not list (there is one)."""
    gaps = numpy.flatnonzero(ids[:inside] != numpy.arange(inside))
    return int(gaps[0]) if gaps.size else inside


def _last_zero_row(ids: numpy.ndarray, inside: int, sampleable: int) -> int:
    """The highest id below ``sampleable`` that ``ids`` does not list (there is one)."""
    candidate = sampleable - 1
    for value in reversed(ids[:inside].tolist()):
        if value < candidate:
            break
        candidate = value - 1
    return candidate
