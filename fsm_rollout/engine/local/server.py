"""The embedded engine's HTTP server: vLLM's token-in/token-out endpoints on aiohttp, backed by a CPU model.

Endpoints, with vLLM's request and response shapes (``vllm serve --enable-scale-out``):

* ``POST /v1/chat/completions/render``: chat messages → a GenerateRequest-shaped body; image parts (``data:``
  URLs) are expanded into ``<|image_pad|>`` runs with Qwen2-VL ``features``, see
  :mod:`fsm_rollout.engine.local.images`;
* ``POST /inference/v1/generate``: prompt token ids (and the ``features`` render returned, checked against them)
  → generated token ids with processed logprobs (with ``"stream": true``, vLLM's SSE chunks as tokens are sampled);
* ``POST /inference/v1/abort_requests``: ``{"request_ids": [...]}`` ends those generations with
  ``finish_reason="abort"``;
* ``GET /health`` and ``GET /v1/models`` (whose model card also names the tokenizer directory and the image
  merge size, so that a client needs neither flag);
* vLLM's weight-update endpoints (which vLLM serves with ``VLLM_SERVER_DEV_MODE=1``):
  ``POST /pause?mode=abort|wait|keep`` → ``{"status": "paused"}`` (``abort`` when no mode is given),
  ``POST /resume`` → ``{"status": "resumed"}``, ``GET /is_paused`` → ``{"is_paused": bool}``,
  ``POST /update_weight_version {"new_version": str}`` → ``{"success": true, "new_version": str}``,
  ``GET /weight_info`` → ``{"weight_version": str}``, and
  ``POST /update_weights {"update_info": {"path": <local .safetensors file>, "weight_version": str | null}}`` →
  ``{"message": "Weights updated"}``. See :class:`LocalEngine` for what each pause mode does.

Every generate answer labels its output tokens with the weight version current when each was sampled
(``choices[0].weight_versions``: consecutive spans, ``"default"`` until a version is set).

Invalid requests get vLLM's error body ``{"error": {"message", "type", "param", "code"}}`` (400, or 404 for another
model name). With an API key, every request but ``GET /health`` needs ``Authorization: Bearer <key>`` and is
otherwise answered 401 ``{"error": "Unauthorized"}``, as vLLM's ``--api-key`` check answers. Model work runs on the
scheduler's worker thread, rendering and feature checks on the front-end thread
(:mod:`fsm_rollout.engine.local.frontend`); neither runs on the event loop.

Why this module is long: :class:`LocalEngine` is one class with two faces over the same state, the HTTP endpoints
and their in-process equivalents (pause, resume, weight loading); its long docstring is the engine's reference.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import pathlib
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final

from aiohttp import web

from fsm_rollout.engine.endpoints import json_response, serve_backend
from fsm_rollout.engine.load import EngineLoad, register_local, unregister_local
from fsm_rollout.engine.local.errors import LocalEngineError, WeightLoadError
from fsm_rollout.engine.local.frontend import Frontend
from fsm_rollout.engine.local.images import IMAGE_MERGE_SIZE, IMAGE_PAD_TOKEN
from fsm_rollout.engine.local.protocol import RenderInput, check_generate, parse_update_weights, render_input
from fsm_rollout.engine.local.scheduler import GenerateJob, GenerationOutcome, Scheduler
from fsm_rollout.engine.local.streaming import TokenFeed, serve_stream
from fsm_rollout.engine.schema import (
    HEALTH_PATH,
    PAUSE_MODES,
    LogprobEntry,
    ModelList,
    PauseMode,
    RequestError,
    TopLogprob,
    sent_request_id,
)
from fsm_rollout.engine.serving import GenerateOutcome, GenerateRequest, RenderRequest, models_answer
from fsm_rollout.engine.token_stream import stream_flags

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch

    from fsm_rollout.engine.local.images import ImageSupport
    from fsm_rollout.engine.local.model import LoadedModel, TokenLogprob

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "LocalEngine"]


DEFAULT_MAX_REQUEST_BYTES: Final = 256 * 1024 * 1024
"""Request bodies above this size are refused with 413. Generate bodies carry the image tensors render returned:
one image at the processor's largest size (28*28*1280 pixels) is about 32 MB of base64 float32 patches."""

