"""vLLM-shaped HTTP answers for servers that speak vLLM's endpoints (the embedded engine, the fake test server)."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

import orjson
from aiohttp import web


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
