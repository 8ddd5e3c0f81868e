"""Serving vLLM's token-in/token-out endpoints (the embedded engine, the fake test server): binding the routes and
answering with JSON and vLLM's error bodies. The paths and records are in :mod:`fsm_rollout.engine.schema`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any

import orjson
from aiohttp import web

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
    error_body,
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class EndpointHandlers:
    """The handlers of the five endpoints a vLLM-speaking server answers."""

    render: Handler
    generate: Handler
    abort: Handler
    health: Handler
    models: Handler

    @classmethod
    def of(cls, server: Any) -> EndpointHandlers:
        """The server's ``_handle_render``, ``_handle_generate``, ... methods (the embedded engine and the fake
        test server name theirs so)."""
        return cls(**{item.name: getattr(server, f"_handle_{item.name}") for item in fields(cls)})


@dataclass(frozen=True)
class WeightUpdateHandlers:
    """The handlers of vLLM's weight-update endpoints (``VLLM_SERVER_DEV_MODE=1``): pause, resume, the weight
    version, and loading new weights."""

    pause: Handler
    resume: Handler
    is_paused: Handler
    update_weight_version: Handler
    weight_info: Handler
    update_weights: Handler

    @classmethod
    def of(cls, server: Any) -> WeightUpdateHandlers:
        """The server's ``_handle_pause``, ``_handle_resume``, ... methods."""
        return cls(**{item.name: getattr(server, f"_handle_{item.name}") for item in fields(cls)})


async def serve_endpoints(
    handlers: EndpointHandlers,
    *,
    host: str,
    port: int,
    client_max_size: int,
    middlewares: Iterable[Any] = (),
    shutdown_timeout: float = 5.0,
    weight_updates: WeightUpdateHandlers | None = None,
) -> tuple[web.AppRunner, str]:
    """Bind the endpoints on ``host:port`` (0: a free port); returns the runner (to clean up) and the base URL.

    Handler cancellation is on: since aiohttp 3.8.2 a client disconnect no longer cancels its handler unless asked,
    and that cancellation is how a long generation learns its client went away.
    """
    app = web.Application(client_max_size=client_max_size, middlewares=list(middlewares))
    app.router.add_post(RENDER_PATH, handlers.render)
    app.router.add_post(GENERATE_PATH, handlers.generate)
    app.router.add_post(ABORT_PATH, handlers.abort)
    app.router.add_get(HEALTH_PATH, handlers.health)
    app.router.add_get(MODELS_PATH, handlers.models)
    if weight_updates is not None:
        app.router.add_post(PAUSE_PATH, weight_updates.pause)
        app.router.add_post(RESUME_PATH, weight_updates.resume)
        app.router.add_get(IS_PAUSED_PATH, weight_updates.is_paused)
        app.router.add_post(UPDATE_WEIGHT_VERSION_PATH, weight_updates.update_weight_version)
        app.router.add_get(WEIGHT_INFO_PATH, weight_updates.weight_info)
        app.router.add_post(UPDATE_WEIGHTS_PATH, weight_updates.update_weights)
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


def error_response(status: int, message: str, param: str | None = None) -> web.Response:
    """vLLM's error body ``{"error": {"message", "type", "param", "code"}}`` with that status."""
    return json_response(error_body(status, message, param), status=status)


def json_response(body: Any, *, status: int = 200) -> web.Response:
    """A JSON answer serialised with orjson."""
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")
