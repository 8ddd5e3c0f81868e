"""``loads_answer``: a large answer's long strings are lifted out before parsing, and the result equals orjson's."""

from __future__ import annotations

import base64
from typing import Any

import orjson
import pytest

from fsm_rollout.engine.schema import large_answers
from fsm_rollout.engine.schema.large_answers import LARGE_ANSWER_BYTES, LONG_STRING_BYTES, loads_answer


def _b64(size: int, seed: int) -> str:
    return base64.b64encode(bytes((index * 7 + seed) % 256 for index in range(size))).decode("ascii")


def _render_answer(items: int = 2, size: int = 300_000) -> dict[str, Any]:
    """A render answer shaped like vLLM's for images: long base64 items under ``features``."""
    return {
        "request_id": "r",
        "token_ids": list(range(400)),
        "features": {
            "mm_hashes": {"image": [f"h{index}" for index in range(items)]},
            "mm_placeholders": {"image": [{"offset": 10 + index, "length": 4} for index in range(items)]},
            "kwargs_data": {"image": [_b64(size, index) for index in range(items)]},
            "mm_metadata": {"image": ["small", None]},
        },
        "content_parts": [{"type": "text", "text": 'say "hi" \\ there'}],
        "sampling_params": {"temperature": 1.0, "stop": ['"', "\\"]},
        "model": "m",
    }


class _CountingParser:
    """Stands in for orjson in the module: records the size of every text parsed."""

    JSONDecodeError = orjson.JSONDecodeError

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def loads(self, raw: bytes) -> Any:
        self.sizes.append(len(raw))
        return orjson.loads(raw)

    def dumps(self, value: Any) -> bytes:
        return orjson.dumps(value)


@pytest.fixture
def parser(monkeypatch: pytest.MonkeyPatch) -> _CountingParser:
    counting = _CountingParser()
    monkeypatch.setattr(large_answers, "orjson", counting)
    return counting


def test_a_render_answer_with_long_feature_strings_is_parsed_without_them(parser: _CountingParser) -> None:
    answer = _render_answer()
    raw = orjson.dumps(answer)
    assert len(raw) > LARGE_ANSWER_BYTES

    assert loads_answer(raw) == answer

    assert len(parser.sizes) == 1 and parser.sizes[0] < 20_000  # the parser never walked the base64


def test_a_small_answer_is_parsed_whole(parser: _CountingParser) -> None:
    answer = _render_answer(items=1, size=1_000)
    raw = orjson.dumps(answer)
    assert loads_answer(raw) == answer
    assert parser.sizes == [len(raw)]


@pytest.mark.parametrize(
    "where",
    ["top level", "content parts", "a key", "escaped"],
)
def test_long_strings_it_does_not_lift_leave_the_answer_as_orjson_parses_it(where: str) -> None:
    answer = _render_answer()
    long_text = _b64(LONG_STRING_BYTES, 9)
    if where == "top level":
        answer["note"] = long_text
    elif where == "content parts":
        answer["content_parts"].append({"type": "text", "text": long_text})
    elif where == "a key":
        answer["features"]["mm_metadata"] = {long_text: 1}
    else:
        answer["features"]["kwargs_data"]["image"][0] = 'a"b\\c' + long_text + "\u00e9\n"
    raw = orjson.dumps(answer)
    assert loads_answer(raw) == orjson.loads(raw) == answer


def test_escaped_quotes_before_a_long_string_do_not_move_its_boundaries() -> None:
    answer = _render_answer()
    answer["content_parts"] = [{"text": '\\"' * 50 + '\\\\"' + "x"}, {"text": "\\" * 9}]
    raw = orjson.dumps(answer)
    assert loads_answer(raw) == answer


def test_non_ascii_long_strings_come_back_as_text(parser: _CountingParser) -> None:
    answer = _render_answer()
    answer["features"]["kwargs_data"]["image"][1] = "\u00e9\u4e2d" * LONG_STRING_BYTES
    raw = orjson.dumps(answer)
    assert loads_answer(raw) == answer
    assert len(parser.sizes) == 1 and parser.sizes[0] < 20_000


def test_a_long_string_that_is_not_utf8_is_refused_as_orjson_refuses_it() -> None:
    raw = orjson.dumps(_render_answer())
    cut = raw.index(b'"kwargs_data"') + 30
    broken = raw[:cut] + b"\xff" + raw[cut + 1 :]
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(broken)
    with pytest.raises(orjson.JSONDecodeError):
        loads_answer(broken)


@pytest.mark.parametrize("damage", ["truncated", "unterminated", "not an object"])
def test_text_that_is_not_json_raises_orjsons_error(damage: str) -> None:
    raw = orjson.dumps(_render_answer())
    if damage == "truncated":
        raw = raw[: len(raw) // 2]
    elif damage == "unterminated":
        raw = raw[: raw.rindex(b'"')]
    else:
        raw = b"[" + raw
    with pytest.raises(orjson.JSONDecodeError):
        loads_answer(raw)


def test_a_list_answer_is_parsed_whole(parser: _CountingParser) -> None:
    answer = [[{"role": "user"}], [{"prompt_token_ids": [1, 2], "features": {"x": [_b64(300_000, 1)]}}]]
    raw = orjson.dumps(answer)
    assert loads_answer(raw) == answer
    assert parser.sizes[-1] == len(raw)


def test_an_answer_with_many_strings_is_parsed_whole(parser: _CountingParser) -> None:
    answer = {"logprobs": [f"token_id:{index}" for index in range(large_answers.MAX_SCANNED_STRINGS + 10)]}
    answer["features"] = {"x": _b64(300_000, 2)}
    raw = orjson.dumps(answer)
    assert loads_answer(raw) == answer
    assert parser.sizes == [len(raw)]
