"""The engine behind the gateway's dialect workload (:mod:`tools.bench_gateway_dialects`), in a child process so its
CPU is not the gateway's: every generate request is answered with one fixed answer (a harness's shell tool call), and
a render with the test tokenizer's chat template (the gateway renders a session's first prompt there),
through the serving frame (:mod:`fsm_rollout.engine.endpoints`, so requests are checked as vLLM checks them), whole
or streamed one token per chunk as vLLM streams it. Its context is long enough for a harness's first prompt.

``python -m tools.bench_gateway_engine TEXT`` prints the URL on one line, then serves until stdin closes.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from aiohttp import web

from fsm_rollout.engine.schema import DEFAULT_WEIGHT_VERSION, ModelList, PauseMode, RequestError
from fsm_rollout.engine.serving import GenerateOutcome, GenerateRequest, RenderRequest, generate_answer, models_answer
from fsm_rollout.engine.token_stream import stream_flags

MODEL = "fake-model"
MAX_MODEL_LEN = 262_144
"""Room for Claude Code's first prompt (about 12k tokens with the test tokenizer) and its `max_tokens` of 128000."""


class FixedAnswer:
    """A serving backend that answers every generate with the same tokens (``finish: stop`` at EOS)."""

    def __init__(self, token_ids: list[int], tokenizer: Any) -> None:
        self._token_ids = token_ids
        self._tokenizer = tokenizer

    @property
    def served_model_name(self) -> str:
        return MODEL

    @property
    def max_model_len(self) -> int:
        return MAX_MODEL_LEN

    @property
    def vocab_size(self) -> None:
        return None

    def models(self) -> ModelList:
        return models_answer(MODEL, root=MODEL, max_model_len=MAX_MODEL_LEN)

    async def render(self, request: RenderRequest) -> tuple[list[int], Any]:
        from fsm_rollout.testing.fake_vllm.generation import as_token_ids

        try:
            rendered = self._tokenizer.apply_chat_template(
                request.messages,
                tools=request.tools,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                tokenize=True,
                **request.template_kwargs,
            )
        except Exception as error:  # a template that cannot render these messages is the request's fault
            raise RequestError(400, f"chat template rendering failed: {error}") from error
        return as_token_ids(rendered), None

    async def generate(self, request: GenerateRequest, http: web.Request) -> GenerateOutcome | web.StreamResponse:
        from fsm_rollout.testing.fake_vllm.generation import logprob_entry
        from fsm_rollout.testing.fake_vllm.streaming import stream_rest

        tokens = self._token_ids[: request.settings.max_tokens]
        top = request.settings.logprobs
        outcome = GenerateOutcome(
            token_ids=tokens,
            finish="stop" if len(tokens) == len(self._token_ids) else "length",
            logprobs=None if top is None else [logprob_entry("token_id", t, -0.01, top=top) for t in tokens],
            weight_versions=[{"version": DEFAULT_WEIGHT_VERSION, "start": 0, "end": len(tokens)}],
        )
        stream, include_usage = stream_flags(request.body)
        if not stream:
            return outcome
        answer = generate_answer(request.request_id, request.prompt_len, outcome, model=MODEL)
        return await stream_rest(http, None, request.request_id, answer, include_usage=include_usage)

    async def abort(self, request_ids: list[str]) -> None:
        return None

    async def pause(self, mode: PauseMode) -> None:
        return None

    async def resume(self) -> None:
        return None

    def is_paused(self) -> bool:
        return False

    async def update_weight_version(self, version: str) -> None:
        return None

    def weight_version(self) -> str:
        return DEFAULT_WEIGHT_VERSION

    async def update_weights(self, body: dict[str, Any]) -> None:
        return None


def serve(text: str) -> None:
    """Serve :class:`FixedAnswer` of ``text`` (encoded with the test tokenizer, then EOS) until stdin closes."""
    from fsm_rollout.engine.endpoints import serve_backend
    from fsm_rollout.testing.tokenizer import load_qwen_tokenizer

    tokenizer = load_qwen_tokenizer()
    token_ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]

    async def main() -> None:
        runner, url = await serve_backend(
            FixedAnswer(token_ids, tokenizer), host="127.0.0.1", port=0, client_max_size=64 * 1024 * 1024
        )
        print(url, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await runner.cleanup()

    asyncio.run(main())


class Engine:
    """:func:`serve` in a child process."""

    def __init__(self, text: str, cwd: Any) -> None:
        import subprocess

        self._process = subprocess.Popen(
            [sys.executable, "-m", "tools.bench_gateway_engine", text],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=cwd,
        )
        assert self._process.stdout is not None
        self.url = self._process.stdout.readline().strip()
        if not self.url.startswith("http"):
            self.stop()
            raise RuntimeError(f"bench: the dialects' engine did not start (got {self.url!r})")

    def stop(self) -> None:
        assert self._process.stdin is not None
        self._process.stdin.close()
        self._process.wait(timeout=30)


if __name__ == "__main__":
    serve(sys.argv[1])