_log = logging.getLogger(__name__)


class LocalEngine:
    """A vLLM-compatible token-in/token-out server with a real model on the CPU, on loopback by default.

    Use as an async context manager (or :meth:`start` / :meth:`stop`)::

        async with LocalEngine() as engine:          # the default tiny Qwen2 model
            client = VLLMClient(engine.url)

    ``model_dir=None`` serves the default model from :func:`~fsm_rollout.engine.local.default_model.default_model_dir`:
    the tiny Qwen2 briefly trained to follow the Geo3K task's format (built and trained on first use, then cached);
    ``model_dir=tiny_model_dir()`` serves the tiny random Qwen2 it starts from; otherwise any local Hugging Face
    causal-LM directory with a tokenizer (and a chat template for render). ``served_model_name`` defaults to
    ``tiny-qwen2-geo3k`` or to ``model_dir`` as given, as vLLM names a model after its ``--model`` argument.
    ``log`` receives a line when the default model is being built (the CLI prints it).
    ``max_model_len`` defaults to the config's context length.
    ``port=0`` picks a free port. See :mod:`fsm_rollout.engine.local.scheduler` for ``max_num_seqs`` and ``batched``
    (False: the slower one-request-at-a-time decoding, for comparison). ``api_key``
    (None: no check) is the key every request but ``GET /health`` must send as ``Authorization: Bearer <key>``.

    ``torch_threads`` is applied with ``torch.set_num_threads`` on the worker thread, which changes torch's
    process-wide default (threads that already ran torch ops keep theirs); None leaves torch's setting alone. The
    default, 1, was measured fastest on a 2-core machine: the tiny model's operations are too small to split, and
    with two OpenMP threads a second busy process (or the event loop) slows decoding five- to tenfold.

    Images: render treats ``image_url`` parts with ``data:`` URLs as vLLM does for a Qwen2-VL model. Each image is
    preprocessed by transformers' ``Qwen2VLImageProcessorPil`` (patch size 14, merge size 2, temporal patch size
    2, default min/max pixels; the numpy/PIL backend, because the default torchvision backend cannot be installed
    beside this CPU torch), the template's ``<|image_pad|>`` of image ``i`` becomes ``t*h*w / 4`` pad tokens, and
    the answer carries ``features`` (``mm_hashes``, ``mm_placeholders``, ``kwargs_data`` with ``pixel_values`` and
    ``image_grid_thw`` in vLLM's wire format, ``mm_metadata``). Generate checks ``features`` against
    ``token_ids`` (vLLM's structural rules, every range inside the prompt and made of pad tokens, grids matching
    range lengths) and then generates with the **text** model only: the default tiny model is a text-only Qwen2
    (a real tiny Qwen2-VL needs torchvision, which is unavailable here), so the model sees the ``<|image_pad|>``
    tokens as ordinary tokens and never looks at the pixels. Images change the prompt's tokens, not what the model
    perceives. ``http(s)`` image URLs are refused with 400 (no fetching), as are ``file://`` URLs and local paths
    (vLLM reads those only with ``--allowed-local-media-path``). See :mod:`fsm_rollout.engine.local.images`.

    Weight updates, in process (a trainer in the same process needs no HTTP) and over vLLM's endpoints:
    :meth:`pause` / :meth:`resume`, :meth:`update_weight_version` and :meth:`load_weights`. A pause acts between two
    decode steps. ``abort`` answers every request in flight (queued or running) at once with
    ``finish_reason="abort"`` and its tokens and logprobs so far; ``wait`` returns once the requests in flight have
    finished normally; ``keep`` freezes them (no decode step runs) until :meth:`resume`, when they carry on with
    their KV caches, nothing recomputed. In every mode, generate requests arriving while paused are accepted and
    wait until resume; render keeps working. Pausing again applies the new mode to what is in flight then
    (``abort`` after ``keep`` ends the frozen requests); resuming when not paused does nothing. New weights apply
    to the tokens sampled after the load; a request's KV cache computed with the old weights is kept, as vLLM keeps
    it across a ``keep`` pause.
    """

    def __init__(
        self,
        model_dir: str | pathlib.Path | None = None,
        *,
        served_model_name: str | None = None,
        max_model_len: int | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        max_num_seqs: int = 16,
        torch_threads: int | None = 1,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        api_key: str | None = None,
        log: Callable[[str], None] | None = None,
        batched: bool = True,
    ) -> None:
        if max_model_len is not None and max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if torch_threads is not None and torch_threads < 1:
            raise ValueError(f"torch_threads must be >= 1, got {torch_threads}")
        self._model_dir_arg = None if model_dir is None else pathlib.Path(model_dir)
        self._served_name_arg = served_model_name
        if served_model_name is None and model_dir is not None:
            self._served_name_arg = str(model_dir)
        self._max_model_len_arg = max_model_len
        self.host = host
        self.port = port
        self._max_num_seqs = max_num_seqs
        self._torch_threads = torch_threads
        self._batched = batched
        self._max_request_bytes = max_request_bytes
        self._authorization = None if not api_key else f"Bearer {api_key}".encode()
        self._log = log
        self._loaded: LoadedModel | None = None
        self._stopped_model: tuple[pathlib.Path, int] | None = None  # what a stopped engine still tells of its model
        self._images: ImageSupport | None = None
        self._scheduler: Scheduler | None = None
        self._frontend: Frontend | None = None
        self._runner: web.AppRunner | None = None
        self._url: str | None = None
        self._model_name: str | None = None
        self._jobs: dict[str, set[GenerateJob]] = {}

    # ---------------------------------------------------------------- lifecycle

    @property
    def url(self) -> str:
        """The base URL (``http://host:port``); only while the engine runs."""
        if self._url is None:
            raise LocalEngineError("the embedded engine is not started")
        return self._url

    @property
    def served_model_name(self) -> str:
        """The served model name (what ``model`` in a request must say, when it says anything)."""
        if self._model_name is None:
            raise LocalEngineError("the embedded engine is not started")
        return self._model_name

    @property
    def max_model_len(self) -> int:
        """The context length (prompt + output tokens) the engine accepts."""
        if self._loaded is None and self._stopped_model is not None:
            return self._stopped_model[1]
        return self._require_loaded().max_model_len

    @property
    def model_dir(self) -> pathlib.Path:
        """The directory the model was loaded from."""
        if self._loaded is None and self._stopped_model is not None:
            return self._stopped_model[0]
        return self._require_loaded().model_dir

    @property
    def image_merge_size(self) -> int:
        """The image processor's merge size (2): an image of grid ``(t, h, w)`` takes ``t*h*w / merge_size**2``
        placeholder tokens. Pass it as ``RolloutConfig(image_merge_size=...)`` so the client's image-token check
        needs no processor. Known before the engine starts."""
        return IMAGE_MERGE_SIZE

    @property
    def requires_api_key(self) -> bool:
        """Whether requests (but ``GET /health``) must carry the API key."""
        return self._authorization is not None

    @property
    def image_placeholder_token(self) -> str:
        """The image placeholder token render expands (``<|image_pad|>``, ``RolloutConfig``'s default)."""
        return IMAGE_PAD_TOKEN

    def live_request_ids(self) -> list[str]:
        """Generate requests queued or running on the worker, in arrival order (empty when idle)."""
        return [] if self._scheduler is None else self._scheduler.live_request_ids()

    def load(self) -> EngineLoad:
        """What ``GET /metrics`` publishes: running and waiting requests, and the tokens the running ones hold
        against the KV budget of a full batch (``max_num_seqs`` sequences of ``max_model_len``); no preemptions."""
        if self._scheduler is None or self._loaded is None:
            return EngineLoad(running=0, waiting=0, kv_cache_usage=0.0, preemptions=0)
        running, waiting, tokens = self._scheduler.load()
        usage = min(1.0, tokens / (self._max_num_seqs * self._loaded.max_model_len))
        return EngineLoad(running=running, waiting=waiting, kv_cache_usage=usage, preemptions=0)

    def live_token_counts(self) -> dict[str, int]:
        """The output tokens sampled so far by each generate request queued (0), running or frozen, by request id
        in arrival order (of requests sent with the same id, the earliest's)."""
        return {} if self._scheduler is None else self._scheduler.live_token_counts()

    # ---------------------------------------------------------------- weight updates

    @property
    def is_paused(self) -> bool:
        """Whether generation is paused (:meth:`pause` took effect and :meth:`resume` has not)."""
        return self._running_scheduler().paused

    @property
    def weight_version(self) -> str:
        """The weight version the tokens sampled now are labelled with (``"default"`` until one is set)."""
        return self._running_scheduler().weight_version

    async def pause(self, mode: PauseMode = "abort") -> None:
        """Pause generation between two decode steps (``POST /pause?mode=...``); see the class docstring for the
        modes. Returns once the pause is in effect: for ``wait``, once the requests in flight have finished (or
        :meth:`resume` was called meanwhile)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        await self._running_scheduler().pause(mode)

    async def resume(self) -> None:
        """Resume generation after :meth:`pause` (``POST /resume``); does nothing when not paused."""
        await self._running_scheduler().resume()

    async def update_weight_version(self, version: str) -> None:
        """Label the tokens sampled from the next decode step on with ``version`` (``POST
        /update_weight_version``)."""
        if not isinstance(version, str):
            raise TypeError(f"a weight version is a string, got {version!r}")
        await self._running_scheduler().set_weight_version(version)

    async def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: str | None = None) -> None:
        """Copy new parameter values into the model between two decode steps, then (when given) set the weight
        version in the same step, so no token is sampled with the new weights under the old version.

        ``state_dict`` maps parameter names (any subset of the model's ``state_dict()``) to tensors of the same
        shapes; they are copied (converted to the model's dtype), so the caller may go on changing its own.

        Raises:
            WeightLoadError: Naming the unknown parameters and the shape mismatches; nothing is loaded then.
        """
        if version is not None and not isinstance(version, str):
            raise TypeError(f"a weight version is a string or None, got {version!r}")
        tensors = dict(state_dict)  # the caller's mapping may change while the load waits for the worker
        await self._running_scheduler().load_weights(lambda: tensors, version)

    async def start(self) -> None:
        """Build the default model if needed, load the model, start the worker, then bind the port."""
        if self._runner is not None:
            raise LocalEngineError("the embedded engine is already started")
        model_dir, served_name = await asyncio.to_thread(self._resolve_model_dir)
        loaded = await asyncio.to_thread(_load, model_dir, self._max_model_len_arg)
        from fsm_rollout.engine.local.images import ImageSupport

        images = ImageSupport(loaded.tokenizer)
        scheduler = Scheduler(
            loaded, max_num_seqs=self._max_num_seqs, torch_threads=self._torch_threads, batched=self._batched
        )
        scheduler.start()
        frontend = Frontend()
        try:
            runner, url = await serve_backend(
                _EngineBackend(self),
                host=self.host,
                port=self.port,
                client_max_size=self._max_request_bytes,
                middlewares=[self._check_api_key],
                shutdown_timeout=2.0,
                unavailable=(LocalEngineError,),
                load=self.load,
            )
        except BaseException:
            await asyncio.to_thread(scheduler.stop)
            await asyncio.to_thread(frontend.stop)
            raise
        self._loaded = loaded
        self._images = images
        self._scheduler = scheduler
        self._frontend = frontend
        self._runner = runner
        self._model_name = served_name
        self._url = url
        register_local(url, self.load)  # a runner in this process reads the load without an HTTP poll

    async def stop(self) -> None:
        """Answer every queued and running generation with "abort", close the server and end the worker."""
        scheduler, self._scheduler = self._scheduler, None
        if scheduler is not None:
            await asyncio.to_thread(scheduler.stop)
        frontend, self._frontend = self._frontend, None
        if frontend is not None:
            await asyncio.to_thread(frontend.stop)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._url is not None:
            unregister_local(self._url)
        self._url = None
        # The model goes with the engine's stop, not with the engine object: aiohttp keeps the middleware chains of
        # apps it served in a module-level cache, which holds this object long after its user let go of it.
        loaded, self._loaded, self._images = self._loaded, None, None
        if loaded is not None:
            self._stopped_model = (loaded.model_dir, loaded.max_model_len)

    async def __aenter__(self) -> LocalEngine:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    def _resolve_model_dir(self) -> tuple[pathlib.Path, str]:
        if self._model_dir_arg is not None:
            return self._model_dir_arg.expanduser(), self._served_name_arg or str(self._model_dir_arg)
        from fsm_rollout.engine.local.default_model import DEFAULT_MODEL_NAME, default_model_dir

        return default_model_dir(log=self._log), self._served_name_arg or DEFAULT_MODEL_NAME

    def _require_loaded(self) -> LoadedModel:
        if self._loaded is None:
            raise LocalEngineError("the embedded engine is not started")
        return self._loaded

    def _require_images(self) -> ImageSupport:
        if self._images is None:
            raise LocalEngineError("the embedded engine is not started")
        return self._images

    def _require_scheduler(self) -> Scheduler:
        if self._scheduler is None:
            raise RequestError(503, "The embedded engine is shutting down")
        return self._scheduler

    def _require_frontend(self) -> Frontend:
        if self._frontend is None:
            raise RequestError(503, "The embedded engine is shutting down")
        return self._frontend

    def _running_scheduler(self) -> Scheduler:
        if self._scheduler is None:
            raise LocalEngineError("the embedded engine is not started")
        return self._scheduler

    # ---------------------------------------------------------------- middleware

    @web.middleware
    async def _check_api_key(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if self._authorization is None or request.path == HEALTH_PATH:  # health stays open, as in vLLM
            return await handler(request)
        sent = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(sent, self._authorization):  # constant time: the key is not guessable by timing
            return json_response({"error": "Unauthorized"}, status=401)  # vLLM's body for a missing or wrong key
        return await handler(request)


class _EngineBackend:
    """The embedded engine as the serving frame's backend: render with the chat template on the front end, generate
    with the scheduler (see :mod:`fsm_rollout.engine.endpoints`)."""

    def __init__(self, engine: LocalEngine) -> None:
        self._engine = engine

    @property
    def served_model_name(self) -> str:
        return self._engine.served_model_name

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._engine._require_loaded().vocab_size

    def models(self) -> ModelList:
        engine = self._engine
        loaded = engine._require_loaded()
        return models_answer(
            engine.served_model_name,
            root=str(loaded.model_dir),
            max_model_len=loaded.max_model_len,
            # load_model reads the tokenizer from the model directory; absolute: the client's cwd may differ
            tokenizer=str(loaded.model_dir.resolve()),
            image_merge_size=engine.image_merge_size,
        )

    async def render(self, request: RenderRequest) -> tuple[list[int], Any]:
        engine = self._engine
        render = render_input(request)
        loaded = engine._require_loaded()
        images = engine._require_images()
        return await engine._require_frontend().run(lambda: _render_prompt(loaded.tokenizer, images, render))

    async def generate(self, request: GenerateRequest, http: web.Request) -> GenerateOutcome | web.StreamResponse:
        engine = self._engine
        features = check_generate(request)
        scheduler = engine._require_scheduler()
        if features is not None:  # off the event loop: kwargs items can be megabytes of base64
            images = engine._require_images()
            await engine._require_frontend().run(lambda: images.check_features(features, request.token_ids))
        stream, include_usage = stream_flags(request.body)
        feed = TokenFeed() if stream else None
        job = GenerateJob(
            request.request_id,
            request.token_ids,
            request.settings,
            asyncio.get_running_loop(),
            on_token=None if feed is None else feed.push,
        )
        jobs = engine._jobs
        jobs.setdefault(job.request_id, set()).add(job)
        try:
            scheduler.submit(job)
            if feed is not None:
                count = request.settings.logprobs
                return await serve_stream(
                    http,
                    job,
                    feed,
                    prompt_len=request.prompt_len,
                    include_usage=include_usage,
                    entry=None if count is None else (lambda logprob: _logprob_entry(logprob, count)),
                )
            outcome = await job.future
        except asyncio.CancelledError:
            job.cancel()  # the client went away: stop generating for nobody
            raise
        finally:
            named = jobs.get(job.request_id)
            if named is not None:
                named.discard(job)
                if not named:
                    del jobs[job.request_id]
        return _outcome(outcome, request.settings.logprobs)

    async def abort(self, request_ids: list[str]) -> None:
        jobs = self._engine._jobs
        for request_id in request_ids:
            for name in {request_id, sent_request_id(request_id)}:
                for job in jobs.get(name, ()):
                    job.cancel()

    async def pause(self, mode: PauseMode) -> None:
        await self._engine.pause(mode)

    async def resume(self) -> None:
        await self._engine.resume()

    def is_paused(self) -> bool:
        return self._engine.is_paused

    async def update_weight_version(self, version: str) -> None:
        await self._engine.update_weight_version(version)

    def weight_version(self) -> str:
        return self._engine.weight_version

    async def update_weights(self, body: dict[str, Any]) -> None:
        update = parse_update_weights(body["update_info"])
        try:
            # Read on the worker too: a checkpoint file is too big to read on the event loop.
            await self._engine._running_scheduler().load_weights(
                lambda: _read_weights(update.path), update.weight_version
            )
        except WeightLoadError as error:
            raise RequestError(400, str(error), "update_info") from error


def _outcome(outcome: GenerationOutcome, logprobs: int | None) -> GenerateOutcome:
    return GenerateOutcome(
        token_ids=outcome.token_ids,
        finish=outcome.finish_reason,
        logprobs=None if logprobs is None else [_logprob_entry(entry, logprobs) for entry in outcome.logprobs],
        weight_versions=outcome.weight_versions,
        stop_reason=outcome.stop_reason,
    )


def _load(model_dir: pathlib.Path, max_model_len: int | None) -> LoadedModel:
    from fsm_rollout.engine.local.model import load_model

    return load_model(model_dir, max_model_len=max_model_len)


def _read_weights(path: str) -> dict[str, torch.Tensor]:
    from fsm_rollout.engine.local.model import read_safetensors

    return read_safetensors(path)


def _render_prompt(tokenizer: Any, images: ImageSupport, render: RenderInput) -> tuple[list[int], Any]:
    """The prompt's token ids and render ``features`` (None without images); runs on the front-end thread."""
    token_ids = _render_ids(tokenizer, render)
    if not render.image_urls:
        return token_ids, None
    rendered = images.render(token_ids, render.image_urls, with_tensors=render.with_tensors, places=render.image_places)
    return rendered.token_ids, rendered.features


def _render_ids(tokenizer: Any, render: RenderInput) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError(
            400, "The model's tokenizer has no chat template, so chat messages cannot be rendered.", "messages"
        )
    try:
        rendered = tokenizer.apply_chat_template(
            render.messages,
            tools=render.tools,
            add_generation_prompt=render.add_generation_prompt,
            continue_final_message=render.continue_final_message,
            tokenize=True,
            return_dict=False,
            **render.template_kwargs,
        )
    except Exception as error:  # a template that cannot render these messages is the request's fault
        raise RequestError(400, f"chat template rendering failed: {type(error).__name__}: {error}") from error
    if hasattr(rendered, "get") and "input_ids" in rendered:
        rendered = rendered["input_ids"]
    return [int(token) for token in rendered]


def _logprob_entry(entry: TokenLogprob, count: int) -> LogprobEntry:
    # vLLM's order: the sampled token first, then the other top candidates in rank order, max(count, 1) in all.
    top: list[TopLogprob] = [{"token_id": entry.token_id, "logprob": entry.logprob, "rank": entry.rank}]
    top.extend(
        {"token_id": token, "logprob": logprob, "rank": rank}
        for token, logprob, rank in entry.top
        if token != entry.token_id
    )
    return {
        "token_id": entry.token_id,
        "logprob": entry.logprob,
        "rank": entry.rank,
        "top_logprobs": top[: max(count, 1)],
    }
