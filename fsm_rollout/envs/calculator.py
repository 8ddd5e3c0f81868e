"""A tool-using, asynchronous environment: the model calls a calculator, then answers.

Each turn the model may call the ``calculator`` tool (Qwen/Hermes ``<tool_call>{"name": "calculator", "arguments":
{"expression": "..."}}</tool_call>``), several times per turn up to ``max_calls_per_turn``; every call's result
comes back as one ``tool`` message, all of a turn's results as one observation. A turn without a tool call is the
final answer: its ``\\boxed{}`` (else its last number) is compared with ``sample.label`` and the episode ends with
reward 1.0 or 0.0 in ``info["reward"]`` (so on ``sample.reward``). Running out of turns keeps the reward at 0.0.

The methods are coroutines; ``step`` awaits ``delay_s`` first, standing in for a sandbox or an API call, so a slow
step never blocks the event loop. Configure it with ``args.calculator_delay_s`` / ``args.calculator_max_calls`` or
``sample.metadata["calculator"] = {"delay_s": ..., "max_calls_per_turn": ...}``. Usable from ``fsm-rollout run
--env fsm_rollout.envs.calculator``.

Expressions are evaluated by walking their syntax tree: numbers, ``+ - * / // % **`` and parentheses only, with
bounded sizes, never ``eval``.
"""

from __future__ import annotations

import ast
import asyncio
import math
import operator
import re
from collections.abc import Callable
from typing import Any

from fsm_rollout.envs.geo3k import extract_boxed
from fsm_rollout.tokens.tool_calls import parse_tool_calls

TOOL_NAME = "calculator"
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": TOOL_NAME,
            "description": "Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses).",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. (3 + 4) * 12"}},
                "required": ["expression"],
            },
        },
    }
]
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e18

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class CalculatorError(ValueError):
    """An expression the calculator does not evaluate (the message goes back to the model)."""


def evaluate(expression: str) -> float | int:
    """The value of an arithmetic expression; :class:`CalculatorError` for anything else."""
    if not isinstance(expression, str) or not expression.strip():
        raise CalculatorError("the expression is empty")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise CalculatorError(f"not an arithmetic expression: {error.msg}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_value(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponents above {MAX_EXPONENT} are not evaluated")
        try:
            return _checked(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
    raise CalculatorError(f"{type(node).__name__} is not allowed: numbers, + - * / // % ** and parentheses only")


def _checked(value: Any) -> float | int:
    if isinstance(value, complex) or (isinstance(value, float) and not math.isfinite(value)):
        raise CalculatorError("the result is not a finite real number")
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError("the result is too large")
    return value  # type: ignore[no-any-return]


def _format(value: float | int) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


def final_answer(text: str) -> str | None:
    """The answer a turn gives: its ``\\boxed{}``, else its last number."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _same_number(answer: str, label: str) -> bool:
    try:
        return math.isclose(float(answer), float(label), rel_tol=1e-9, abs_tol=1e-9)
    except ValueError:
        return answer.strip() == label.strip()


class CalculatorEnv:
    """One sample's episode (see the module docstring)."""

    def __init__(self, *, sample: Any, label: str, max_turns: int, delay_s: float, max_calls_per_turn: int) -> None:
        self.sample = sample
        self.label = label
        self.max_turns = max_turns
        self.delay_s = delay_s
        self.max_calls_per_turn = max_calls_per_turn
        self.turns = 0
        self.calls = 0
        self.reward = 0.0

    async def reset(self) -> None:
        self.turns = 0
        self.calls = 0
        self.reward = 0.0

    async def step(self, response_text: str) -> tuple[Any, bool, dict[str, Any]]:
        if self.delay_s > 0:
            await asyncio.sleep(self.delay_s)
        self.turns += 1
        parsed = parse_tool_calls(response_text)
        if not parsed.calls and not parsed.problems:
            answer = final_answer(response_text)
            self.reward = 1.0 if answer is not None and _same_number(answer, self.label) else 0.0
            return [], True, {"reward": self.reward, "answer": answer, "turn": self.turns}
        results: list[dict[str, Any]] = []
        for index, call in enumerate(parsed.calls):
            call_id = f"call_{self.turns}_{index}"
            if index >= self.max_calls_per_turn:
                results.append(_result(call_id, f"error: at most {self.max_calls_per_turn} calls per turn"))
                continue
            self.calls += 1
            if call.name != TOOL_NAME:
                results.append(_result(call_id, f"error: unknown tool {call.name!r}; the tool is {TOOL_NAME!r}"))
                continue
            try:
                value = evaluate(call.arguments.get("expression", ""))
            except CalculatorError as error:
                results.append(_result(call_id, f"error: {error}"))
            else:
                results.append(_result(call_id, _format(value)))
        for problem in parsed.problems:
            results.append(_result(f"call_{self.turns}_bad", f"error: {problem.message}"))
        done = self.turns >= self.max_turns
        info: dict[str, Any] = {"turn": self.turns, "calls": len(parsed.calls)}
        if done:
            info["reward"] = self.reward
        return results, done, info

    async def format_observation(self, observation: Any) -> list[dict[str, Any]]:
        return list(observation)

    async def close(self) -> None:
        """Nothing to release."""

    def snapshot(self) -> dict[str, Any]:
        """The episode so far, for resuming a suspended sample in another process."""
        return {"turns": self.turns, "calls": self.calls, "reward": self.reward}

    def restore(self, state: dict[str, Any]) -> None:
        self.turns = int(state["turns"])
        self.calls = int(state["calls"])
        self.reward = float(state["reward"])


def _result(call_id: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "name": TOOL_NAME, "content": content}


def _setting(sample: Any, args: Any, key: str, attribute: str, default: Any) -> Any:
    metadata = getattr(sample, "metadata", None)
    settings = metadata.get("calculator") if isinstance(metadata, dict) else None
    if isinstance(settings, dict) and key in settings:
        return settings[key]
    return getattr(args, attribute, default)


async def build_env(*, sample: Any, args: Any) -> CalculatorEnv:
    """Build the calculator episode for ``sample`` (its ``label`` is the expected number); the tool schema is put in
    ``sample.metadata["tools"]`` unless the sample brings its own."""
    label = getattr(sample, "label", None)
    if label is None or not str(label).strip():
        raise CalculatorError("the calculator environment needs the expected answer in sample.label")
    max_turns = getattr(args, "max_turns", None)
    if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns <= 0:
        raise CalculatorError(
            f"the calculator environment needs args.max_turns as a positive integer; got {max_turns!r}"
        )
    delay_s = float(_setting(sample, args, "delay_s", "calculator_delay_s", 0.0))
    max_calls = int(_setting(sample, args, "max_calls_per_turn", "calculator_max_calls", 4))
    if delay_s < 0 or max_calls < 1:
        raise CalculatorError(f"delay_s must be >= 0 and max_calls_per_turn >= 1; got {delay_s}, {max_calls}")
    metadata = getattr(sample, "metadata", None)
    if isinstance(metadata, dict):
        metadata.setdefault("tools", TOOLS)
    return CalculatorEnv(
        sample=sample, label=str(label), max_turns=max_turns, delay_s=delay_s, max_calls_per_turn=max_calls
    )
