"""The serving frame (:mod:`fsm_rollout.engine.serving`) on aiohttp, for the servers that run on it: the embedded
engine and the fake test server. A server supplies a :class:`ServingBackend` (how to render, how to produce tokens,
what pausing and weight versions do); parsing, answers and errors are the frame's, so both answer alike.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol

import orjson
from aiohttp import web

from fsm_rollout.engine.load import METRICS_PATH, EngineLoad, format_metrics
from fsm_rollout.engine.schema import (
    ABORT_PATH,
    GENERATE_PATH,
    HEALTH_PATH,
    IS_PAUSED_PATH,
    MODELS_PATH,
    PAUSE_PATH,
    RENDER_PATH,
    RESUME_PATH,
    UPDATE_WEIGHT_VERSION_PATH,
    UPDATE_WEIGHTS_PATH,
    WEIGHT_INFO_PATH,
    ModelList,
    PauseMode,
    RequestError,
    abort_request_ids,
    error_body,
)
from fsm_rollout.engine.serving import (
    PAUSED,
    RESUMED,
    UPDATED_WEIGHTS,
    GenerateOutcome,
    GenerateRequest,
    RenderRequest,
    generate_answer,
    is_paused_answer,
    parse_generate_request,
    parse_render_request,
    pause_query,
    read_json,
    render_answer,
    update_info,
    update_weight_version_answer,
    weight_info_answer,
    weight_version_of,
)
from fsm_rollout.engine.token_stream import stream_flags

__all__ = ["ServingBackend", "error_response", "json_response", "open_event_stream", "send_event", "serve_backend"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_log = logging.getLogger(__name__)


class ServingBackend(Protocol):
    """What a vLLM-speaking server supplies to the frame. Every method may raise
    :class:`~fsm_rollout.engine.schema.RequestError` to answer with vLLM's error body."""

    @property
    def served_model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int | None:
        """Token ids at or above it are refused (None: not checked)."""
        ...

    def models(self) -> ModelList: ...

    async def render(self, request: RenderRequest) -> tuple[list[int], Any]:
        """The prompt's token ids and render ``features`` (None without media)."""
        ...

    async def generate(self, request: GenerateRequest, http: web.Request) -> GenerateOutcome | web.StreamResponse:
        """The outcome of a checked generate request (or a whole answer of the server's own, e.g. a scripted
        fault). ``http`` is the aiohttp request: its cancellation means the client went away."""
        ...

    async def abort(self, request_ids: list[str]) -> None:
        """End the named generate requests (by the id sent or vLLM's ``generate-tokens-`` id) with ``abort``."""
        ...

    async def pause(self, mode: PauseMode) -> None: ...

    async def resume(self) -> None: ...

    def is_paused(self) -> bool: ...

    async def update_weight_version(self, version: str) -> None: ...

    def weight_version(self) -> str: ...

    async def update_weights(self, body: dict[str, Any]) -> None:
        """Load the weights ``body["update_info"]`` names (its shape is the server's weight-transfer backend's; the
        frame checked that it is there)."""
        ...


