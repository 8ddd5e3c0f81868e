"""The bad-input catalogue: malformed samples, configs, environment modules, dataset lines, images, trace files and
HTTP requests to the embedded engine -- each rejected with a specific error (class and message), before any request
when the input is the caller's, with nothing lost (the sample's data kept, the environment closed once or never
built).

Cases already covered elsewhere (completed/pre-filled samples, bad sampling params, non-text observations, a
3-tuple-less ``step``) are not repeated here.
"""

from __future__ import annotations

import base64
import io
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from _support import SAMPLING, HookedEnvFactory, make_config

from fsm_rollout import RetryPolicy, Rollout, RolloutConfig, Sample, Status, VLLMClient
from fsm_rollout.envs.protocol import load_env_factory
from fsm_rollout.errors import (
    ConfigError,
    EnvironmentContractError,
    EnvironmentLoadError,
    ImageInputError,
    RenderError,
    SampleStateError,
)
from fsm_rollout.recording import RecordingFormatError
from fsm_rollout.replay import replay
from fsm_rollout.runtime.dataset import DatasetError, load_jsonl
from fsm_rollout.testing.fake_vllm import FakeVLLMServer

# ------------------------------------------------------------ samples


def png_data_url() -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


# (sample factory, error class, message fragment)
SAMPLE_CASES: dict[str, Any] = {
    "status-aborted": (lambda: Sample(prompt="q", status=Status.ABORTED), SampleStateError, "pending sample"),
    "status-failed": (lambda: Sample(prompt="q", status=Status.FAILED), SampleStateError, "got status 'failed'"),
    "status-truncated": (lambda: Sample(prompt="q", status=Status.TRUNCATED), SampleStateError, "'truncated'"),
    "metadata-not-a-dict": pytest.param(
        lambda: Sample(prompt="q", metadata=[1]),
        SampleStateError,
        "metadata",
    ),
}


@pytest.mark.parametrize(("factory", "error", "fragment"), list(SAMPLE_CASES.values()), ids=list(SAMPLE_CASES))
async def test_samples_that_cannot_start(
    fake_vllm: FakeVLLMServer,
    client: VLLMClient,
    tokenizer: Any,
    factory: Callable[[], Sample],
    error: type[Exception],
    fragment: str,
) -> None:
    sample = factory()
    before = sample.to_dict()
    envs = HookedEnvFactory()
    with pytest.raises(error, match=re.escape(fragment)):
        Rollout(
            sample,
            config=make_config(fake_vllm.url),
            sampling_params=dict(SAMPLING),
            client=client,
            tokenizer=tokenizer,
            env_factory=envs,
        )
    assert sample.to_dict() == before
    assert envs.built == [] and fake_vllm.requests == []


# prompts and images are rejected when the rollout runs, in pending, before any request
RUN_CASES: dict[str, Any] = {
    "prompt-none": pytest.param(lambda: Sample(prompt=None), SampleStateError, "prompt"),
    "prompt-int": pytest.param(lambda: Sample(prompt=42), SampleStateError, "prompt"),
    "prompt-empty-messages": pytest.param(lambda: Sample(prompt=[]), SampleStateError, "prompt"),
    "prompt-message-without-role": pytest.param(lambda: Sample(prompt=[{"content": "x"}]), SampleStateError, "role"),
    "image-int": (
        lambda: Sample(prompt="<image>x", multimodal_inputs={"images": [123]}),
        ImageInputError,
        "unsupported image type int",
    ),
    "image-not-a-url": (
        lambda: Sample(prompt="<image>x", multimodal_inputs={"images": ["not-a-url"]}),
        ImageInputError,
        "not a data: URL",
    ),
    "image-bad-base64": (
        lambda: Sample(prompt="<image>x", multimodal_inputs={"images": ["data:image/png;base64,!!!"]}),
        ImageInputError,
        "not valid base64",
    ),
    "image-not-an-image": (
        lambda: Sample(prompt="<image>x", multimodal_inputs={"images": ["data:image/png;base64,aGVsbG8="]}),
        ImageInputError,
        "not an image PIL can read",
    ),
    "image-missing-file": (
        lambda: Sample(prompt="<image>x", multimodal_inputs={"images": ["/nonexistent/x.png"]}),
        ImageInputError,
        "existing file",
    ),
    "image-file-url": (
        lambda: Sample(prompt="<image>x", multimodal_inputs={"images": ["file:///etc/passwd"]}),
        ImageInputError,
        "unsupported URL scheme 'file'",
    ),
    "image-ftp-url": (
        lambda: Sample(prompt="<image>x", multimodal_inputs={"images": ["ftp://host/a.png"]}),
        ImageInputError,
        "ftp",
    ),
    "images-a-string": pytest.param(
        lambda: Sample(prompt="<image>x", multimodal_inputs={"images": "x.png"}),
        ImageInputError,
        "list",
    ),
    "image-count-mismatch": pytest.param(
        lambda: Sample(prompt="<image><image>x", multimodal_inputs={"images": [png_data_url()]}),
        ImageInputError,
        "<image>",
    ),
}


