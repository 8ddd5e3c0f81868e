"""Generation on the CPU with a Hugging Face causal LM: loading, one request's decoding state, sampling, stops.

A :class:`Generation` advances one token per :meth:`Generation.step`: the first step runs the prompt through
the model (prefill) into the request's own KV cache, every later step runs only the last sampled token. Sampling
follows vLLM's order and semantics: penalties and the ``min_tokens`` mask on the raw logits, then (unless greedy)
temperature, ``min_p``, ``top_k`` and ``top_p``; the token's logprob is the log-softmax of that *processed*
distribution (vLLM's ``--logprobs-mode processed_logprobs``). When most rows of the LM head are zero (the default
model's unused ids), :class:`LiveRowsHead` computes only the others.

:func:`load_weights` copies new parameter values into a loaded model (:func:`read_safetensors` reads them from a
file); the scheduler calls both on its worker thread, between two decode steps.

This module imports torch and transformers at import time; the server imports it only when an engine starts.

Why this module is long: it is everything that touches torch on the engine's side (loading, the sampling chain,
the live-rows head, weight loading), kept in one module so that the rest of the engine imports no torch.
"""

from __future__ import annotations

import contextlib
import inspect
import pathlib
import secrets
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fsm_rollout.engine.local.errors import ModelLoadError, WeightLoadError
from fsm_rollout.engine.local.live_rows import LiveLogits, LiveRowsHead, LiveSample, live_rows_head, sample_live
from fsm_rollout.engine.local.protocol import SamplingSettings
from fsm_rollout.engine.schema import Finish
from fsm_rollout.engine.stop_strings import completed_stop_string

if TYPE_CHECKING:
    from fsm_rollout.engine.local.grammar import GrammarMask

__all__ = [
    "Generation",
    "LiveRowsHead",
    "LoadedModel",
    "TokenLogprob",
    "load_model",
    "load_weights",
    "quiet_progress_bars",
    "read_safetensors",
    "top_p_filter",
]

_MIN_JSON_LOGPROB = -9999.0  # vLLM clamps logprobs to this: -inf has no JSON spelling
_TOP_P_FIRST_CANDIDATES = 1024  # top_p first looks at this many of the likeliest tokens
_TOP_P_BUCKETS = 1024  # log-probability buckets of the top_p search on flat distributions
_MAX_LEN_CONFIG_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
_LISTED_NAMES = 10  # a weight error names at most this many offending parameters


@dataclass(frozen=True)
class LoadedModel:
    """A causal LM and its tokenizer, ready to generate.

    ``vocab_size`` is the number of logit rows (the embedding size, padding included); ``sampleable`` the number
    of ids the tokenizer knows. Ids from ``sampleable`` up are padding rows: they are never sampled.
    ``eos_token_ids`` are the tokenizer's EOS and the generation config's ``eos_token_id`` entries.
    """

    model: Any
    tokenizer: Any
    model_dir: pathlib.Path
    max_model_len: int
    vocab_size: int
    sampleable: int
    eos_token_ids: frozenset[int]
    cache_argument: str
    takes_logits_to_keep: bool
    head: LiveRowsHead | None = None
    """The LM head over its non-zero rows, when most rows are zero (see :class:`LiveRowsHead`); else None."""

    def new_cache(self) -> Any:
        """An empty KV cache for one request."""
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def next_token_logits(self, input_ids: list[int], cache: Any) -> torch.Tensor | LiveLogits:
        """Run ``input_ids`` through the model on top of ``cache`` (which grows by them); the last position's
        logits as a fresh float32 tensor, or as the live rows' (see :class:`LiveRowsHead`)."""
        options: dict[str, Any] = {self.cache_argument: cache}
        ids = torch.tensor([input_ids], dtype=torch.long)
        if self.head is not None and self.head.rows is not None:
            hidden = self.model.base_model(input_ids=ids, use_cache=True, **options).last_hidden_state
            return self.head.live_logits(hidden[0, -1])
        if self.takes_logits_to_keep:  # spares a prefill the (prompt length x vocabulary) logits
            options["logits_to_keep"] = 1
        output = self.model(input_ids=ids, use_cache=True, **options)
        logits: torch.Tensor = output.logits[0, -1].to(dtype=torch.float32, copy=True)
        return logits


@dataclass(frozen=True)
class TokenLogprob:
    """The processed logprob and rank of one sampled token, and the ``logprobs`` likeliest candidates.

    ``top`` lists ``(token_id, logprob, rank)`` triples in rank order; logprobs of tokens the filters removed are
    clamped to -9999.0 as vLLM does.
    """

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float, int], ...]


