"""Recording one rollout: a transport and an environment wrapper that keep every exchange, and hooks that submit
the sample's record to a :class:`~fsm_rollout.recording.writer.TapeWriter` when it reaches a terminal state.

The recorder plugs into the rollout's seams only: the engine client's transport, the environment factory and the
rollout's hooks. :func:`recorded_rollout` builds a rollout wired that way.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

from fsm_rollout.config import DEFAULT_ENV_MODULE, RolloutConfig
from fsm_rollout.engine.client import VLLMClient
from fsm_rollout.engine.token_stream import StreamAssembly, StreamRefused
from fsm_rollout.engine.transport import Transport
from fsm_rollout.envs.protocol import EnvFactory, load_env_factory
from fsm_rollout.envs.step import StepResult, Turn, as_step_result
from fsm_rollout.errors import EnvironmentContractError, RolloutError
from fsm_rollout.hooks import RolloutHooks, RolloutView, combine_hooks
from fsm_rollout.machine import lifecycle
from fsm_rollout.multimodal import processor_merge_size
from fsm_rollout.recording.format import (
    ENGINE_OPS,
    ENV_METHODS,
    TAPE_SCHEMA_VERSION,
    answer_token_ids,
    compact_json,
    config_to_json,
    describe_error,
    jsonable,
    run_lengths,
    token_delta,
)
from fsm_rollout.recording.writer import TapeWriter, tape_writer_for
from fsm_rollout.rollout import Rollout
from fsm_rollout.rollout.unbuilt import UnbuiltRollout

if TYPE_CHECKING:
    from fsm_rollout.sample import Sample


class SampleRecorder(RolloutHooks):
    """Records one rollout's engine and environment exchanges and, at its terminal transition, submits the record.

    Wire it in with :meth:`client` (the engine client to use), :meth:`env_factory` and as the rollout's hooks, then
    call :meth:`begin` once the rollout is built; :func:`recorded_rollout` does all of that.
    """

    wants_events = True
    records_io = True

    def __init__(self, writer: TapeWriter, *, config: RolloutConfig, sampling_params: Mapping[str, Any]) -> None:
        if writer.closed:
            raise RolloutError(f"the tape {writer.path} is closed")
        self._writer = writer
        self._config_object = config
        self._config = config_to_json(config)
        self._sampling_params = jsonable(dict(sampling_params))
        self._started = time.time()
        self._sample: Any = None
        self._tokenizer: dict[str, Any] = {}
        self._merge_size: int | None = None
        self._io: list[dict[str, Any]] = []
        self._transitions: list[dict[str, Any]] = []
        self._base_tokens: list[int] = []
        self._finished = False

    # ------------------------------------------------------------------ wiring

    def client(self, client: VLLMClient) -> VLLMClient:
        """A client that sends through ``client``'s transport and records each exchange."""
        return VLLMClient(transport=RecordingTransport(client.transport, self))

    def env_factory(self, factory: EnvFactory | None) -> EnvFactory:
        """A ``build_env`` that builds through ``factory`` (or the configured module) and records the environment."""
        config = self._config_object

        def build_env(**kwargs: Any) -> Any:
            entry = self._entry("env_build")
            sample = kwargs.get("sample")
            tools_before = _sample_tools(sample)
            prompt_before = getattr(sample, "prompt", None)
            try:
                inner = factory or load_env_factory(config.env_path or DEFAULT_ENV_MODULE)
                env = inner(**kwargs)
            except Exception as error:
                entry["error"] = describe_error(error)
                raise
            if inspect.isawaitable(env):  # an async build_env: recorded once it built the environment
                return self._built_later(entry, env, sample, tools_before, prompt_before)
            return self._built(entry, env, sample, tools_before, prompt_before)

        return build_env

    async def _built_later(
        self, entry: dict[str, Any], awaitable: Any, sample: Any, tools_before: Any, prompt_before: Any
    ) -> Any:
        try:
            env = await awaitable
        except Exception as error:
            entry["error"] = describe_error(error)
            raise
        return self._built(entry, env, sample, tools_before, prompt_before)

    def _built(self, entry: dict[str, Any], env: Any, sample: Any, tools_before: Any, prompt_before: Any) -> Any:
        tools = _sample_tools(sample)
        if tools != tools_before:  # the environment gave the sample its tools: replay gives them the same way
            entry["sample_tools"] = jsonable(tools)
        prompt = getattr(sample, "prompt", None)
        if prompt is not prompt_before:  # an adapted environment's first observation is the prompt: same on replay
            entry["sample_prompt"] = jsonable(prompt)
        entry["type"] = type(env).__name__
        missing = [name for name in ENV_METHODS if not callable(getattr(env, name, None))]
        if missing:  # the rollout rejects it; calls on it are not recorded
            entry["missing"] = missing
            return env
        return RecordingEnv(env, self)

    def begin(self, rollout: Rollout | UnbuiltRollout) -> None:
        """Snapshot what the record needs from the rollout as built (before it runs)."""
        self._started = time.time()
        self._sample = jsonable(rollout.sample.to_dict(), images_as_urls=True)
        self._tokenizer = self._writer.tokenizer_info(rollout.tokenizer)
        self._merge_size = processor_merge_size(rollout.processor)

    # ------------------------------------------------------------------ recording

    def _entry(self, op: str, **fields: Any) -> dict[str, Any]:
        entry = {"op": op, **fields}
        self._io.append(entry)
        return entry

    def begin_engine(self, path: str, payload: Mapping[str, Any], headers: Mapping[str, str] | None) -> dict[str, Any]:
        """Record a request as it is sent (the outcome is filled in by the transport)."""
        op = ENGINE_OPS.get(path, "post")
        entry = self._entry(op, headers=dict(headers) if headers else None)
        if op == "post":
            entry["path"] = path
        if op == "generate" and isinstance(payload.get("token_ids"), list):
            tokens = payload["token_ids"]
            entry["request"] = {key: value for key, value in payload.items() if key != "token_ids"}
            entry["tokens"] = token_delta(tokens, self._base_tokens)
            self._base_tokens = list(tokens)  # the list keeps growing: keep a copy
        else:
            entry["request"] = dict(payload)
        return entry

    def end_engine(self, entry: dict[str, Any]) -> None:
        """The request ended (answered, failed or cancelled)."""
        if entry["op"] == "render":
            token_ids = answer_token_ids(entry.get("answer"))
            if token_ids is not None:
                self._base_tokens = list(token_ids)

    def env_call(self, op: str, **fields: Any) -> dict[str, Any]:
        """Record an environment call as it starts."""
        return self._entry(op, **fields)

    # ------------------------------------------------------------------ hooks

    def abort_requested(self, rollout: RolloutView, reason: str, *, running: bool, in_flight: bool) -> None:
        self._entry("abort_requested", reason=reason, state=rollout.state, running=running, in_flight=in_flight)

    def transition(
        self, rollout: RolloutView, trigger: str, src: str, dwell_ms: float, fields: Mapping[str, Any] | None
    ) -> None:
        """Keep the transition's traced fields; submit the record when the rollout reached a terminal state."""
        if fields is None:
            return
        kept = dict(fields)
        kept.pop("dwell_ms", None)
        self._transitions.append(kept)
        if rollout.state in lifecycle.TERMINAL and not self._finished:
            self._finished = True
            self._writer.submit(self._record(rollout))
            self._io = []
            self._transitions = []

    def _record(self, rollout: RolloutView) -> dict[str, Any]:
        sample = rollout.sample
        return {
            "kind": "sample",
            "schema": TAPE_SCHEMA_VERSION,
            "run": self._writer.run_id,
            "sample_id": rollout.sample_id,
            "session_id": sample.session_id,
            "rollout_uid": rollout.rollout_uid,
            "request_prefix": rollout.request_prefix,
            "started": self._started,
            "ended": time.time(),
            "tokenizer": self._tokenizer,
            "processor_merge_size": self._merge_size,
            "config": self._config,
            "sampling_params": self._sampling_params,
            "sample": self._sample,
            "io": self._io,
            "transitions": self._transitions,
            "result": {
                "status": str(getattr(sample.status, "value", sample.status)),
                "reason": rollout.reason,
                "prompt_length": rollout.prompt_length,
                "response_length": sample.response_length,
                "tokens": token_delta(list(sample.tokens), self._base_tokens),
                "loss_mask": run_lengths(sample.loss_mask),
                "rollout_log_probs": None if sample.rollout_log_probs is None else list(sample.rollout_log_probs),
                "error": jsonable(sample.metadata.get("rollout_error")),
                "reward": jsonable(sample.reward),  # what inspect shows; replay does not compare it
                **_branches(sample),
            },
        }


