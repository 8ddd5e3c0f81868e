"""vLLM's token-in/token-out endpoints: their paths (for the client) and serving them (the embedded engine, the fake
test server): vLLM-shaped answers and one way to bind the routes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from http import HTTPStatus
from typing import Any

import orjson
from aiohttp import web

RENDER_PATH = "/v1/chat/completions/render"
GENERATE_PATH = "/inference/v1/generate"
ABORT_PATH = "/inference/v1/abort_requests"
HEALTH_PATH = "/health"
MODELS_PATH = "/v1/models"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Chat-request fields that render copies into the GenerateRequest's sampling_params unchanged.
RENDER_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
)
# The fields vLLM's render always writes (its SamplingParams defaults); render also fills in max_tokens.
RENDER_DEFAULT_SAMPLING: Mapping[str, Any] = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "min_p": 0.0,
    "stop": [],
    "stop_token_ids": [],
}


def render_sampling_params(body: Mapping[str, Any]) -> dict[str, Any]:
    """The ``sampling_params`` vLLM's render writes for a chat request ``body`` (served by the embedded engine and
    the fake test server alike)."""
    sampling = dict(RENDER_DEFAULT_SAMPLING)
    for name in RENDER_SAMPLING_FIELDS:
        if body.get(name) is not None:
            sampling[name] = body[name]
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        sampling["max_tokens"] = max_tokens
    if body.get("logprobs") is True:  # chat's boolean + top_logprobs become SamplingParams.logprobs
        sampling["logprobs"] = body.get("top_logprobs") or 0
    return sampling


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


async def serve_endpoints(
    handlers: EndpointHandlers,
    *,
    host: str,
    port: int,
    client_max_size: int,
    middlewares: Iterable[Any] = (),
    shutdown_timeout: float = 5.0,
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


def error_type(status: int) -> str:
    """The OpenAI/vLLM error ``type`` of an HTTP status (``400`` → ``BadRequestError``)."""
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        return "Error"
    name = "".join(word.capitalize() for word in phrase.replace("-", " ").split())
    return name if name.endswith("Error") else f"{name}Error"


def error_response(status: int, message: str, param: str | None = None) -> web.Response:
    """vLLM's error body ``{"error": {"message", "type", "param", "code"}}`` with that status."""
    body = {"error": {"message": message, "type": error_type(status), "param": param, "code": status}}
    return json_response(body, status=status)


def json_response(body: Any, *, status: int = 200) -> web.Response:
    """A JSON answer serialised with orjson."""
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")
