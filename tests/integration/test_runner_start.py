"""Entering a RolloutRunner: where its tokenizer comes from, what it lets run, and that the loop keeps running."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest

from fsm_rollout import RolloutConfig, Sample, Status
from fsm_rollout.errors import ConfigError, EngineConnectionError, SamplingParamsError, TokenizerNotFoundError
from fsm_rollout.runtime.runner import RolloutRunner
from fsm_rollout.testing.envs import ScriptedEnvFactory
from fsm_rollout.testing.fake_vllm import GENERATE_PATH, FakeVLLMServer, ScriptedTurn
from fsm_rollout.testing.tokenizer import qwen_tokenizer_dir
from fsm_rollout.tokens import tokenizers as tokenizer_module

SAMPLING = {"max_new_tokens": 16, "temperature": 1.0, "top_p": 1.0}


class NamingServer(FakeVLLMServer):
    """A fake engine whose model list names where its model (and tokenizer) came from, as vLLM's ``root`` does."""

    def __init__(self, tokenizer: Any, *, root: str) -> None:
        super().__init__(tokenizer, model="served-name")
        self.model_root = root


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    """Every tokenizer load as (path, options), done by transformers for real."""
    import transformers

    calls: list[tuple[str, dict[str, Any]]] = []
    real = transformers.AutoTokenizer.from_pretrained

    def from_pretrained(path: str, **options: Any) -> Any:
        calls.append((str(path), options))
        return real(path, **options)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    return calls


@pytest.fixture
async def naming_server(tokenizer: Any) -> AsyncIterator[NamingServer]:
    async with NamingServer(tokenizer, root=str(qwen_tokenizer_dir())) as server:
        yield server


def config_for(url: str, **overrides: Any) -> RolloutConfig:
    return RolloutConfig(**{"engine_url": url, "model": "served-name", "max_turns": 1, **overrides})


async def test_without_tokenizer_path_the_runner_loads_the_tokenizer_the_engine_names_from_local_files(
    naming_server: NamingServer, loads: list[tuple[str, dict[str, Any]]]
) -> None:
    naming_server.script([ScriptedTurn(text="42")])
    async with RolloutRunner(config_for(naming_server.url), sampling_params=SAMPLING,
                             env_factory=ScriptedEnvFactory(steps=[("ok", True)])) as runner:  # fmt: skip
        done = await runner.run(Sample(prompt="What is 6 * 7?", index=0))
    assert len(naming_server.requests_to("/v1/models")) == 1
    assert loads == [(str(qwen_tokenizer_dir()), {"trust_remote_code": False, "local_files_only": True})]
    assert done.status == Status.COMPLETED and done.response == "42"


async def test_without_a_local_tokenizer_the_runner_fails_at_once_naming_tokenizer_path(
    fake_vllm: FakeVLLMServer, loads: list[tuple[str, dict[str, Any]]]
) -> None:
    config = config_for(fake_vllm.url, model="fake-model")  # listed with root "fake-model": no such directory
    runner = RolloutRunner(config, sampling_params=SAMPLING, env_factory=ScriptedEnvFactory())
    with pytest.raises(TokenizerNotFoundError, match=r"model 'fake-model'.*'fake-model'.*tokenizer_path") as caught:
        await runner.__aenter__()
    assert isinstance(caught.value, OSError)  # what code catching transformers' error expects
    assert loads and all(options["local_files_only"] is True for _, options in loads)  # the hub is never asked
    assert runner._clients == {}  # the clients it opened are closed again


@pytest.mark.parametrize("with_tokenizer", [False, True])
async def test_a_runner_whose_engine_does_not_answer_fails_to_start_naming_the_url(
    tokenizer: Any, with_tokenizer: bool
) -> None:
    config = config_for("http://127.0.0.1:9", model="nowhere-model", connect_timeout_s=2.0)
    runner = RolloutRunner(config, sampling_params=SAMPLING, env_factory=ScriptedEnvFactory(),
                           tokenizer=tokenizer if with_tokenizer else None)  # fmt: skip
    with pytest.raises(EngineConnectionError, match=r"http://127\.0\.0\.1:9/health"):
        await runner.__aenter__()
    assert runner._clients == {}  # the clients it opened are closed again