@pytest.mark.parametrize(("factory", "error", "fragment"), list(RUN_CASES.values()), ids=list(RUN_CASES))
async def test_bad_prompts_and_images_fail_before_any_request(
    fake_vllm: FakeVLLMServer,
    client: VLLMClient,
    tokenizer: Any,
    factory: Callable[[], Sample],
    error: type[Exception],
    fragment: str,
) -> None:
    sample = factory()
    prompt, images = sample.prompt, (sample.multimodal_inputs or {}).get("images")
    envs = HookedEnvFactory()
    rollout = Rollout(
        sample,
        config=make_config(fake_vllm.url),
        sampling_params=dict(SAMPLING),
        client=client,
        tokenizer=tokenizer,
        env_factory=envs,
    )
    with pytest.raises(error, match=re.escape(fragment)):
        await rollout.run()
    assert fake_vllm.requests == []
    assert rollout.state == "failed" and sample.status == Status.FAILED
    assert sample.metadata["rollout_error"]["state"] == "pending"
    assert sample.prompt == prompt and (sample.multimodal_inputs or {}).get("images") == images  # data kept
    assert envs.last.close_count == 1


async def test_pre_filled_tokens_that_differ_from_the_render_fail_with_a_render_error(
    fake_vllm: FakeVLLMServer, client: VLLMClient, tokenizer: Any
) -> None:
    sample = Sample(prompt="q", tokens=[1, 2, 3])
    envs = HookedEnvFactory()
    rollout = Rollout(
        sample,
        config=make_config(fake_vllm.url),
        sampling_params=dict(SAMPLING),
        client=client,
        tokenizer=tokenizer,
        env_factory=envs,
    )
    with pytest.raises(RenderError, match=r"differ from sample\.tokens"):
        await rollout.run()
    assert sample.tokens == [1, 2, 3]  # the caller's tokens are not overwritten
    assert [r.path for r in fake_vllm.requests] == ["/v1/chat/completions/render"]
    assert envs.last.close_count == 1


# ------------------------------------------------------------ configs

BASE = {"engine_url": "http://127.0.0.1:8000", "model": "m", "max_turns": 2}
CONFIG_CASES: dict[str, tuple[dict[str, Any], str]] = {
    "max_turns-zero": ({"max_turns": 0}, "max_turns must be a positive integer"),
    "max_turns-bool": ({"max_turns": True}, "max_turns must be a positive integer"),
    "engine_url-ftp": ({"engine_url": "ftp://x"}, "engine_url must be an http(s) URL"),
    "model-empty": ({"model": ""}, "model (the served model name)"),
    "weight-update-strategy-unknown": ({"weight_update_strategy": "pause"}, "weight_update_strategy must be"),
    "record-without-trace": ({"record": True}, "record=True needs a trace file"),
    "request-timeout-negative": ({"request_timeout_s": -1}, "request_timeout_s must be positive"),
    "connect-timeout-zero": ({"connect_timeout_s": 0}, "connect_timeout_s must be a positive number"),
    "image-merge-size-zero": ({"image_merge_size": 0}, "image_merge_size must be a positive integer"),
    "template-kwargs-not-mapping": ({"apply_chat_template_kwargs": "x"}, "must be a mapping"),
    "routing-replay-without-layers": ({"use_rollout_routing_replay": True}, "needs a positive integer num_layers"),
    "context-len-negative": ({"rollout_max_context_len": -5}, "rollout_max_context_len must be a non-negative"),
}