def _branches(sample: Sample) -> dict[str, Any]:
    """A forked rollout's earlier sequences for the result (absent without forks, as on tapes from before)."""
    if not sample.branches:
        return {}
    return {
        "branches": [
            {
                "tokens": list(branch.tokens),
                "prompt_length": len(branch.tokens) - branch.response_length,
                "loss_mask": run_lengths(branch.loss_mask),
                "response": branch.response,
            }
            for branch in sample.branches
        ]
    }


class RecordingTransport:
    """A transport that sends through another one and records every exchange with its recorder.

    The client parses the answers exactly as without recording; the tape keeps the raw JSON.
    """

    def __init__(self, inner: Transport, recorder: SampleRecorder) -> None:
        self._inner = inner
        self._recorder = recorder

    @property
    def base_url(self) -> str:
        return self._inner.base_url

    async def close(self) -> None:
        """Nothing to release: the inner transport is shared and closed by its owner."""

    async def post_json(
        self, path: str, payload: Mapping[str, Any], *, headers: Mapping[str, str] | None = None
    ) -> Any:
        entry = self._recorder.begin_engine(path, payload, headers)
        try:
            answer = await self._inner.post_json(path, payload, headers=headers)
        except asyncio.CancelledError:
            entry["cancelled"] = True
            raise
        except Exception as error:
            entry["error"] = describe_error(error)
            raise
        else:
            if isinstance(answer, str):
                entry["text"] = answer
            else:
                entry["answer"] = compact_json(answer) if entry["op"] == "generate" else answer
        finally:
            self._recorder.end_engine(entry)
        return answer

    @property
    def streams(self) -> bool:
        """Whether the inner transport can stream a generate request."""
        return bool(getattr(self._inner, "streams", False))

    async def post_sse(
        self, path: str, payload: Mapping[str, Any], *, headers: Mapping[str, str] | None = None
    ) -> AsyncIterator[Any]:
        """A streamed exchange, recorded as the whole exchange it amounts to (the request without its stream
        fields, the answer its chunks add up to), so a replay, which never streams, sends and reads the same."""
        recorded = {key: value for key, value in payload.items() if key not in ("stream", "stream_options")}
        entry = self._recorder.begin_engine(path, recorded, headers)
        assembly = StreamAssembly(None)
        try:
            inner = self._inner.post_sse(path, payload, headers=headers)  # type: ignore[attr-defined]
            async with contextlib.aclosing(inner):
                async for data in inner:
                    assembly.feed(data)
                    yield data
                    if assembly.done:
                        break
        except StreamRefused as refused:  # answered whole (a server that cannot stream): that is the exchange
            entry["answer"] = compact_json(refused.answer) if entry["op"] == "generate" else refused.answer
            raise
        except (asyncio.CancelledError, GeneratorExit):  # the reader stopped: after [DONE], the exchange is whole
            if not assembly.done:
                entry["cancelled"] = True
            raise
        except Exception as error:
            entry["error"] = describe_error(error)
            raise
        finally:
            if assembly.done and "error" not in entry:
                answer = assembly.answer()
                entry["answer"] = compact_json(answer) if entry["op"] == "generate" else answer
            self._recorder.end_engine(entry)