async def test_a_runner_fails_to_start_when_one_of_its_engines_does_not_answer(
    fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    config = config_for(fake_vllm.url, model="fake-model", connect_timeout_s=2.0)
    runner = RolloutRunner(config, sampling_params=SAMPLING, env_factory=ScriptedEnvFactory(), tokenizer=tokenizer,
                           engine_urls=[fake_vllm.url, "http://127.0.0.1:9"])  # fmt: skip
    with pytest.raises(EngineConnectionError, match=r"127\.0\.0\.1:9"):
        await runner.__aenter__()


@pytest.mark.parametrize(
    ("sampling", "error", "match"),
    [
        ({"temperature": 1.0}, SamplingParamsError, "max_new_tokens"),
        ({"max_new_tokens": -1, "temperature": 1.0}, ConfigError, "max_new_tokens"),
        ({"max_new_tokens": 4, "temperature": 1.0, "top_p": 0.0}, ConfigError, "top_p"),
        ({"max_new_tokens": 4, "temperature": 1.0, "top_p": "1"}, ConfigError, "top_p"),
        ({"max_new_tokens": 4, "temperature": -0.5}, ConfigError, "temperature"),
    ],
)
def test_bad_sampling_params_fail_when_the_runner_is_built(
    sampling: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        RolloutRunner(config_for("http://127.0.0.1:9"), sampling_params=sampling)


async def test_top_p_may_be_left_out_and_is_sent_as_1(fake_vllm: FakeVLLMServer, tokenizer: Any) -> None:
    fake_vllm.script([ScriptedTurn(text="42")])
    config = config_for(fake_vllm.url, model="fake-model")
    async with RolloutRunner(config, sampling_params={"max_new_tokens": 8, "temperature": 1.0}, tokenizer=tokenizer,
                             env_factory=ScriptedEnvFactory(steps=[("ok", True)])) as runner:  # fmt: skip
        done = await runner.run(Sample(prompt="q", index=0))
    assert done.status == Status.COMPLETED
    [generate] = fake_vllm.requests_to(GENERATE_PATH)
    assert generate.body["sampling_params"]["top_p"] == 1.0


@pytest.mark.parametrize("trusted", [False, True])
async def test_a_configured_tokenizer_path_loads_with_remote_code_only_when_the_config_says(
    fake_vllm: FakeVLLMServer, loads: list[tuple[str, dict[str, Any]]], trusted: bool
) -> None:
    config = config_for(fake_vllm.url, model="fake-model", tokenizer_path=str(qwen_tokenizer_dir()),
                        trust_remote_code=trusted)  # fmt: skip
    async with RolloutRunner(config, sampling_params=SAMPLING, env_factory=ScriptedEnvFactory()):
        pass
    assert loads == [(str(qwen_tokenizer_dir()), {"trust_remote_code": trusted, "local_files_only": False})]


class WatchedTokenizer:
    """The real tokenizer, noting the thread of every chat-template rendering."""

    def __init__(self, tokenizer: Any, threads: list[int]) -> None:
        self._tokenizer = tokenizer
        self._threads = threads

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self._threads.append(threading.get_ident())
        return self._tokenizer.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


async def test_entering_loads_the_tokenizer_and_probes_the_template_while_the_loop_runs_other_tasks(
    fake_vllm: FakeVLLMServer, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop_thread = threading.get_ident()
    ticked = threading.Event()
    loader: dict[str, Any] = {}
    renderings: list[int] = []

    def load(path: str, **options: Any) -> WatchedTokenizer:
        loader["thread"] = threading.get_ident()
        # a loader on the loop's thread would wait here in vain: the ticker below could not run
        loader["saw the loop tick"] = ticked.wait(timeout=30)
        return WatchedTokenizer(tokenizer, renderings)

    monkeypatch.setattr(tokenizer_module, "load_tokenizer", load)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            if ticks == 3:
                ticked.set()
            await asyncio.sleep(0.001)

    threads_before = set(threading.enumerate())
    beating = asyncio.ensure_future(ticker())
    config = config_for(fake_vllm.url, model="fake-model", tokenizer_path="/a/tokenizer")
    runner = RolloutRunner(config, sampling_params=SAMPLING, env_factory=ScriptedEnvFactory())
    try:
        await runner.__aenter__()
        assert set(threading.enumerate()) <= threads_before  # no thread (nor an executor's) is left behind
        probed = list(renderings)
        fake_vllm.script([ScriptedTurn(text="x")])
        await runner.run(Sample(prompt="q", index=0))
    finally:
        beating.cancel()
        await runner.__aexit__(None, None, None)
    assert loader == {"thread": loader["thread"], "saw the loop tick": True}
    assert loader["thread"] != loop_thread
    assert probed, "the template probe ran before any sample"
    assert loop_thread not in probed
    # the sample's rollout found the probe done: nothing of the probe was rendered on the loop
    assert renderings[len(probed) :].count(loop_thread) == 0
