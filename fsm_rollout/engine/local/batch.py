"""The embedded engine's decode batch: one forward pass advances every running request by one token.

A request's prompt runs alone (its prefill, into its own KV cache, exactly as a batch of one); its cache then joins
the batch's cache at a step boundary. The batch's cache holds one row per request, left-padded to the longest; every
decode step feeds each row's last sampled token at that row's own position, and each request then samples from its
own row of logits with its own generator (:meth:`~fsm_rollout.engine.local.model.Generation.accept`; the requests
that sample from live-rows logits do it together, :func:`~fsm_rollout.engine.local.live_rows.sample_live_rows`, bit
for bit as one by one). The cache is kept from step to step: a step writes its new column into spare columns in
place; a request that leaves frees its row, one that joins takes a free row when its cache fits, and the cache is
rebuilt (compact, trimmed, with new spare columns) only when it does not, when the spare columns run out, or when
most rows are padding.

A request's tokens and logprobs do not depend on what else is in the batch, bit for bit on a CPU like the one this
was built on, for three reasons:

- attention runs row by row over that row's own keys only (:func:`_rowwise_attention`), with the very call a batch of
  one makes (for sdpa, the one ``scaled_dot_product_attention`` call transformers makes of it): padding never
  enters a softmax or a weighted sum, whose float order would change with its length;
- the linear layers see a batch padded to a multiple of :data:`ROW_MULTIPLE` rows. The BLAS GEMM computes each
  output row with the same summation order whatever the number of rows, except for very small row counts (one to
  three rows take other kernels, which sum in another order), so a request alone and a request among fifteen others
  get identical rows. Padding rows (and the rows of requests that left) feed token 0 at position 0 and are thrown
  away;
- a live-rows LM head (:class:`~fsm_rollout.engine.local.live_rows.LiveRowsHead`) multiplies each row on its own,
  the very matrix-vector product a request alone makes; the sampling that follows is the row's own.

Against the one-request-at-a-time engine (``batched=False``) the float differences are these: its decode steps
multiply a single row through the linear layers, which may sum in another order than the GEMM, so hidden states can
differ in their last float32 bits, and a logprob by what the LM head makes of that (more where logits are large).
The engine tests bound the gap at 1e-5 on their mixed requests (tiny random and default model) and require the same
greedy tokens; a rare token of a long conversation, with large logits, can still land past 1e-5, and two logits that
tie to within that noise could pick different greedy tokens. A sampled draw that lands inside the default model's
block of zero rows picks its row by the block's mass below the uniform number, so a last-bit change of a zero row's
probability, summed over tens of thousands of rows, can move the draw to a neighbouring (equally likely) zero row.
A BLAS that splits rows across threads by row count could break the bit-for-bit property (the default engine runs one
torch thread).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import DynamicLayer

from fsm_rollout.engine.local.live_rows import LiveLayout, LiveLogits, sample_live_rows

if TYPE_CHECKING:
    from fsm_rollout.engine.local.model import Generation, LoadedModel
    from fsm_rollout.engine.schema import Finish

__all__ = ["ROW_MULTIPLE", "DecodeBatch"]

ROW_MULTIPLE = 4
"""Decode steps run a multiple of this many rows (see the module docstring)."""

_SPARE_COLUMNS = 64  # a rebuilt cache has room for this many more decode steps before it is copied to a larger one
_ROWS_KEY = "fsm_rollout_rowwise"  # the attention implementation name a decode step runs under
_LENGTHS_KWARG = "fsm_rollout_row_lengths"


def _rowwise_attention(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, **kwargs: Any
) -> tuple[torch.Tensor, None]:
    """Attention of each request row's one query over that row's own keys (the last ``length`` of the padded cache),
    by the model's own attention implementation, as a batch of one would run it. Padding rows (length 0) get zeros:
    their outputs are thrown away, and a row of a linear layer does not depend on the others."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import eager_attention_forward

    lengths: list[int] = kwargs.pop(_LENGTHS_KWARG)
    original: str = kwargs.pop("fsm_rollout_attention")
    columns = key.shape[2]
    outputs: list[torch.Tensor | None] = []
    if _plain_sdpa(original, query, key, value, kwargs):
        # What transformers' sdpa_attention_forward runs for one query without a mask, without its per-call checks.
        sdpa = torch.nn.functional.scaled_dot_product_attention
        scale, dropout = kwargs.get("scaling"), kwargs.get("dropout", 0.0)
        gqa = getattr(module, "num_key_value_groups", 1) > 1
        outputs = [
            sdpa(
                query[row : row + 1],
                key[row : row + 1, :, columns - length :],
                value[row : row + 1, :, columns - length :],
                attn_mask=None,
                dropout_p=dropout,
                scale=scale,
                is_causal=False,
                **({"enable_gqa": True} if gqa else {}),
            )
            if length
            else None
            for row, length in enumerate(lengths)
        ]
        return _with_padding(outputs).transpose(1, 2).contiguous(), None
    inner = eager_attention_forward if original == "eager" else ALL_ATTENTION_FUNCTIONS[original]
    for row, length in enumerate(lengths):
        if not length:
            outputs.append(None)
            continue
        start = columns - length
        output, _ = inner(
            module, query[row : row + 1], key[row : row + 1, :, start:], value[row : row + 1, :, start:], None, **kwargs
        )
        outputs.append(output)
    return _with_padding(outputs), None