class RecordingEnv:
    """Wraps one environment: calls go through unchanged and are recorded (results as JSON, errors described).

    A method that returns an awaitable (an async environment) is recorded when the awaitable completes.
    """

    def __init__(self, env: Any, recorder: SampleRecorder) -> None:
        self._env = env
        self._recorder = recorder

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)

    def _call(self, entry: dict[str, Any], call: Any, keep: Any = None) -> Any:
        try:
            result = call()
        except Exception as error:
            entry["error"] = describe_error(error)
            raise
        if inspect.isawaitable(result):
            return self._awaited(entry, result, keep)
        return self._kept(entry, result, keep)

    async def _awaited(self, entry: dict[str, Any], awaitable: Any, keep: Any) -> Any:
        try:
            result = await awaitable
        except Exception as error:
            entry["error"] = describe_error(error)
            raise
        return self._kept(entry, result, keep)

    @staticmethod
    def _kept(entry: dict[str, Any], result: Any, keep: Any) -> Any:
        if keep is not None:
            try:
                keep(entry, result)
            except Exception as error:  # bool(done) raising fails the rollout the same way unpacking it would
                entry.pop("result", None)
                entry["error"] = describe_error(error)
                raise
        return result

    def reset(self) -> Any:
        return self._call(self._recorder.env_call("reset"), self._env.reset, _keep_reset_result)

    def step(self, given: Any) -> Any:
        text = given.text if isinstance(given, Turn) else given  # an environment that accepts turns gets the Turn
        return self._call(self._recorder.env_call("step", text=text), lambda: self._env.step(given), _keep_step_result)

    def format_observation(self, observation: Any) -> Any:
        return self._call(
            self._recorder.env_call("format_observation"),
            lambda: self._env.format_observation(observation),
            _keep_message,
        )

    def close(self) -> Any:
        return self._call(self._recorder.env_call("close"), self._env.close)