@pytest.mark.parametrize(("overrides", "fragment"), list(CONFIG_CASES.values()), ids=list(CONFIG_CASES))
def test_bad_configs(overrides: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        RolloutConfig(**{**BASE, **overrides})


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [({"max_attempts": 0}, "max_attempts must be an int >= 1"), ({"base_delay_s": -1}, "non-negative")],
)
def test_bad_retry_policies(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        RetryPolicy(**kwargs)


# ------------------------------------------------------------ env modules


@pytest.mark.parametrize(
    ("source", "error", "fragment"),
    [
        (None, EnvironmentLoadError, "does not exist"),
        ("x = 1\n", EnvironmentContractError, "must expose a callable build_env"),
        ("build_env = 3\n", EnvironmentContractError, "must expose a callable build_env"),
        pytest.param("def (\n", EnvironmentLoadError, "broken_env"),
    ],
    ids=["missing-file", "no-build_env", "build_env-not-callable", "syntax-error"],
)
def test_bad_environment_files(tmp_path: Path, source: str | None, error: type[Exception], fragment: str) -> None:
    path = tmp_path / "broken_env.py"
    if source is not None:
        path.write_text(source)
    with pytest.raises(error, match=fragment):
        load_env_factory(str(path))


class NoStep:
    def reset(self) -> None:
        pass

    def close(self) -> None:
        self.closed = getattr(self, "closed", 0) + 1


async def test_unknown_environment_module_fails_in_pending_before_any_request(
    fake_vllm: FakeVLLMServer, client: VLLMClient, tokenizer: Any
) -> None:
    sample = Sample(prompt="q")
    rollout = Rollout(
        sample,
        config=make_config(fake_vllm.url, env_path="no_such_pkg.env"),
        sampling_params=dict(SAMPLING),
        client=client,
        tokenizer=tokenizer,
    )
    with pytest.raises(EnvironmentLoadError, match=r"cannot import environment module 'no_such_pkg\.env'"):
        await rollout.run()
    assert fake_vllm.requests == [] and sample.status == Status.FAILED


async def test_environment_without_step_fails_before_any_request_and_is_closed(
    fake_vllm: FakeVLLMServer, client: VLLMClient, tokenizer: Any
) -> None:
    built: list[NoStep] = []

    def factory(**_: Any) -> NoStep:
        built.append(NoStep())
        return built[-1]

    rollout = Rollout(
        Sample(prompt="q"),
        config=make_config(fake_vllm.url),
        sampling_params=dict(SAMPLING),
        client=client,
        tokenizer=tokenizer,
        env_factory=factory,
    )
    with pytest.raises(EnvironmentContractError, match=r"lacks the environment method\(s\) \['step', 'format_obs"):
        await rollout.run()
    assert fake_vllm.requests == []
    assert built[0].closed == 1


# ------------------------------------------------------------ dataset lines

DATASET_CASES = {
    "not-json": ("{not json", "unexpected character"),
    "array": ("[1, 2]", "a line must be a JSON object, got list"),
    "unknown-key": ('{"prompt": "x", "foo": 1}', "unknown keys ['foo']"),
    "empty-prompt": ('{"prompt": ""}', "'prompt' must be a non-empty string"),
    "prompt-int": ('{"prompt": 5}', "'prompt' must be a non-empty string"),
    "no-prompt": ('{"label": 1}', "'prompt' must be a non-empty string"),
    "images-string": ('{"prompt": "x", "images": "a.png"}', "'images' must be a list of strings"),
    "metadata-list": ('{"prompt": "x", "metadata": []}', "'metadata' must be an object"),
    "tools-object": ('{"prompt": "x", "tools": {}}', "'tools' must be a list"),
    "message-without-role": ('{"prompt": [{"content": "x"}]}', "prompt[0] must be a chat message"),
}


@pytest.mark.parametrize(("line", "fragment"), list(DATASET_CASES.values()), ids=list(DATASET_CASES))
def test_bad_dataset_lines_name_their_line(tmp_path: Path, line: str, fragment: str) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + '\n{"prompt": "also fine"}\n')
    with pytest.raises(DatasetError, match=":2: ") as caught:
        load_jsonl(path)
    assert fragment in str(caught.value)
    skipped = load_jsonl(path, skip_bad=True)  # nothing lost: the good lines are kept, the bad one counted
    assert [sample.prompt for sample in skipped.samples] == ["fine", "also fine"]
    assert len(skipped.skipped) == 1