class _Frame:
    """The aiohttp handlers of every endpoint, over one backend."""

    def __init__(self, backend: ServingBackend) -> None:
        self._backend = backend

    async def health(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.StreamResponse:
        return json_response(self._backend.models())

    async def render(self, request: web.Request) -> web.StreamResponse:
        backend = self._backend
        parsed = parse_render_request(read_json(await request.read()), backend.served_model_name)
        token_ids, features = await backend.render(parsed)
        return json_response(
            render_answer(
                parsed, token_ids, features, model=backend.served_model_name, max_model_len=backend.max_model_len
            )
        )

    async def generate(self, request: web.Request) -> web.StreamResponse:
        backend = self._backend
        parsed = parse_generate_request(
            read_json(await request.read()),
            backend.served_model_name,
            max_model_len=backend.max_model_len,
            vocab_size=backend.vocab_size,
        )
        stream_flags(parsed.body)  # checked for every backend before it starts generating
        outcome = await backend.generate(parsed, request)
        if isinstance(outcome, web.StreamResponse):
            return outcome
        return json_response(
            generate_answer(parsed.request_id, parsed.prompt_len, outcome, model=backend.served_model_name)
        )

    async def abort(self, request: web.Request) -> web.StreamResponse:
        await self._backend.abort(abort_request_ids(read_json(await request.read())))
        return web.Response(status=200)  # vLLM answers an empty 200

    async def pause(self, request: web.Request) -> web.StreamResponse:
        await self._backend.pause(pause_query(request.query))
        return json_response(PAUSED)

    async def resume(self, request: web.Request) -> web.StreamResponse:
        await self._backend.resume()
        return json_response(RESUMED)

    async def is_paused(self, request: web.Request) -> web.StreamResponse:
        return json_response(is_paused_answer(self._backend.is_paused()))

    async def update_weight_version(self, request: web.Request) -> web.StreamResponse:
        version = weight_version_of(read_json(await request.read()))
        await self._backend.update_weight_version(version)
        return json_response(update_weight_version_answer(version))

    async def weight_info(self, request: web.Request) -> web.StreamResponse:
        return json_response(weight_info_answer(self._backend.weight_version()))

    async def update_weights(self, request: web.Request) -> web.StreamResponse:
        body = read_json(await request.read())
        update_info(body)  # required, whatever the backend makes of it
        await self._backend.update_weights(body)
        return json_response(UPDATED_WEIGHTS)


def _errors_as_vllm(unavailable: tuple[type[Exception], ...]) -> Any:
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except RequestError as error:
            return error_response(error.status, error.message, error.param)
        except web.HTTPRequestEntityTooLarge as error:
            return error_response(error.status, f"The request body is too large: {error.text}")
        except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as error:
            return json_response({"detail": error.reason}, status=error.status)  # FastAPI's shape, as vLLM's
        except web.HTTPException:
            raise
        except unavailable as error:
            return error_response(503, str(error))
        except Exception as error:  # a bug or a model failure: vLLM answers 500 with its error body too
            _log.exception("%s %s failed", request.method, request.path)
            return error_response(500, f"{type(error).__name__}: {error}")

    return middleware


async def serve_backend(
    backend: ServingBackend,
    *,
    host: str,
    port: int,
    client_max_size: int,
    middlewares: Iterable[Any] = (),
    shutdown_timeout: float = 5.0,
    unavailable: tuple[type[Exception], ...] = (),
    load: Callable[[], EngineLoad] | None = None,
) -> tuple[web.AppRunner, str]:
    """Serve every endpoint of the frame over ``backend`` on ``host:port`` (0: a free port); returns the runner (to
    clean up) and the base URL.

    ``middlewares`` run outside the frame's error handling (e.g. an API-key check, request recording);
    ``unavailable`` exceptions are answered 503 (a server shutting down), any other exception 500.
    Handler cancellation is on: since aiohttp 3.8.2 a client disconnect no longer cancels its handler unless asked,
    and that cancellation is how a long generation learns its client went away.
    ``load`` (when given) is published on ``GET /metrics`` as vLLM publishes it (:mod:`fsm_rollout.engine.load`).
    """
    frame = _Frame(backend)
    app = web.Application(client_max_size=client_max_size, middlewares=[*middlewares, _errors_as_vllm(unavailable)])
    app.router.add_post(RENDER_PATH, frame.render)
    app.router.add_post(GENERATE_PATH, frame.generate)
    app.router.add_post(ABORT_PATH, frame.abort)
    app.router.add_get(HEALTH_PATH, frame.health)
    app.router.add_get(MODELS_PATH, frame.models)
    app.router.add_post(PAUSE_PATH, frame.pause)
    app.router.add_post(RESUME_PATH, frame.resume)
    app.router.add_get(IS_PAUSED_PATH, frame.is_paused)
    app.router.add_post(UPDATE_WEIGHT_VERSION_PATH, frame.update_weight_version)
    app.router.add_get(WEIGHT_INFO_PATH, frame.weight_info)
    app.router.add_post(UPDATE_WEIGHTS_PATH, frame.update_weights)
    if load is not None:
        app.router.add_get(METRICS_PATH, _metrics_handler(load, backend))
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
        sockets = getattr(site._server, "sockets", None) or ()  # aiohttp has no public accessor for the address
        if not sockets:
            raise OSError(f"the site on {host}:{port} has no listening socket")
    except BaseException:
        await runner.cleanup()
        raise
    bound_port = sockets[0].getsockname()[1]
    bracketed = f"[{host}]" if ":" in host else host
    return runner, f"http://{bracketed}:{bound_port}"


def _metrics_handler(load: Callable[[], EngineLoad], backend: ServingBackend) -> Handler:
    async def metrics(request: web.Request) -> web.StreamResponse:
        text = format_metrics(load(), model_name=backend.served_model_name)
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    return metrics


def error_response(status: int, message: str, param: str | None = None) -> web.Response:
    """vLLM's error body ``{"error": {"message", "type", "param", "code"}}`` with that status."""
    return json_response(error_body(status, message, param), status=status)


def json_response(body: Any, *, status: int = 200) -> web.Response:
    """A JSON answer serialised with orjson."""
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


async def open_event_stream(http: web.Request) -> web.StreamResponse:
    """Start a Server-Sent Events answer (``text/event-stream``, as vLLM's ``StreamingResponse``)."""
    response = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await response.prepare(http)
    return response


async def send_event(response: web.StreamResponse, data: Any) -> None:
    """One ``data:`` event: ``data`` as JSON, or as it is when it is a string (``[DONE]``)."""
    text = data.encode() if isinstance(data, str) else orjson.dumps(data)
    await response.write(b"data: " + text + b"\n\n")