def _sample_tools(sample: Any) -> Any:
    metadata = getattr(sample, "metadata", None)
    return metadata.get("tools") if isinstance(metadata, dict) else None


def _keep_reset_result(entry: dict[str, Any], result: Any) -> None:
    if isinstance(result, StepResult):  # an environment driven from outside: what the first request carries
        entry["result"] = {"step": result.to_json(jsonable)}


def _keep_step_result(entry: dict[str, Any], result: Any) -> None:
    """The step as the rollout reads it (:func:`~fsm_rollout.envs.step.as_step_result`), or what was wrong with it."""
    try:
        step = as_step_result(result)
    except EnvironmentContractError as error:  # the replay raises it again
        if isinstance(result, tuple) and len(result) != 3:
            entry["result"] = {"tuple_len": len(result)}
        elif not isinstance(result, tuple):
            entry["result"] = {"type": type(result).__name__}
        else:
            entry["result"] = {"contract_error": str(error)}
        return
    entry["result"] = {"step": step.to_json(jsonable)}


def _keep_message(entry: dict[str, Any], message: Any) -> None:
    # PIL images as the PNG data URLs the rollout sends for them: long, so stored once as blobs by content hash
    entry["message"] = jsonable(message, images_as_urls=True, fast_png=True)


def recorded_rollout(
    sample: Sample,
    *,
    config: RolloutConfig,
    sampling_params: Mapping[str, Any],
    client: VLLMClient,
    tape: TapeWriter | None = None,
    env_factory: EnvFactory | None = None,
    hooks: RolloutHooks | None = None,
    **rollout_options: Any,
) -> Rollout:
    """A :class:`~fsm_rollout.rollout.Rollout` whose engine and environment I/O is recorded on ``tape`` (default:
    the tape beside ``config.trace``, which then needs ``config.record``).

    ``rollout_options`` are the rollout's other arguments (``tokenizer``, ``processor``, ``tracer``, ``sample_id``,
    ...); ``hooks`` run after the recorder's.
    """
    writer = tape if tape is not None else tape_writer_for(config)
    if writer is None:
        raise RolloutError("recorded_rollout needs a tape: pass tape= or set config.record with a trace file")
    recorder = SampleRecorder(writer, config=config, sampling_params=sampling_params)
    rollout = Rollout(
        sample,
        config=config,
        sampling_params=sampling_params,
        client=recorder.client(client),
        env_factory=recorder.env_factory(env_factory),
        hooks=combine_hooks(recorder, hooks),
        **rollout_options,
    )
    recorder.begin(rollout)
    return rollout


__all__ = ["RecordingEnv", "RecordingTransport", "SampleRecorder", "recorded_rollout"]