def test_missing_dataset_file(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="no such file"):
        load_jsonl(tmp_path / "nope.jsonl")


# ------------------------------------------------------------ trace files


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (None, "cannot read"),
        (b"", "holds no transition events"),
        (b"\x00\xff\xfe garbage\n", "holds no transition events"),
        (b'{"event": "transition", "src": "pending", "trig', "holds no transition events"),
        (b'{"event": "something else"}\n[1, 2]\n', "holds no transition events"),
    ],
    ids=["missing", "empty", "binary-garbage", "truncated-line", "not-a-trace"],
)
def test_unusable_trace_files(tmp_path: Path, tokenizer: Any, content: bytes | None, fragment: str) -> None:
    path = tmp_path / "run.jsonl"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(RecordingFormatError, match=fragment):
        replay(path, tokenizer=tokenizer)


# ------------------------------------------------------------ embedded engine

GENERATE = "/inference/v1/generate"
RENDER = "/v1/chat/completions/render"
ABORT = "/inference/v1/abort_requests"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[Any]:
    from fsm_rollout.engine.local import LocalEngine

    async with LocalEngine(max_model_len=256, torch_threads=1) as server:
        yield server


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize(
    ("path", "body", "param", "fragment"),
    [
        (GENERATE, {"token_ids": [1, 2.5], "sampling_params": {}}, "token_ids", "non-negative integer"),
        (GENERATE, {"token_ids": [1], "sampling_params": {"stop_token_ids": ["x"]}}, "stop_token_ids", "integers"),
        (GENERATE, {"token_ids": [1], "sampling_params": {"max_tokens": "8"}}, "max_tokens", "valid integer"),
        (GENERATE, {"token_ids": [1], "sampling_params": {}, "request_id": 5}, "request_id", "string"),
        (ABORT, {"request_ids": "abc"}, "request_ids", "list of strings"),
        (RENDER, {"messages": "hello"}, "messages", "non-empty list"),
        (
            RENDER,
            {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": [1]},
            "chat_template_kwargs",
            "dictionary",
        ),
        (
            RENDER,
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}],
                    }
                ]
            },
            None,
            "remote images",
        ),
    ],
    ids=[
        "float-token",
        "stop-token-ids-strings",
        "max-tokens-string",
        "request-id-int",
        "abort-ids-string",
        "messages-string",
        "template-kwargs-list",
        "remote-image",
    ],
)
async def test_bad_engine_requests_get_a_400_naming_the_field(
    engine: Any, path: str, body: Any, param: str | None, fragment: str
) -> None:
    async with aiohttp.ClientSession() as http, http.post(engine.url + path, json=body) as response:
        status, answer = response.status, await response.json()
    assert status == 400
    error = answer["error"]
    assert (error["type"], error["code"]) == ("BadRequestError", 400)
    assert fragment in error["message"]
    if param is not None:
        assert error["param"] == param
