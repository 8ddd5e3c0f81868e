"""RolloutConfig: every option a rollout reads, validated once, and built from slime/vime argument namespaces."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsm_rollout.errors import ConfigError, IncompatibleOptionsError, SamplingParamsError, TemplateKwargsError

HISTORY_POLICIES: tuple[str, ...] = ("append", "fork", "per_turn", "auto")
"""How a rollout carries the conversation's history from one turn to the next (``RolloutConfig.history_policy``)."""

DEFAULT_ENV_MODULE = "fsm_rollout.envs.geo3k"
"""The environment module used when neither ``env_path`` nor a factory is given: the shipped Geo3K environment (the
seed's default, ``examples.geo3k_vlm_multi_turn.env_geo3k``, is not part of this package)."""


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Which engine failures are retried, how often, and how long to wait between attempts.

    Only failures that are safe to repeat are retried: connection errors and HTTP 429/500/502/503/504 (render and
    generate have no side effects, and a 500 from vLLM or a router in front of it is often transient). Any other
    status, and every 4xx but 429, fails at once with the server's message; a retryable one that persists fails
    after ``max_attempts`` with the last answer's message. Waits grow exponentially from ``base_delay_s`` up to
    ``max_delay_s`` with full jitter.
    """

    max_attempts: int = 4
    base_delay_s: float = 0.2
    max_delay_s: float = 5.0
    retry_statuses: frozenset[int] = frozenset({429, 500, 502, 503, 504})

    def __post_init__(self) -> None:
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ConfigError(f"RetryPolicy.max_attempts must be an int >= 1, got {self.max_attempts!r}")
        if self.base_delay_s < 0 or self.max_delay_s < 0:
            raise ConfigError("RetryPolicy delays must be non-negative")
        client_errors = sorted(status for status in self.retry_statuses if 400 <= status < 500 and status != 429)
        if client_errors:
            raise ConfigError(f"RetryPolicy.retry_statuses must not hold request errors (4xx but 429): {client_errors}")

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number ``attempt`` (1 for the first retry), with full jitter."""
        ceiling = min(self.max_delay_s, self.base_delay_s * (2 ** (attempt - 1)))
        return random.uniform(0.0, ceiling)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value  # NaN is not


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """Options of a multi-turn rollout and of its engine client.

    ``engine_url`` is the vLLM server or router base URL (``http://host:port``). ``model`` is the served model name
    sent with every render request (the seed's ``hf_checkpoint``). ``tokenizer_path`` is where the local tokenizer
    is loaded from; without it :class:`~fsm_rollout.runtime.runner.RolloutRunner` asks the engine (``GET /v1/models``:
    the tokenizer it names, else its model path, else ``model``) and loads that from local files only, never from
    the hub. ``trust_remote_code`` lets a tokenizer or processor that ships its own Python code run it (off: a
    path someone typed should not run code from that repository). ``rollout_max_context_len`` and the sampling
    ``max_new_tokens`` bound the response side together; ``max_turns`` bounds the number of generate turns.
    ``record`` keeps an I/O tape beside the ``trace`` file for offline replay (:mod:`fsm_rollout.recording`).
    ``api_key`` is sent as ``Authorization: Bearer …`` on every engine request and is never written to a trace,
    tape, result or message.

    Weight updates (:meth:`RolloutRunner.weight_update <fsm_rollout.runtime.runner.RolloutRunner.weight_update>`)
    suspend the rollouts and resume them without losing a token. ``weight_update_strategy`` says how: ``"abort"`` aborts
    the requests in flight at the engine and continues each turn from the tokens it had (any vLLM with the scale-out
    endpoints), ``"keep"`` has the engine freeze them (``/pause?mode=keep``, vLLM with ``VLLM_SERVER_DEV_MODE=1``).
    Environments: their methods (and ``build_env``) may be coroutine functions; synchronous ones run inline unless
    ``env_executor="thread"`` runs them in a pool of ``env_max_workers`` threads (created on first use), so a slow
    environment does not stall the event loop. ``env_step_timeout_s`` bounds one environment call and
    ``rollout_timeout_s`` one rollout's wall time (time ``suspended`` for a weight update excluded); either ends the
    sample ``truncated`` (reasons ``env_timeout`` / ``rollout_timeout``, ``metadata["rollout_timeout"]``).
    ``reward_fn`` (``(sample) -> float``, sync or async) sets ``sample.reward`` on the way into ``completed`` or
    ``truncated`` (the table's ``score``, after the edge's actions); it is never recorded.
    ``observation_image_max_bytes`` and ``observation_image_max_pixels`` limit each image an environment's
    observation holds (a bigger one fails the sample before its pixels are decoded).

    Behind a router (``engine_url`` a ``vllm-router`` in front of several servers), ``servers_behind_router`` lists
    the servers' own URLs: a router forwards each request to one server, so a weight update's ``/pause``,
    ``/resume``, ``/update_weight_version`` and its ``abort_requests`` are sent to every listed server directly
    (a server ignores ids it does not know). Requests of samples, and a sample's own abort, still go through
    ``engine_url``.

    ``history_policy`` says how the conversation's history reaches the next turn (:mod:`fsm_rollout.rollout.history`):
    ``"append"`` appends each observation's boundary tokens to the tokens so far and never re-renders; ``"fork"``
    re-renders the conversation through the engine at each observation and, where that does not extend the tokens
    so far, closes the training sequence (into ``sample.branches``) and opens one whose prompt is the re-render;
    ``"per_turn"`` makes every model call its own training sequence; ``"auto"`` (the default) lets the runner choose
    append or fork once at start-up from the template probe (a rollout built directly treats it as append).

    ``partial_rollout`` (slime/vime's flag, for :mod:`fsm_rollout.compat`) hands a suspended sample back to the
    trainer instead of waiting (status ``aborted``, ``metadata["resume_state"]``); passing it again resumes it.

    Two options change the whole process, so they are off unless asked for (``fsm-rollout run`` and ``bench`` turn
    them on): ``loop_slice_ms`` is the event-loop time per iteration that rollouts' CPU work aims to stay within when
    many share a loop (:mod:`fsm_rollout.runtime.pacing`; ``None``, the default, turns pacing off), and ``tune_gc``
    tunes Python's garbage collector while rollouts run: small, cache-warm young collections, and full ones deferred
    (:mod:`fsm_rollout.runtime.gc_policy`).

    ``admission`` says what a runner's batch, group or stream admits (:mod:`fsm_rollout.runtime.admission`):
    ``"fixed"`` (the default) keeps ``concurrency`` samples in flight; ``"adaptive"`` admits generate requests
    instead, from the engine's load on ``GET /metrics``: new samples and next turns go while its waiting queue stays
    at most ``admission_max_waiting`` and its KV-cache use under ``admission_kv_target``, oldest request first, and
    a sample stepping its environment holds no slot. A server without ``/metrics`` gets fixed admission.

    ``max_staleness`` paces a runner's batches, groups and streams for an asynchronous trainer
    (:mod:`fsm_rollout.runtime.staleness`): no group starts more than this many weight versions ahead of what the
    trainer has reported consumed (``runner.consumed(version)``); new groups wait, finished ones are never dropped.
    ``None`` (the default) paces nothing.
    """

    engine_url: str
    model: str
    max_turns: int
    tokenizer_path: str | None = None
    rollout_max_context_len: int | None = None
    partial_rollout: bool = False
    router_policy: str | None = None
    apply_chat_template_kwargs: Mapping[str, Any] | None = None
    use_rollout_routing_replay: bool = False
    num_layers: int | None = None
    moe_router_topk: int | None = None
    append_eos_token_after_stop_str_in_multi_turn: bool = True
    track_speculative_stats: bool = False
    env_path: str | None = None
    connect_timeout_s: float = 10.0
    request_timeout_s: float | None = 600.0
    abort_notice_timeout_s: float = 5.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    trace: str | Path | None = None
    record: bool = False
    check_invariants: bool = False
    image_placeholder_token: str = "<|image_pad|>"
    image_merge_size: int | None = None
    observation_image_max_bytes: int = 16 * 1024 * 1024
    observation_image_max_pixels: int = 4096 * 4096
    loop_slice_ms: float | None = None
    tune_gc: bool = False
    api_key: str | None = field(default=None, repr=False)
    weight_update_strategy: str = "abort"
    env_executor: str = "inline"
    env_max_workers: int = 16
    env_step_timeout_s: float | None = None
    rollout_timeout_s: float | None = None
    reward_fn: Any = field(default=None, repr=False, compare=False)
    servers_behind_router: tuple[str, ...] = ()
    trust_remote_code: bool = False
    history_policy: str = "auto"
    admission: str = "fixed"
    admission_kv_target: float = 0.9
    admission_max_waiting: int = 8
    max_staleness: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_turns) or self.max_turns <= 0:
            raise ConfigError(f"max_turns must be a positive integer, got {self.max_turns!r}")
        if not isinstance(self.engine_url, str) or not self.engine_url.startswith(("http://", "https://")):
            raise ConfigError(f"engine_url must be an http(s) URL, got {self.engine_url!r}")
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("model (the served model name) must be a non-empty string")
        if self.weight_update_strategy not in ("abort", "keep"):
            raise ConfigError(f"weight_update_strategy must be 'abort' or 'keep', got {self.weight_update_strategy!r}")
        if self.record and (self.trace is None or str(self.trace) in ("off", "stdout", "-")):
            raise ConfigError("record=True needs a trace file path: the I/O tape is written beside the trace")
        if self.rollout_max_context_len is not None and (
            not _is_int(self.rollout_max_context_len) or self.rollout_max_context_len < 0
        ):
            raise ConfigError(
                f"rollout_max_context_len must be a non-negative integer, got {self.rollout_max_context_len!r}"
            )
        if self.use_rollout_routing_replay:
            for name in ("num_layers", "moe_router_topk"):
                value = getattr(self, name)
                if not _is_int(value) or value <= 0:
                    raise ConfigError(f"use_rollout_routing_replay needs a positive integer {name}, got {value!r}")
        kwargs = self.apply_chat_template_kwargs or {}
        if not isinstance(kwargs, Mapping):
            raise ConfigError("apply_chat_template_kwargs must be a mapping")
        clashing = sorted({"tokenize", "add_generation_prompt", "tools"} & set(kwargs))
        if clashing:
            raise TemplateKwargsError(
                f"apply_chat_template_kwargs must not set {clashing}: the rollout sets them itself"
            )
        for name in ("connect_timeout_s", "abort_notice_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ConfigError(f"request_timeout_s must be positive or None, got {self.request_timeout_s!r}")
        if not isinstance(self.image_placeholder_token, str) or not self.image_placeholder_token:
            raise ConfigError(
                f"image_placeholder_token must be a non-empty string, got {self.image_placeholder_token!r}"
            )
        if self.loop_slice_ms is not None and (
            not isinstance(self.loop_slice_ms, int | float)
            or isinstance(self.loop_slice_ms, bool)
            or not math.isfinite(self.loop_slice_ms)
            or self.loop_slice_ms <= 0
        ):
            raise ConfigError(
                f"loop_slice_ms must be a positive number of milliseconds or None, got {self.loop_slice_ms!r}"
            )
        if self.image_merge_size is not None and (not _is_int(self.image_merge_size) or self.image_merge_size < 1):
            raise ConfigError(f"image_merge_size must be a positive integer or None, got {self.image_merge_size!r}")
        for name in ("observation_image_max_bytes", "observation_image_max_pixels"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.env_executor not in ("inline", "thread"):
            raise ConfigError(f"env_executor must be 'inline' or 'thread', got {self.env_executor!r}")
        if not _is_int(self.env_max_workers) or self.env_max_workers < 1:
            raise ConfigError(f"env_max_workers must be a positive integer, got {self.env_max_workers!r}")
        for name in ("env_step_timeout_s", "rollout_timeout_s"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value <= 0
            ):
                raise ConfigError(f"{name} must be a positive number of seconds or None, got {value!r}")
        servers = self.servers_behind_router
        if isinstance(servers, str) or not isinstance(servers, list | tuple):
            raise ConfigError(f"servers_behind_router must be a list of server URLs, got {servers!r}")
        bad = [url for url in servers if not isinstance(url, str) or not url.startswith(("http://", "https://"))]
        if bad:
            raise ConfigError(f"servers_behind_router holds entries that are not http(s) URLs: {bad!r}")
        object.__setattr__(self, "servers_behind_router", tuple(servers))  # frozen: a list given is kept as a tuple
        if not isinstance(self.trust_remote_code, bool):
            raise ConfigError(f"trust_remote_code must be True or False, got {self.trust_remote_code!r}")
        if self.reward_fn is not None and not callable(self.reward_fn):
            raise ConfigError(f"reward_fn must be callable (sample) -> float, got {type(self.reward_fn).__name__}")
        if self.admission not in ("fixed", "adaptive"):
            raise ConfigError(f"admission must be 'fixed' or 'adaptive', got {self.admission!r}")
        target = self.admission_kv_target
        if not isinstance(target, int | float) or isinstance(target, bool) or not 0 < target <= 1:
            raise ConfigError(f"admission_kv_target must be a fraction in (0, 1], got {target!r}")
        if not _is_int(self.admission_max_waiting) or self.admission_max_waiting < 0:
            raise ConfigError(
                f"admission_max_waiting must be a non-negative integer, got {self.admission_max_waiting!r}"
            )
        if self.max_staleness is not None and (not _is_int(self.max_staleness) or self.max_staleness < 0):
            raise ConfigError(f"max_staleness must be a non-negative integer or None, got {self.max_staleness!r}")
        if self.history_policy not in HISTORY_POLICIES:
            raise ConfigError(
                f"history_policy must be one of {', '.join(map(repr, HISTORY_POLICIES))}, got {self.history_policy!r}"
            )

    @property
    def expert_dims(self) -> tuple[int, int] | None:
        """``(num_layers, moe_router_topk)`` when both are known, for sizing routed-expert arrays."""
        if self.num_layers is None or self.moe_router_topk is None:
            return None
        return (self.num_layers, self.moe_router_topk)

    def check_sampling(self, inference_params: Mapping[str, Any]) -> None:
        """Reject combinations that could only fail mid-rollout (the seed found them at turn N)."""
        if (
            self.use_rollout_routing_replay
            and self.append_eos_token_after_stop_str_in_multi_turn
            and inference_params.get("stop")
        ):
            raise IncompatibleOptionsError(
                "Routing replay cannot be combined with stop strings while "
                "append_eos_token_after_stop_str_in_multi_turn is on: the EOS appended after a stop string has "
                "no routing data. Drop the stop strings or turn the EOS append off."
            )

    def to_dict(self, *, include_api_key: bool = False) -> dict[str, Any]:
        """The config as JSON-ready data (the Ray workers' copy, the tape's record); :meth:`from_dict` reads it.

        ``reward_fn`` is code, not data, and is never included. ``api_key`` is left out unless
        ``include_api_key`` (a worker process needs it; a file must not hold it).
        """
        data: dict[str, Any] = {}
        for item in dataclasses.fields(self):
            if item.name in _NOT_DATA or (item.name == "api_key" and not include_api_key):
                continue
            value = getattr(self, item.name)
            if isinstance(value, RetryPolicy):
                value = {**dataclasses.asdict(value), "retry_statuses": sorted(value.retry_statuses)}
            elif isinstance(value, Path):
                value = str(value)
            elif isinstance(value, Mapping):
                value = dict(value)
            elif isinstance(value, tuple):
                value = list(value)
            data[item.name] = value
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, ignore_unknown: bool = False) -> RolloutConfig:
        """The config :meth:`to_dict` wrote, validated as any config is.

        Keys written under a former name (:data:`RENAMED_FIELDS`) are read under today's. A key that is no field
        is a :class:`~fsm_rollout.errors.ConfigError` naming it, unless ``ignore_unknown`` (replay reads tapes of
        other versions this way, and names the keys it left out: :meth:`unknown_keys`).
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"a RolloutConfig is read from a mapping, got {type(data).__name__}")
        values = {RENAMED_FIELDS.get(key, key): value for key, value in data.items()}
        unknown = cls.unknown_keys(values)
        if unknown and not ignore_unknown:
            raise ConfigError(
                f"RolloutConfig has no field(s) {', '.join(map(repr, unknown))}; its fields are "
                f"{', '.join(sorted(_FIELD_NAMES))}"
            )
        values = {key: value for key, value in values.items() if key in _FIELD_NAMES and key not in _NOT_DATA}
        retry = values.pop("retry", None)
        if isinstance(retry, Mapping):
            retry = dict(retry)
            if "retry_statuses" in retry:
                retry["retry_statuses"] = frozenset(retry["retry_statuses"])
            try:
                values["retry"] = RetryPolicy(**retry)
            except TypeError as error:
                raise ConfigError(f"retry: {error}") from error
        elif retry is not None:
            values["retry"] = retry
        return cls(**values)

    @staticmethod
    def unknown_keys(data: Mapping[str, Any]) -> list[str]:
        """The keys of ``data`` that are no field of today's config (former names count as known), sorted."""
        return sorted(key for key in data if RENAMED_FIELDS.get(key, key) not in _FIELD_NAMES)

    @classmethod
    def from_args(cls, args: Any, **overrides: Any) -> RolloutConfig:
        """Build a config from a slime/vime argument namespace, reading the attributes the seed reads.

        Required: ``vllm_router_ip``, ``vllm_router_port``, ``hf_checkpoint``, ``max_turns``,
        ``rollout_max_context_len``, ``partial_rollout``, ``rollout_interaction_env_path``.
        """
        missing = [
            name
            for name in (
                "partial_rollout",
                "max_turns",
                "rollout_interaction_env_path",
                "vllm_router_ip",
                "vllm_router_port",
                "hf_checkpoint",
                "rollout_max_context_len",
            )
            if not hasattr(args, name)
        ]
        if missing:
            raise ConfigError(f"argument namespace lacks required attributes: {', '.join(missing)}")
        if getattr(args, "use_score_centering", False):
            raise ConfigError("use_score_centering is not supported by the multi-turn rollout")
        values: dict[str, Any] = {
            "engine_url": f"http://{args.vllm_router_ip}:{args.vllm_router_port}",
            "model": args.hf_checkpoint,
            "max_turns": args.max_turns,
            "rollout_max_context_len": args.rollout_max_context_len,
            "partial_rollout": bool(args.partial_rollout),
            "router_policy": getattr(args, "router_policy", None),
            "apply_chat_template_kwargs": getattr(args, "apply_chat_template_kwargs", None) or None,
            "use_rollout_routing_replay": bool(getattr(args, "use_rollout_routing_replay", False)),
            "num_layers": getattr(args, "num_layers", None),
            "moe_router_topk": getattr(args, "moe_router_topk", None),
            "append_eos_token_after_stop_str_in_multi_turn": bool(
                getattr(args, "append_eos_token_after_stop_str_in_multi_turn", True)
            ),
            "track_speculative_stats": bool(getattr(args, "vllm_speculative_config", None)),
            "env_path": args.rollout_interaction_env_path or DEFAULT_ENV_MODULE,
        }
        values.update(overrides)
        return cls(**values)


_FIELD_NAMES = frozenset(item.name for item in dataclasses.fields(RolloutConfig))
_NOT_DATA = frozenset({"reward_fn"})
RENAMED_FIELDS: Mapping[str, str] = {"defer_full_gc": "tune_gc"}
"""Former field names and today's, so configs written before a rename (tapes) still read."""


SAMPLING_REQUIRED_KEYS = ("max_new_tokens", "temperature")
"""The sampling parameters every rollout must set; ``top_p`` may be left out (1.0, vLLM's default: no filter)."""


def build_inference_sampling_params(sampling_params: Mapping[str, Any]) -> dict[str, Any]:
    """Map slime/vime sampling parameters to vLLM's ``sampling_params``.

    ``max_new_tokens`` (may be None: unlimited) becomes ``max_tokens``; ``top_p`` defaults to 1.0; ``logprobs`` is
    always 1; optional keys are copied only when set, with ``top_k`` kept only when positive or -1. A runner calls
    this when it is built, so bad values fail there rather than at the first rollout.
    """
    missing = [key for key in SAMPLING_REQUIRED_KEYS if key not in sampling_params]
    if missing:
        raise SamplingParamsError(f"sampling_params lacks required keys {missing}")
    budget = sampling_params["max_new_tokens"]
    if budget is not None and (not _is_int(budget) or budget < 0):
        raise ConfigError(f"max_new_tokens must be a non-negative integer or None, got {budget!r}")
    temperature = sampling_params["temperature"]
    if not _is_number(temperature) or temperature < 0:
        raise ConfigError(f"temperature must be a number >= 0, got {temperature!r}")
    top_p = sampling_params.get("top_p", 1.0)
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise ConfigError(f"top_p must be a number in (0, 1], got {top_p!r}")
    params: dict[str, Any] = {
        "max_tokens": budget,
        "temperature": temperature,
        "top_p": top_p,
        "logprobs": 1,
    }
    top_k = sampling_params.get("top_k")
    if top_k is not None and (top_k > 0 or top_k == -1):
        params["top_k"] = top_k
    stop = sampling_params.get("stop")
    if stop:
        if not isinstance(stop, str) and not (
            isinstance(stop, list | tuple) and all(isinstance(item, str) for item in stop)
        ):
            raise ConfigError(f"stop must be a string or a list of strings, got {stop!r}")
        params["stop"] = stop
        if sampling_params.get("no_stop_trim"):
            params["include_stop_str_in_output"] = True
    if sampling_params.get("stop_token_ids"):
        params["stop_token_ids"] = list(sampling_params["stop_token_ids"])
    if sampling_params.get("seed") is not None:
        params["seed"] = sampling_params["seed"]
    if sampling_params.get("min_new_tokens") is not None:
        params["min_tokens"] = sampling_params["min_new_tokens"]
    if sampling_params.get("repetition_penalty") is not None:
        params["repetition_penalty"] = sampling_params["repetition_penalty"]
    for flag in ("skip_special_tokens", "spaces_between_special_tokens"):
        if sampling_params.get(flag) is not None:
            params[flag] = bool(sampling_params[flag])
    return params


def response_budget(max_new_tokens: int | None, context_limit: int | None, prompt_length: int) -> int | None:
    """The total response-side token budget of a sample (generated + masked EOS + observations), or None."""
    if context_limit is None:
        return max_new_tokens
    context_budget = max(0, context_limit - prompt_length)
    return context_budget if max_new_tokens is None else min(max_new_tokens, context_budget)
