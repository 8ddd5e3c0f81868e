"""Headless Chromium driven over the DevTools protocol, with aiohttp's websocket client: for the report's browser
tests, its screenshot and its time-to-first-paint figure.

It uses the Chromium the system has (Debian's ``chromium`` package; ``$CHROMIUM`` names another binary) and
downloads nothing. :class:`Chromium` starts it with a fresh profile in a temporary directory and one page;
:meth:`Chromium.send` calls a protocol method on that page, and every event the page sends is kept in
:attr:`Chromium.events` (console messages, exceptions, network requests), so a test can assert on them.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


class ChromiumError(RuntimeError):
    """Chromium is missing, did not start, or a protocol call failed."""


def find_chromium() -> str | None:
    """The Chromium binary: ``$CHROMIUM``, else the first of :data:`CANDIDATES` on PATH; None when there is none."""
    given = os.environ.get("CHROMIUM")
    if given:
        return shutil.which(given) or (given if Path(given).is_file() else None)
    return next((found for found in map(shutil.which, CANDIDATES) if found), None)


def _read_text(path: Path) -> str:
    return path.read_text(errors="replace")


class Chromium:
    """One headless Chromium with one page (an async context manager)."""

    def __init__(self, *, width: int = 1280, height: int = 900, start_timeout_s: float = 60.0) -> None:
        self.width = width
        self.height = height
        self.start_timeout_s = start_timeout_s
        self.events: list[tuple[str, dict[str, Any]]] = []
        self._process: asyncio.subprocess.Process | None = None
        self._profile: tempfile.TemporaryDirectory[str] | None = None
        self._log = Path(os.devnull)
        self._session: Any = None
        self._socket: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._next_id = 0
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._waiters: list[tuple[Callable[[str, dict[str, Any]], bool], asyncio.Future[None]]] = []

    async def __aenter__(self) -> Chromium:
        import aiohttp

        binary = find_chromium()
        if binary is None:
            raise ChromiumError(
                "no Chromium found (looked for $CHROMIUM and " + ", ".join(CANDIDATES) + " on PATH); install it "
                "(Debian/Ubuntu: `apt-get install chromium`)"
            )
        # Chromium's helper processes may still write to the profile as it exits: a leftover file is no error
        self._profile = tempfile.TemporaryDirectory(prefix="fsm-rollout-chromium-", ignore_cleanup_errors=True)
        profile = Path(self._profile.name) / "profile"
        self._log = Path(self._profile.name) / "stderr.log"
        arguments = [
            binary,
            "--headless=new",
            "--disable-gpu",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-extensions",
            "--hide-scrollbars",
            "--remote-debugging-port=0",
            f"--user-data-dir={profile}",
            f"--window-size={self.width},{self.height}",
            "about:blank",
        ]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            arguments.insert(1, "--no-sandbox")  # Chromium refuses to run as root with its sandbox
        with self._log.open("wb") as log:  # a file, not a pipe: a pipe nobody reads would stall Chromium
            self._process = await asyncio.create_subprocess_exec(
                *arguments, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log
            )
        port = await self._port(profile / "DevToolsActivePort")
        self._session = aiohttp.ClientSession()
        try:
            async with self._session.get(f"http://127.0.0.1:{port}/json/list") as response:
                targets = await response.json()
            page = next(target for target in targets if target.get("type") == "page")
            self._socket = await self._session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        except BaseException:
            await self.close()
            raise
        self._reader = asyncio.create_task(self._read())
        for domain in ("Page", "Runtime", "Network", "Log"):
            await self.send(f"{domain}.enable")
        await self.send("Page.setLifecycleEventsEnabled", {"enabled": True})
        await self.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": self.width, "height": self.height, "deviceScaleFactor": 1, "mobile": False},
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _port(self, marker: Path) -> int:
        """The debugging port Chromium writes to its profile once it listens."""
        assert self._process is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.start_timeout_s
        while loop.time() < deadline:
            if self._process.returncode is not None:
                stderr = _read_text(self._log)
                await self.close()
                raise ChromiumError(f"Chromium exited with {self._process.returncode} at start: {stderr[-2000:]}")
            with contextlib.suppress(FileNotFoundError, ValueError, IndexError):
                return int(_read_text(marker).splitlines()[0])
            await asyncio.sleep(0.05)  # Chromium gives no other signal that it listens
        await self.close()
        raise ChromiumError(f"Chromium did not open its debugging port within {self.start_timeout_s:.0f}s")

    async def _read(self) -> None:
        import orjson

        async for message in self._socket:
            data = orjson.loads(message.data)
            if "id" in data:
                future = self._pending.pop(data["id"], None)
                if future is not None and not future.done():
                    future.set_result(data)
                continue
            event = (str(data.get("method")), data.get("params") or {})
            self.events.append(event)
            for predicate, waiter in list(self._waiters):
                if not waiter.done() and predicate(*event):
                    waiter.set_result(None)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ChromiumError("Chromium closed the connection"))

    async def send(self, method: str, params: dict[str, Any] | None = None, *, timeout_s: float = 60.0) -> Any:
        """Call a protocol method on the page; returns its result (raises :class:`ChromiumError` on an error)."""
        self._next_id += 1
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[self._next_id] = future
        await self._socket.send_json({"id": self._next_id, "method": method, "params": params or {}})
        answer = await asyncio.wait_for(future, timeout_s)
        if "error" in answer:
            raise ChromiumError(f"{method} failed: {answer['error']}")
        return answer.get("result", {})

    def expect(self, predicate: Callable[[str, dict[str, Any]], bool]) -> asyncio.Future[None]:
        """A future that completes with the first event from now on for which ``predicate(method, params)`` holds."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((predicate, waiter))
        return waiter

    async def open(self, url: str, *, timeout_s: float = 60.0) -> None:
        """Navigate to ``url`` and wait for the load event of that navigation (not of an earlier page)."""
        result = await self.send("Page.navigate", {"url": url})
        if result.get("errorText"):
            raise ChromiumError(f"cannot open {url}: {result['errorText']}")
        loader = result.get("loaderId")

        def loaded(method: str, params: dict[str, Any]) -> bool:
            return method == "Page.lifecycleEvent" and params.get("name") == "load" and params.get("loaderId") == loader

        waiter = self.expect(loaded)
        if any(loaded(method, params) for method, params in self.events):
            return
        await asyncio.wait_for(waiter, timeout_s)

    async def evaluate(self, expression: str, *, timeout_s: float = 60.0) -> Any:
        """Evaluate a JavaScript expression in the page (promises awaited); returns its value as JSON."""
        result = await self.send(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
            timeout_s=timeout_s,
        )
        if "exceptionDetails" in result:
            raise ChromiumError(f"evaluating {expression[:80]!r} threw: {result['exceptionDetails']}")
        return result.get("result", {}).get("value")

    async def wait_for(self, expression: str, *, timeout_s: float = 30.0) -> Any:
        """Wait until a JavaScript expression is truthy in the page (checked on each animation frame)."""
        script = (
            "new Promise((resolve, reject) => { const end = performance.now() + " + str(int(timeout_s * 1000)) + ";"
            " (function check() { let v; try { v = (" + expression + "); } catch (e) { v = null; }"
            " if (v) resolve(v); else if (performance.now() > end) reject(new Error('timed out'));"
            " else requestAnimationFrame(check); })(); })"
        )
        return await self.evaluate(script, timeout_s=timeout_s + 5)

    async def screenshot(self, path: str | Path, *, full_page: bool = False) -> Path:
        """Save a PNG of the page (the viewport, or the whole page)."""
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            metrics = await self.send("Page.getLayoutMetrics")
            size = metrics.get("cssContentSize") or metrics["contentSize"]
            params.update(
                captureBeyondViewport=True,
                clip={"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1},
            )
        result = await self.send("Page.captureScreenshot", params)
        target = Path(path)
        await asyncio.to_thread(target.write_bytes, base64.b64decode(result["data"]))
        return target

    def console_errors(self) -> list[str]:
        """Console errors, uncaught exceptions and log entries of level error, as text."""
        found = []
        for method, params in self.events:
            if method == "Runtime.exceptionThrown":
                found.append(str(params.get("exceptionDetails")))
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                found.append(" ".join(str(arg.get("value", arg.get("description"))) for arg in params.get("args", [])))
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                found.append(str(params["entry"].get("text")))
        return found

    def requests(self) -> list[str]:
        """The URL of every request the page made."""
        return [str(params.get("request", {}).get("url")) for method, params in self.events
                if method == "Network.requestWillBeSent"]  # fmt: skip

    async def close(self) -> None:
        """Close the connection, stop Chromium and remove its profile."""
        if self._socket is not None:
            await self._socket.close()
            self._socket = None
        if self._reader is not None:
            with contextlib.suppress(BaseException):
                await self._reader
            self._reader = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._process is not None:
            if self._process.returncode is None:
                self._process.terminate()
                try:
                    await asyncio.wait_for(self._process.wait(), 20)
                except TimeoutError:
                    self._process.kill()
                    await self._process.wait()
            self._process = None
        if self._profile is not None:
            self._profile.cleanup()
            self._profile = None
