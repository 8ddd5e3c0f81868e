"""What ``fsm-rollout run`` checks before a sample runs: the tokenizer lookup never waits on the hub's retries."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fsm_rollout.cli import preflight
from fsm_rollout.cli.preflight import PreflightError, load_run_tokenizer
from fsm_rollout.testing.tokenizer import qwen_tokenizer_dir


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """Every from_pretrained call as (source, local_only); nothing is in the cache."""
    calls: list[tuple[str, bool]] = []

    def from_pretrained(source: str, *, local_only: bool, trust_remote_code: bool) -> Any:
        assert trust_remote_code is False  # never unless asked
        calls.append((source, local_only))
        if local_only and not Path(source).is_dir():
            raise OSError("not in the cache\nmore lines")
        return f"tokenizer of {source}"

    monkeypatch.setattr(preflight, "_from_pretrained", from_pretrained)
    return calls


def refuse_the_hub(monkeypatch: pytest.MonkeyPatch, error: Exception) -> list[float]:
    timeouts: list[float] = []

    def model_info(self: Any, repo_id: str, *, timeout: float) -> None:
        timeouts.append(timeout)
        raise error

    monkeypatch.setattr("huggingface_hub.HfApi.model_info", model_info)
    return timeouts


def test_a_local_directory_loads_without_the_hub(loads: list[tuple[str, bool]]) -> None:
    assert load_run_tokenizer(str(qwen_tokenizer_dir()), named_by="--tokenizer") == (
        f"tokenizer of {qwen_tokenizer_dir()}"
    )
    assert loads == [(str(qwen_tokenizer_dir()), True)]


def test_offline_a_name_not_in_the_cache_fails_at_once(
    loads: list[tuple[str, bool]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    asked = refuse_the_hub(monkeypatch, AssertionError("the hub was asked"))
    with pytest.raises(PreflightError) as caught:
        load_run_tokenizer("org/model", named_by="--model")
    assert str(caught.value) == (
        "--model 'org/model' is neither a local directory nor in the Hugging Face cache, "
        "and the hub is offline (HF_HUB_OFFLINE): pass --tokenizer DIR"
    )
    assert loads == [("org/model", True)] and asked == []


def test_an_unreachable_hub_is_asked_once_with_a_timeout_and_never_retried(
    loads: list[tuple[str, bool]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    asked = refuse_the_hub(monkeypatch, ConnectionError("[Errno -2] Name or service not known\nsecond line"))
    with pytest.raises(PreflightError) as caught:
        load_run_tokenizer("org/model", named_by="--tokenizer")
    assert str(caught.value) == (
        "--tokenizer 'org/model' is neither a local directory nor in the Hugging Face cache, and the hub cannot "
        "provide it (ConnectionError: [Errno -2] Name or service not known): pass --tokenizer DIR"
    )
    assert asked == [preflight.HUB_CHECK_TIMEOUT_S]
    assert loads == [("org/model", True)]  # no download attempt, so none of transformers' retries


def test_a_hub_that_has_the_model_is_downloaded_from(
    loads: list[tuple[str, bool]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.HfApi.model_info", lambda self, repo_id, *, timeout: None)
    assert load_run_tokenizer("org/model", named_by="--tokenizer") == "tokenizer of org/model"
    assert loads == [("org/model", True), ("org/model", False)]


@pytest.mark.parametrize("location", ["/no/such/dir", "./rel", "a/b/c", "~/nowhere"])
def test_a_path_that_is_not_a_directory_fails_without_the_hub(
    location: str, loads: list[tuple[str, bool]], monkeypatch: pytest.MonkeyPatch
) -> None:
    asked = refuse_the_hub(monkeypatch, AssertionError("the hub was asked"))
    with pytest.raises(PreflightError, match=r"is not a tokenizer directory: pass --tokenizer DIR$"):
        load_run_tokenizer(location, named_by="--tokenizer")
    assert loads == [] and asked == []


def test_a_directory_that_holds_no_tokenizer_fails_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(PreflightError) as caught:
        load_run_tokenizer(str(tmp_path), named_by="--tokenizer")
    message = str(caught.value)
    assert message.startswith(f"cannot load --tokenizer {str(tmp_path)!r} (") and "\n" not in message
    assert message.endswith("): pass --tokenizer DIR")


def test_the_api_key_defaults_from_the_environment_and_is_redacted(monkeypatch: pytest.MonkeyPatch) -> None:
    from argparse import Namespace

    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert preflight.api_key(Namespace(api_key=None)) == "from-env"
    assert preflight.api_key(Namespace(api_key="flag")) == "flag"
    monkeypatch.setenv("VLLM_API_KEY", "")
    assert preflight.api_key(Namespace(api_key=None)) is None
    assert preflight.redacted("key from-env echoed", "from-env") == "key *** echoed"


@pytest.mark.parametrize("trusted", [False, True])
def test_a_tokenizer_runs_its_own_code_only_with_trust_remote_code(
    monkeypatch: pytest.MonkeyPatch, trusted: bool
) -> None:
    import transformers

    seen: list[dict[str, Any]] = []

    def from_pretrained(source: str, **options: Any) -> str:
        seen.append(options)
        return "tokenizer"

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    options = {"trust_remote_code": True} if trusted else {}
    assert load_run_tokenizer(str(qwen_tokenizer_dir()), named_by="--tokenizer", **options) == "tokenizer"
    assert seen == [{"trust_remote_code": trusted, "local_files_only": True}]


def test_the_run_command_passes_trust_remote_code_to_the_config_only_when_given() -> None:
    from fsm_rollout.cli import build_parser
    from fsm_rollout.cli.run import build_config

    parser = build_parser()
    for flags, expected in (([], False), (["--trust-remote-code"], True)):
        args = parser.parse_args(["run", *flags])
        assert build_config(args, "http://127.0.0.1:1", "m", None, None).trust_remote_code is expected