def load_model(model_dir: pathlib.Path, *, max_model_len: int | None = None) -> LoadedModel:
    """Load a Hugging Face model directory (weights, config, tokenizer) in float32 for the CPU.

    ``max_model_len`` defaults to the model config's context length and may not exceed it.

    Raises:
        ModelLoadError: When the directory is missing, is not a causal LM with a tokenizer, or the length is invalid.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(f"{model_dir} is not a Hugging Face model directory (no config.json)")
    try:
        with quiet_progress_bars():
            tokenizer: Any = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
            model: Any = AutoModelForCausalLM.from_pretrained(
                str(model_dir), dtype=torch.float32, local_files_only=True
            )
    except (OSError, ValueError, KeyError) as error:
        raise ModelLoadError(f"cannot load a causal LM and its tokenizer from {model_dir}: {error}") from error
    model.eval()

    config_len = next(
        (getattr(model.config, key) for key in _MAX_LEN_CONFIG_KEYS if getattr(model.config, key, None)), None
    )
    if max_model_len is None:
        if config_len is None:
            raise ModelLoadError(f"{model_dir}: the config names no context length; pass max_model_len")
        max_model_len = int(config_len)
    elif max_model_len < 2 or (config_len is not None and max_model_len > config_len):
        raise ModelLoadError(
            f"max_model_len must be in [2, {config_len}] for {model_dir} (its config's context length), "
            f"got {max_model_len}"
        )

    vocab_size = int(model.get_input_embeddings().weight.shape[0])
    eos: set[int] = set()
    if tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(generation_eos, int):
        eos.add(generation_eos)
    elif isinstance(generation_eos, list):
        eos.update(int(token) for token in generation_eos)

    # transformers 5 renamed ``past_key_values`` to ``cache``; models not yet migrated keep the old name.
    parameters = inspect.signature(model.forward).parameters
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_dir=model_dir,
        max_model_len=max_model_len,
        vocab_size=vocab_size,
        sampleable=min(vocab_size, len(tokenizer)),
        eos_token_ids=frozenset(eos),
        cache_argument="cache" if "cache" in parameters else "past_key_values",
        takes_logits_to_keep="logits_to_keep" in parameters,
        head=live_rows_head(model),
    )


def load_weights(loaded: LoadedModel, state_dict: Mapping[str, Any]) -> None:
    """Copy ``state_dict`` (parameter name → tensor, any subset of the model's ``state_dict()`` names) into the model.

    Like ``model.load_state_dict(state_dict, strict=False)``: parameters left out keep their values, values are
    copied (converted to the model's dtype), and tied parameters (the tiny model's embedding and LM head) share the
    new value. Unlike it, unknown names and shape mismatches are refused, and nothing is copied then.

    Raises:
        WeightLoadError: Naming the parameters that are unknown, not tensors, or of the wrong shape.
    """
    current = loaded.model.state_dict()
    unknown = sorted(name for name in state_dict if name not in current)
    not_tensors = sorted(
        name for name, value in state_dict.items() if name in current and not isinstance(value, torch.Tensor)
    )
    mismatched = [
        f"{name} {list(value.shape)} (the model's is {list(current[name].shape)})"
        for name, value in state_dict.items()
        if name in current and isinstance(value, torch.Tensor) and value.shape != current[name].shape
    ]
    problems = []
    if unknown:
        problems.append(f"unknown parameter names: {_listed(unknown)}")
    if not_tensors:
        problems.append(f"values that are not tensors: {_listed(not_tensors)}")
    if mismatched:
        problems.append(f"shape mismatches: {_listed(mismatched)}")
    if problems:
        raise WeightLoadError(f"the new weights do not fit {loaded.model_dir.name}: {'; '.join(problems)}")
    loaded.model.load_state_dict(dict(state_dict), strict=False)
    if loaded.head is not None:
        loaded.head.refresh()


def read_safetensors(path: str | pathlib.Path) -> dict[str, torch.Tensor]:
    """The tensors of a local ``.safetensors`` file, on the CPU.

    Raises:
        WeightLoadError: When the file is missing or is not a safetensors file.
    """
    from safetensors.torch import load_file

    file = pathlib.Path(path).expanduser()
    if not file.is_file():
        raise WeightLoadError(f"no weights file at {path}")
    try:
        tensors: dict[str, torch.Tensor] = load_file(str(file), device="cpu")
    except Exception as error:  # safetensors raises its own SafetensorError (and OSError) for unreadable files
        raise WeightLoadError(f"cannot read {path} as a safetensors file: {error}") from error
    return tensors


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_LISTED_NAMES])
    return shown if len(names) <= _LISTED_NAMES else f"{shown} and {len(names) - _LISTED_NAMES} more"


@contextlib.contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """Switch transformers' progress bars off for the block (loading one small shard needs none)."""
    from transformers.utils import logging

    enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()  # type: ignore[no-untyped-call, unused-ignore]
    try:
        yield
    finally:
        if enabled:
            logging.enable_progress_bar()  # type: ignore[no-untyped-call, unused-ignore]


class _IncrementalText:
    """The decoded text of a growing token list, extended by the new characters of each token.

    Decodes only a short window of trailing tokens per step (the way vLLM's incremental detokenizer does), and
    holds back characters while the window ends in an incomplete UTF-8 sequence.
    """

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self.text = ""

    def push(self, token_id: int) -> int:
        """Append a token; returns how many characters it completed."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return 0
        delta = after[len(before) :]
        self.text += delta
        self._prefix = self._read
        self._read = len(self._ids)
        return len(delta)

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        text: str = self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)
        return text


class Generation:
    """One request's decoding state: its KV cache, random generator, output tokens, logprobs and stop checks.

    Not thread-safe: one thread (the engine's worker) calls :meth:`step` until it returns a finish reason.
    """

    def __init__(self, loaded: LoadedModel, prompt: list[int], settings: SamplingSettings) -> None:
        self._loaded = loaded
        self._prompt = prompt
        self.settings = settings
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.stop_reason: str | int | None = None
        self._cache: Any = None
        seed = settings.seed if settings.seed is not None else secrets.randbits(63)
        self._generator = torch.Generator().manual_seed(seed)
        self._text = (
            _IncrementalText(loaded.tokenizer, skip_special_tokens=settings.skip_special_tokens)
            if settings.stop
            else None
        )
        stops = set(settings.stop_token_ids)
        if not settings.ignore_eos:
            stops |= loaded.eos_token_ids
        self._stop_ids = frozenset(stops)
        self._min_tokens_mask = torch.tensor(
            sorted(token for token in stops if token < loaded.vocab_size), dtype=torch.long
        )
        self._seen: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None
        if settings.repetition_penalty != 1.0:
            self._seen = torch.zeros(loaded.vocab_size, dtype=torch.bool)
            self._seen[torch.tensor(prompt)] = True
        if settings.presence_penalty or settings.frequency_penalty:
            self._counts = torch.zeros(loaded.vocab_size, dtype=torch.float32)
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None
        if settings.logit_bias:
            ids, biases = zip(*settings.logit_bias, strict=True)
            self._bias = (torch.tensor(ids, dtype=torch.long), torch.tensor(biases, dtype=torch.float32))
        self._grammar: GrammarMask | None = None
        if settings.structured is not None:  # every token is sampled under the grammar's mask
            from fsm_rollout.engine.local.grammar import GrammarMask

            self._grammar = GrammarMask(
                settings.structured,
                tokenizer=loaded.tokenizer,
                vocab_size=loaded.vocab_size,
                stop_token_ids=self._stop_ids,
            )
        # Settings that treat every zero row of a live-rows head alike can sample without them (see live_rows).
        self._samples_live = (
            self._seen is None
            and self._counts is None
            and self._bias is None
            and self._grammar is None
            and settings.min_p <= 0
            and not 0 < settings.top_k < loaded.vocab_size
            and settings.top_p >= 1.0
            and (settings.logprobs or 0) <= 1
        )

    @property
    def prompt_len(self) -> int:
        """Number of prompt tokens."""
        return len(self._prompt)

    def step(self) -> Finish | None:
        """Run one forward pass on the request's own KV cache (the prompt the first time), sample one token and
        return why the generation ended, or None to go on."""
        return self.accept(self._forward())

    def release_cache(self) -> Any:
        """Hand over the KV cache (to a :class:`~fsm_rollout.engine.local.batch.DecodeBatch`): later tokens run
        through the batch, which calls :meth:`accept` with their logits."""
        cache, self._cache = self._cache, None
        return cache

    def accept(self, logits: torch.Tensor | LiveLogits) -> Finish | None:
        """Sample one token from ``logits`` (the next position's, float32; modified in place) and return why the
        generation ended, or None to go on."""
        if isinstance(logits, LiveLogits):
            if self._samples_live:
                token, logprob = self._sample_live(logits)
            else:
                token, logprob = self._sample(logits.full(self._loaded.vocab_size))
        else:
            token, logprob = self._sample(logits)
        return self.record(token, logprob)

    @property
    def samples_live_rows(self) -> bool:
        """Whether the next token is sampled from live-rows logits by :func:`sample_live` without a mask, so that
        :func:`~fsm_rollout.engine.local.live_rows.sample_live_rows` may sample it among other rows."""
        return self._samples_live and not (
            len(self.token_ids) < self.settings.min_tokens and self._min_tokens_mask.numel()
        )

    @property
    def generator(self) -> torch.Generator:
        """The request's own random generator."""
        return self._generator

    def accept_live(self, picked: LiveSample) -> Finish | None:
        """Take a token sampled elsewhere from this request's live-rows logits (see :attr:`samples_live_rows`) and
        return why the generation ended, or None to go on."""
        return self.record(picked.token, self._live_logprob(picked))

    def record(self, token: int, logprob: TokenLogprob) -> Finish | None:
        """Append a sampled token and return why the generation ended, or None to go on."""
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        if self._seen is not None:
            self._seen[token] = True
        if self._counts is not None:
            self._counts[token] += 1
        if self._grammar is not None:
            self._grammar.accept(token)
        return self._finish_reason(token)

    # ---------------------------------------------------------------- forward

    def _forward(self) -> torch.Tensor | LiveLogits:
        if self._cache is None:  # prefill: the whole prompt
            self._cache = self._loaded.new_cache()
            return self._loaded.next_token_logits(self._prompt, self._cache)
        return self._loaded.next_token_logits(self.token_ids[-1:], self._cache)

    # ---------------------------------------------------------------- sampling

    def _sample(self, logits: torch.Tensor) -> tuple[int, TokenLogprob]:
        settings = self.settings
        processed = self._process(logits)
        logprobs = torch.log_softmax(processed, dim=0)
        token = int(torch.argmax(processed)) if settings.greedy else self._draw(logprobs)
        logprob = float(logprobs[token])
        rank = int((logprobs > logprob).sum()) + 1
        top: tuple[tuple[int, float, int], ...] = ()
        if settings.logprobs:
            if settings.logprobs == 1:  # what rollouts ask for; a max is one pass, a top-k a much slower selection
                best, best_id = torch.max(logprobs, dim=0)
                values, ids = best.reshape(1), best_id.reshape(1)
            else:
                values, ids = torch.topk(logprobs, settings.logprobs)
            top = tuple(
                (int(candidate), max(float(value), _MIN_JSON_LOGPROB), position + 1)
                for position, (value, candidate) in enumerate(zip(values.tolist(), ids.tolist(), strict=True))
            )
        return token, TokenLogprob(token_id=token, logprob=logprob, rank=rank, top=top)

    def _sample_live(self, logits: LiveLogits) -> tuple[int, TokenLogprob]:
        settings = self.settings
        masked = self._min_tokens_mask if len(self.token_ids) < settings.min_tokens else None
        picked = sample_live(
            logits,
            vocab_size=self._loaded.vocab_size,
            sampleable=self._loaded.sampleable,
            masked=masked,
            temperature=settings.temperature,
            greedy=settings.greedy,
            generator=self._generator,
        )
        return picked.token, self._live_logprob(picked)

    def _live_logprob(self, picked: LiveSample) -> TokenLogprob:
        top = ((picked.best, max(picked.best_logprob, _MIN_JSON_LOGPROB), 1),) if self.settings.logprobs else ()
        return TokenLogprob(token_id=picked.token, logprob=picked.logprob, rank=picked.rank, top=top)

    def _process(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits the token is drawn from: padding rows, ``min_tokens``, the grammar's mask, ``logit_bias``,
        penalties, then the filters. The logprob is the processed distribution's, so a constrained token's logprob
        is the masked distribution's."""
        settings = self.settings
        loaded = self._loaded
        if loaded.sampleable < loaded.vocab_size:
            logits[loaded.sampleable :] = float("-inf")
        if len(self.token_ids) < settings.min_tokens and self._min_tokens_mask.numel():
            logits[self._min_tokens_mask] = float("-inf")
        if self._grammar is not None:
            self._grammar.apply(logits)
        if self._bias is not None:
            logits[self._bias[0]] += self._bias[1]
        if self._seen is not None:
            penalty = settings.repetition_penalty
            penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(self._seen, penalized, logits)
        if self._counts is not None:
            logits = logits - settings.frequency_penalty * self._counts
            logits = logits - settings.presence_penalty * (self._counts > 0).to(torch.float32)
        if settings.greedy:
            return logits
        if settings.temperature != 1.0:  # dividing by 1 changes nothing but costs a pass over the vocabulary
            logits = logits / settings.temperature
        if settings.min_p > 0:
            probs = torch.softmax(logits, dim=0)
            logits = logits.masked_fill(probs < settings.min_p * probs.max(), float("-inf"))
        if 0 < settings.top_k < logits.numel():
            kth = torch.topk(logits, settings.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if settings.top_p < 1.0:
            logits = top_p_filter(logits, settings.top_p)
        return logits

    def _draw(self, logprobs: torch.Tensor) -> int:
        """Draw a token by inverse-CDF sampling with the request's generator (much cheaper than multinomial over
        a 150k vocabulary)."""
        cdf = torch.cumsum(logprobs.exp().to(torch.float64), dim=0)
        threshold = torch.rand((), generator=self._generator, dtype=torch.float64) * cdf[-1]
        token = int(torch.searchsorted(cdf, threshold, right=True))
        if token >= cdf.numel() or logprobs[token] == float("-inf"):  # only when the draw hits the very top of the CDF
            token = int(torch.nonzero(logprobs > float("-inf")).max())
        return token

    # ---------------------------------------------------------------- stopping

    def _finish_reason(self, token: int) -> Finish | None:
        """vLLM's stop checks: none before ``min_tokens``; EOS and stop token ids; stop strings; then length.

        Sets :attr:`stop_reason` as vLLM reports it: the stop string or stop token id that matched, None for the
        tokenizer's EOS and for "length". A stop on the token that also reaches ``max_tokens`` reports "stop".
        """
        settings = self.settings
        produced = len(self.token_ids)
        new_chars = self._text.push(token) if self._text is not None else 0
        if produced >= settings.min_tokens and token in self._stop_ids:
            self.stop_reason = None if token == self._loaded.tokenizer.eos_token_id else token
            return "stop"
        if self._text is not None and produced > settings.min_tokens and new_chars:
            matched = self._completed_stop_string(new_chars)
            if matched is not None:
                self.stop_reason = matched
                return "stop"
        if produced >= settings.max_tokens or self.prompt_len + produced >= self._loaded.max_model_len:
            return "length"
        return None

    def _completed_stop_string(self, new_chars: int) -> str | None:
        """The first stop string that ends inside the characters the last token added (earlier text was checked)."""
        assert self._text is not None
        text = self._text.text
        return completed_stop_string(text, len(text) - new_chars, self.settings.stop)


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of likeliest tokens whose mass reaches ``top_p`` (vLLM's rule), -inf elsewhere.

    A token stays when the mass of the tokens likelier than it is below ``top_p``. A peaked distribution is settled
    within its top 1024 tokens; a flat one (like the random tiny model's) by :func:`_top_p_cutoff`, so neither pays
    for sorting the whole vocabulary, which is slow on a CPU.
    """
    probs = torch.softmax(logits, dim=0)
    values, ids = torch.topk(probs, min(probs.numel(), _TOP_P_FIRST_CANDIDATES))
    values64 = values.to(torch.float64)
    mass = torch.cumsum(values64, dim=0)
    if float(mass[-1]) >= top_p:
        keep = max(int(((mass - values64) < top_p).sum()), 1)
        filtered = torch.full_like(logits, float("-inf"))
        filtered[ids[:keep]] = logits[ids[:keep]]
        return filtered
    return logits.masked_fill(probs < _top_p_cutoff(probs, top_p), float("-inf"))


def _top_p_cutoff(probs: torch.Tensor, top_p: float) -> float:
    """The smallest probability the top-p rule keeps, found without a full sort.

    Tokens are bucketed by log-probability (bucket 0 holds the likeliest); the bucket where the running mass
    reaches ``top_p`` is the only one sorted. Every token of an earlier bucket is at least as likely as every
    token of a later one, so the running mass inside that bucket is exact.
    """
    buckets = _TOP_P_BUCKETS
    log_probs = torch.log(probs)
    live = log_probs[probs > 0]
    low, high = float(live.min()), float(live.max())
    width = (high - low) / buckets or 1.0
    bucket = (buckets - 1) - ((log_probs - low) / width).floor().clamp(0, buckets - 1).to(torch.long)
    weights = probs.to(torch.float64)
    running = torch.cumsum(torch.bincount(bucket, weights=weights, minlength=buckets), dim=0)
    crossing = min(int((running < top_p).sum()), buckets - 1)
    before = float(running[crossing - 1]) if crossing else 0.0
    members = weights[bucket == crossing].sort(descending=True).values
    keep = max(int(((before + torch.cumsum(members, dim=0) - members) < top_p).sum()), 1)
    return float(members[keep - 1])