def _with_padding(outputs: list[torch.Tensor | None]) -> torch.Tensor:
    """The rows' outputs in one tensor, zeros for the padding rows (None); at least one row is not padding."""
    template = next(output for output in outputs if output is not None)
    zeros = template.new_zeros(template.shape)
    return torch.cat([zeros if output is None else output for output in outputs])


def _plain_sdpa(
    original: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kwargs: dict[str, Any]
) -> bool:
    """Whether transformers' sdpa attention would make one plain ``scaled_dot_product_attention`` call of a row."""
    return (
        original == "sdpa"
        and query.shape[2] == 1
        and key.shape[-1] == value.shape[-1] <= 256
        and kwargs.get("softcap") is None
        and kwargs.get("position_bias") is None
        and not kwargs.get("output_attentions", False)
    )


def _register() -> None:
    from transformers import AttentionInterface

    if _ROWS_KEY not in AttentionInterface._global_mapping:
        AttentionInterface.register(_ROWS_KEY, _rowwise_attention)


class DecodeBatch:
    """The running requests' shared KV cache and their one-token decode step (see the module docstring).

    Not thread-safe: the engine's worker thread alone calls it. Membership changes (:meth:`add`, :meth:`discard`)
    happen between steps and are applied before the next one: a request that leaves frees its row (a padding row from
    then on), a request that joins takes a free row when its cache fits left of the rows' shared last column, and the
    cache is rebuilt (every request in a row of its own, left-padded to the longest, no spare row beyond a multiple
    of :data:`ROW_MULTIPLE`) only when it does not, when the buffers have no room for the next column, or when most
    rows are padding. A decode step writes its new column into the cache in place.
    """

    def __init__(self, loaded: LoadedModel) -> None:
        _register()
        self._loaded = loaded
        self.generations: list[Generation] = []
        """The requests in the batch: after a step, in the order of its finish reasons."""
        self._cache: Any = None  # the rows' DynamicCache of _GrowingLayer, kept from step to step
        self._layout: LiveLayout | None = None
        self._slots: list[Generation | None] = []  # the request of each row of the cache (None: a padding row)
        self._lengths: list[int] = []  # tokens in the cache per row (0 for padding rows)
        # Requests that joined since the last step, with their own caches' (keys, values) per layer.
        self._pending: list[tuple[Generation, list[tuple[torch.Tensor, torch.Tensor]]]] = []

    @staticmethod
    def supports(loaded: LoadedModel) -> bool:
        """Whether the model's KV cache is a plain one (every layer keeps all positions) that rows can be padded
        and stacked in; sliding-window and linear-attention layers are not."""
        from transformers.cache_utils import DynamicLayer

        layers = loaded.new_cache().layers
        return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)

    def __len__(self) -> int:
        return len(self.generations)

    def add(self, generation: Generation) -> None:
        """Take a request that has run its prefill (and sampled its first token) into the batch."""
        self.generations.append(generation)
        self._pending.append((generation, _layer_tensors(generation.release_cache())))

    def discard(self, generation: Generation) -> None:
        """Drop a request (finished, aborted or failed) from the batch; nothing when it is not in it."""
        index = next((i for i, member in enumerate(self.generations) if member is generation), None)
        if index is None:
            return
        del self.generations[index]
        self._pending = [entry for entry in self._pending if entry[0] is not generation]
        for row, member in enumerate(self._slots):
            if member is generation:
                self._slots[row] = None
                self._lengths[row] = 0

    def step(self) -> list[Finish | None]:
        """One forward pass over every request's last token; each samples its next token. Returns each request's
        finish reason (None: it goes on), in :attr:`generations` order."""
        self._sync()
        slots = self._slots
        tokens = [0 if member is None else member.token_ids[-1] for member in slots]
        positions = list(self._lengths)  # a padding row feeds token 0 at position 0
        lengths = [0 if member is None else length + 1 for member, length in zip(slots, self._lengths, strict=True)]
        active = [row for row, member in enumerate(slots) if member is not None]
        row_logits = self._forward(tokens, positions, lengths, active)
        self._lengths = lengths
        generations = [member for member in slots if member is not None]
        self.generations = generations
        finishes: list[Finish | None] = [None] * len(generations)
        live: list[int] = []
        live_logits: list[LiveLogits] = []
        for index, generation in enumerate(generations):
            logits = row_logits[index]
            if isinstance(logits, LiveLogits) and generation.samples_live_rows:
                live.append(index)
                live_logits.append(logits)
        if live:
            picks = sample_live_rows(
                torch.stack([logits.values for logits in live_logits]),
                self._live_layout(live_logits[0].rows),
                temperatures=[generations[index].settings.temperature for index in live],
                greedy=[generations[index].settings.greedy for index in live],
                generators=[generations[index].generator for index in live],
            )
            for index, picked in zip(live, picks, strict=True):
                finishes[index] = generations[index].accept_live(picked)
        sampled = set(live)
        for index, generation in enumerate(generations):
            if index not in sampled:
                finishes[index] = generation.accept(row_logits[index])
        return finishes

    def _live_layout(self, rows: torch.Tensor) -> LiveLayout:
        """The live ids' layout, made again when a weight load changed the live rows."""
        if self._layout is None or self._layout.rows is not rows:
            loaded = self._loaded
            self._layout = LiveLayout.of(rows, vocab_size=loaded.vocab_size, sampleable=loaded.sampleable)
        return self._layout

    # ---------------------------------------------------------------- internals

    def _forward(
        self, tokens: list[int], positions: list[int], lengths: list[int], active: list[int]
    ) -> torch.Tensor | list[Any]:
        """The logits of the ``active`` rows (the others are padding), in their order: float32 rows of one tensor,
        or the live-rows head's, one per row."""
        loaded = self._loaded
        model = loaded.model
        cache = self._cache
        original = model.config._attn_implementation
        options: dict[str, Any] = {
            loaded.cache_argument: cache,
            _LENGTHS_KWARG: lengths,
            "fsm_rollout_attention": original,
        }
        ids = torch.tensor(tokens, dtype=torch.long)[:, None]
        position_ids = torch.tensor(positions, dtype=torch.long)[:, None]
        self._set_attention(_ROWS_KEY)
        try:
            if loaded.head is not None and loaded.head.rows is not None:
                hidden = model.base_model(input_ids=ids, position_ids=position_ids, use_cache=True, **options)
                last = hidden.last_hidden_state[active, -1]
                logits: torch.Tensor | list[Any] = loaded.head.batch_live_logits(last)
            else:
                if loaded.takes_logits_to_keep:
                    options["logits_to_keep"] = 1
                output = model(input_ids=ids, position_ids=position_ids, use_cache=True, **options)
                logits = output.logits[active, -1].to(dtype=torch.float32, copy=True)
        finally:
            self._set_attention(original)
        return logits

    def _set_attention(self, name: str) -> None:
        """Switch the model's attention implementation through transformers' public switch (cheap on the small
        models this engine serves; writing the config directly would touch its private state)."""
        self._loaded.model.set_attn_implementation(name)

    def _sync(self) -> None:
        """Apply the membership changes since the last step: place the joined requests in free rows, or rebuild."""
        count = len(self.generations)
        if not count:
            self._cache, self._slots, self._lengths, self._pending = None, [], [], []
            return
        free = [row for row, member in enumerate(self._slots) if member is None]
        if self._cache is None:
            self._rebuild()
            return
        layer = self._cache.layers[0]
        columns, room = layer.columns, layer.room
        if (
            len(self._pending) > len(free)
            or any(rows[0][0].shape[2] > columns for _, rows in self._pending)
            or not room  # the next step's column would need larger buffers: a rebuild trims instead
            or len(free) - len(self._pending) >= max(ROW_MULTIPLE, count)  # mostly padding rows
        ):
            self._rebuild()
            return
        for row, (generation, rows) in zip(free, self._pending, strict=False):
            length = rows[0][0].shape[2]
            for cache_layer, (keys, values) in zip(self._cache.layers, rows, strict=True):
                cache_layer.place(row, keys[0], values[0])
            self._slots[row] = generation
            self._lengths[row] = length
        self._pending = []

    def _rebuild(self) -> None:
        """The cache of every request's row (the rows kept from the current cache first, in their order, then the
        joined requests' own caches), left-padded to the longest and with no column that is padding in every row,
        plus padding rows up to a multiple of :data:`ROW_MULTIPLE`. Padding (columns left of a row's own, padding
        rows) is left unset: attention never reads it."""
        kept = [row for row, member in enumerate(self._slots) if member is not None]
        members: list[Generation] = [member for member in self._slots if member is not None]
        lengths = [self._lengths[row] for row in kept]
        members += [generation for generation, _ in self._pending]
        lengths += [rows[0][0].shape[2] for _, rows in self._pending]
        current = _layer_tensors(self._cache) if self._cache is not None else []
        columns = max(lengths)
        count = -(-len(members) // ROW_MULTIPLE) * ROW_MULTIPLE
        kept_rows = torch.tensor(kept, dtype=torch.long)
        layers: list[Any] = []
        for layer in range(len(self._pending[0][1]) if self._pending else len(current)):
            buffers = []
            for which in (0, 1):
                sample = self._pending[0][1][layer][which] if self._pending else current[layer][which]
                shape = (count, sample.shape[1], columns + _SPARE_COLUMNS, sample.shape[3])
                buffer = sample.new_empty(shape)
                if kept:  # the kept rows' own columns are the last ones of the current cache
                    old = current[layer][which]
                    width = min(old.shape[2], columns)
                    buffer[: len(kept), :, columns - width : columns] = old.index_select(0, kept_rows)[:, :, -width:]
                for place, (_, rows) in enumerate(self._pending, start=len(kept)):
                    own = rows[layer][which]
                    buffer[place, :, columns - own.shape[2] : columns] = own[0]
                buffers.append(buffer)
            layers.append(_GrowingLayer(buffers[0], buffers[1], columns))
        from transformers import DynamicCache

        cache = DynamicCache(config=self._loaded.model.config)
        cache.layers = layers
        self._cache = cache
        self._slots = [*members, *([None] * (count - len(members)))]
        self._lengths = [*lengths, *([0] * (count - len(members)))]
        self._pending = []


class _GrowingLayer(DynamicLayer):  # type: ignore[no-untyped-call, unused-ignore]  # transformers is untyped
    """A KV cache layer of the batch's padded rows that a decode step grows in place: its keys and values are the
    first columns of larger buffers, so a new column is written, not the whole cache copied (which a plain
    ``DynamicLayer`` does on every update)."""

    def __init__(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, columns: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call, unused-ignore]
        self._key_buffer, self._value_buffer = key_buffer, value_buffer
        self._columns = columns
        self.keys, self.values = key_buffer[:, :, :columns], value_buffer[:, :, :columns]
        self.is_initialized = True
        self.device = key_buffer.device

    @property
    def columns(self) -> int:
        """Columns in use: every row's own columns end at the last of them."""
        return self._columns

    @property
    def room(self) -> int:
        """Columns the buffers have left for later decode steps."""
        return int(self._key_buffer.shape[2]) - self._columns

    def place(self, row: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write one request's own keys and values (heads, length, head size) into ``row``, ending at the last
        column in use (``length`` is at most :attr:`columns`)."""
        length = keys.shape[1]
        self._key_buffer[row, :, self._columns - length : self._columns] = keys
        self._value_buffer[row, :, self._columns - length : self._columns] = values

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self._columns, self._columns + key_states.shape[2]
        if end > self._key_buffer.shape[2]:
            shape = (*self._key_buffer.shape[:2], end + _SPARE_COLUMNS, self._key_buffer.shape[3])
            key_buffer, value_buffer = self._key_buffer.new_empty(shape), self._value_buffer.new_empty(shape)
            key_buffer[:, :, :start] = self._key_buffer[:, :, :start]
            value_buffer[:, :, :start] = self._value_buffer[:, :, :start]
            self._key_buffer, self._value_buffer = key_buffer, value_buffer
        self._key_buffer[:, :, start:end] = key_states
        self._value_buffer[:, :, start:end] = value_states
        self._columns = end
        self.keys = self._key_buffer[:, :, :end]
        self.values = self._value_buffer[:, :, :end]
        return self.keys, self.values


def _layer_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]
