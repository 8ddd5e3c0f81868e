"""The built-in Geo3K environment: the model submits a geometry answer through a ``calc_score`` tool call.

Load it with ``--env fsm_rollout.envs.geo3k`` (or ``env_path="fsm_rollout.envs.geo3k"``); the module exposes
``build_env(*, sample, args)`` as the environment protocol (:mod:`fsm_rollout.envs.protocol`) asks.

**Building.** ``build_env`` takes the ground truth from ``sample.label`` and the turn limit from
``args.max_turns`` (a ``RolloutConfig`` or a slime/vime argument namespace). A missing or empty label, or a
missing, ``None`` or non-positive ``max_turns``, raises :class:`Geo3KSetupError` (a ``ValueError``) naming the
sample.

**The tool.** The model calls the scoring tool inside the text it generates::

    <tool_call>{"name": "calc_score", "arguments": {"answer": "12\\pi"}}</tool_call>

``calc_geo3k_reward`` is accepted as the same tool. ``arguments`` may also be a JSON string holding that object;
``answer`` may be a string or a number. Blocks are read by :func:`fsm_rollout.tokens.tool_calls.parse_tool_calls`. Only
the
**last** ``<tool_call>`` in a turn counts; an unclosed last ``<tool_call>`` (generation stopped on
``</tool_call>``) is read to the end of the text, and an unclosed one followed by another ``<tool_call>`` ends
where that one starts. LaTeX written with single backslashes inside the JSON (``"\\frac{1}{2}"`` as the model
usually writes it, which strict JSON would read as a form feed) is read as the LaTeX the model meant.

**Grading** (:func:`score_answer`, 1.0 or 0.0). Answer and label are both cleaned the same way: the last
``\\boxed{...}`` (or ``\\fbox``) is unwrapped; math delimiters (``$``, ``\\(``, ``\\[``), ``\\left``/``\\right``,
spacing commands and ``\\text{...}`` wrappers go; degree marks (``^\\circ``, ``^{\\circ}``, ``°``, ``degrees``)
and trailing units (``cm``, ``m``, ``units``, ``cm^2``, ``square units``, ...) are dropped; thousands separators
(``1,000`` and ``1{,}000``) are removed; of ``x = 5`` only the part after the last ``=`` is kept. If both sides
then read as numbers — digits with ``+ - * / ^``, parentheses, ``\\frac``/``\\dfrac``/``\\tfrac``, ``\\sqrt``
(with an optional ``[n]`` root), ``\\pi``/``π``, ``\\cdot``/``\\times`` and implied multiplication as in
``5\\sqrt{3}`` or ``12\\pi`` — they match when equal within a relative tolerance of 1e-4 or an absolute one of
1e-6 (so ``37.70`` matches ``12\\pi``). Otherwise they match when the cleaned strings are equal ignoring case
and whitespace.

**Steps.** ``step(text)`` returns ``(observation, done, info)``; the observation is a string:

* a usable tool call → ``"Correct (score 1.0). ..."`` (the model may stop and give its final answer in
  ``\\boxed{}`` without a tool call) or ``"Incorrect (score 0.0). Check your work and call calc_score again with
  a corrected answer."``; not done;
* an unsupported tool name, JSON that does not parse, or no ``answer`` argument → feedback naming the problem and
  showing the expected call format; not done, nothing scored;
* no tool call → done; a ``\\boxed{}`` answer in the text is scored as the final answer, otherwise the reward
  stays at the best score so far;
* the turn limit is the rollout's: a tool-call turn is never done, so after the ``max_turns``-th turn the rollout
  ends the sample ``truncated`` with reason ``max_turns`` (its tool call is still scored). The seed's environment
  said done there itself, which made a sample that used up its attempts look ``completed``.

A correct answer does not end the episode by itself: as in the seed's Geo3K environment, the episode ends on a
turn without a tool call or at the turn limit.

``info`` is ``{"turn": n, "answer": str | None, "score": float | None, "reward": float, "problem": str | None}``.

**Reward.** The best score of the episode (0.0 until something scores 1.0) is written to ``sample.reward`` as a
float on ``reset`` and on every step, together with ``sample.metadata["geo3k"] = {"turns": n, "scores": [...]}``
(steps taken, and one score per graded answer in order).

``format_observation`` returns ``{"role": "user", "content": [{"type": "text", "text": observation}]}``:
text only, as suffix-only rollouts require. ``close`` releases nothing.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from fsm_rollout.errors import ConfigError
from fsm_rollout.tokens.tool_calls import ToolCall, ToolCallProblem, parse_tool_calls

__all__ = [
    "TOOL_CALL_EXAMPLE",
    "TOOL_NAMES",
    "Geo3KEnv",
    "Geo3KSetupError",
    "answers_match",
    "build_env",
    "extract_boxed",
    "parse_number",
    "score_answer",
]

TOOL_NAMES = ("calc_score", "calc_geo3k_reward")
"""Tool names the environment scores; the first is the one prompts and feedback mention."""

TOOL_CALL_EXAMPLE = '<tool_call>{"name": "calc_score", "arguments": {"answer": "..."}}</tool_call>'
"""The call format shown to the model in feedback (and in the demo dataset's prompts)."""

RELATIVE_TOLERANCE = 1e-4
ABSOLUTE_TOLERANCE = 1e-6

CORRECT_FEEDBACK = (
    "Correct (score 1.0). You may stop here: reply with your final answer in \\boxed{} and no further tool call."
)
INCORRECT_FEEDBACK = "Incorrect (score 0.0). Check your work and call calc_score again with a corrected answer."


class Geo3KSetupError(ConfigError):
    """The Geo3K environment cannot be built for a sample: no label, or no usable ``max_turns``."""


# --------------------------------------------------------------------------------------------------------------
# Tool calls


class _BadToolCall(Exception):
    """A tool call the environment cannot score; the message is the feedback's first sentence."""


_LATEX_AFTER_BACKSLASHES = re.compile(r"(\\+)([A-Za-z]{2,})")
_HEX4 = re.compile(r"[0-9a-fA-F]{4}")


def _escape_latex_backslashes(text: str) -> str:
    """Double a lone backslash before a LaTeX command name so JSON keeps it (``\\frac`` is not a form feed)."""

    def escape(match: re.Match[str]) -> str:
        backslashes, letters = match.group(1), match.group(2)
        if len(backslashes) % 2 == 0:
            return match.group(0)  # already escaped
        if letters[0] == "u" and _HEX4.fullmatch(match.string, match.start(2) + 1, match.start(2) + 5):
            return match.group(0)  # a JSON \uXXXX escape
        return backslashes + "\\" + letters

    return _LATEX_AFTER_BACKSLASHES.sub(escape, text)


def _loads_json(text: str) -> Any:
    """Parse JSON, reading LaTeX backslashes as the model meant them; raises the strict parser's error."""
    try:
        return json.loads(_escape_latex_backslashes(text))
    except json.JSONDecodeError:
        return json.loads(text)


def _last_tool_call(text: str) -> ToolCall | ToolCallProblem | None:
    """The last ``<tool_call>`` block of ``text`` (an unclosed last one read to the end), or None."""
    blocks = parse_tool_calls(text, read_unclosed=True, loads=_loads_json).blocks
    return blocks[-1] if blocks else None


def _answer(block: ToolCall | ToolCallProblem) -> str:
    """The ``answer`` of the last tool call, or ``_BadToolCall`` saying what is wrong with the call."""
    if isinstance(block, ToolCallProblem):
        if block.kind in ("malformed_json", "not_an_object", "unclosed_tag"):
            raise _BadToolCall(block.message)
        if block.name not in TOOL_NAMES:  # the tool is named before its arguments are looked at
            raise _BadToolCall(f"Unsupported tool {block.name!r}; the only tool is calc_score.")
        if block.kind == "malformed_arguments":
            raise _BadToolCall(block.message)
        raise _BadToolCall(f'The {block.name} call has no "arguments" object with an "answer".')
    name = block.name
    if name not in TOOL_NAMES:
        raise _BadToolCall(f"Unsupported tool {name!r}; the only tool is calc_score.")
    if "arguments" not in block.payload:
        raise _BadToolCall(f'The {name} call has no "arguments" object with an "answer".')
    answer = block.arguments.get("answer")
    if isinstance(answer, int | float) and not isinstance(answer, bool):
        return str(answer)
    if not isinstance(answer, str) or not answer.strip():
        raise _BadToolCall(f'The {name} call is missing the "answer" argument.')
    return answer


# --------------------------------------------------------------------------------------------------------------
# Grading


def extract_boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced; else None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    opening = text.find("{", start)
    if opening < 0 or text[start:opening].strip() not in ("\\boxed", "\\fbox"):
        return None
    depth = 0
    for position in range(opening, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return text[opening + 1 : position]
    return None


_CLEANING_STEPS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\\[()\[\]]|\$"), " "),  # math delimiters
    (re.compile(r"\\(?:left|right|displaystyle)\b"), ""),
    (re.compile(r"\\[,;:! ]|~"), " "),  # spacing commands
    (re.compile(r"\\(?:text|textrm|textbf|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}"), r" \1 "),
    (re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|\\degree|°"), " "),  # degree marks
    (re.compile(r"\{,\}|(?<=\d),(?=\d{3}(?!\d))"), ""),  # thousands separators
)
_TRAILING_UNIT = re.compile(
    r"(?<=[\d}\s)π.])\s*(?:square\s+|sq\.?\s*)?"
    r"(?:cm|mm|km|m|in|inch|inches|ft|foot|feet|yd|yards?|units?|degrees?|deg)\.?"
    r"(?:\s*\^\s*\{?\s*[23]\s*\}?|²|³)?\s*$",
    re.IGNORECASE,
)


def _clean(text: str) -> str:
    """An answer or label with its wrapping, degree marks, units and separators removed (see the module doc)."""
    text = text.strip()
    boxed = extract_boxed(text)
    if boxed is not None:
        text = boxed
    for pattern, replacement in _CLEANING_STEPS:
        text = pattern.sub(replacement, text)
    text = text.rsplit("=", 1)[-1]
    previous = None
    while previous != text:
        previous, text = text, _TRAILING_UNIT.sub("", text)
    return " ".join(text.split()).rstrip(".").strip()


_NUMBER_TOKEN = re.compile(
    r"\s*(?:(?P<number>\d+(?:\.\d*)?|\.\d+)|(?P<command>\\[A-Za-z]+)|(?P<word>pi)|(?P<symbol>[-+*/^(){}\[\]π√\u00d7÷·]))"
)
_COMMANDS = {
    "\\frac": "frac",
    "\\dfrac": "frac",
    "\\tfrac": "frac",
    "\\sqrt": "sqrt",
    "\\pi": "pi",
    "\\cdot": "*",
    "\\times": "*",
    "\\div": "/",
}
_SYMBOLS = {"π": "pi", "√": "root", "\u00d7": "*", "·": "*", "÷": "/"}
_STARTS_FACTOR = frozenset({"pi", "frac", "sqrt", "root", "(", "{"})


class _NotANumber(Exception):
    """The text is not an arithmetic expression this grader evaluates."""


def _number_tokens(text: str) -> list[str]:
    tokens: list[str] = []
    position = 0
    text = text.rstrip()
    while position < len(text):
        match = _NUMBER_TOKEN.match(text, position)
        if match is None:
            raise _NotANumber(text)
        position = match.end()
        if match.group("number") is not None:
            tokens.append(match.group("number"))
        elif match.group("command") is not None:
            command = _COMMANDS.get(match.group("command"))
            if command is None:
                raise _NotANumber(text)
            tokens.append(command)
        elif match.group("word") is not None:
            tokens.append("pi")
        else:
            symbol = match.group("symbol")
            tokens.append(_SYMBOLS.get(symbol, symbol))
    return tokens


class _ExpressionReader:
    """Recursive-descent evaluation of the LaTeX arithmetic subset described in the module docstring."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens
        self.position = 0

    def read(self) -> float:
        value = self.expression()
        if self.position != len(self.tokens):
            raise _NotANumber(" ".join(self.tokens))
        return value

    def peek(self) -> str | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if token is None or (expected is not None and token != expected):
            raise _NotANumber(" ".join(self.tokens))
        self.position += 1
        return token

    def expression(self) -> float:
        value = self.term()
        while self.peek() in ("+", "-"):
            value = value + self.term() if self.take() == "+" else value - self.term()
        return value

    def term(self) -> float:
        value = self.signed()
        while True:
            token = self.peek()
            if token in ("*", "/"):
                self.take()
                operand = self.signed()
                value = value * operand if token == "*" else value / operand
            elif token in _STARTS_FACTOR:
                value *= self.signed()  # implied multiplication: 5\sqrt{3}, 12\pi, 2(3)
            else:
                return value

    def signed(self) -> float:
        if self.peek() in ("+", "-"):
            return -self.signed() if self.take() == "-" else self.signed()
        base = self.primary()
        if self.peek() == "^":
            self.take()
            return math.pow(base, self.signed())
        return base

    def primary(self) -> float:
        token = self.take()
        if token[0].isdigit() or token[0] == ".":
            return float(token)
        if token == "pi":
            return math.pi
        if token in ("(", "{"):
            value = self.expression()
            self.take(")" if token == "(" else "}")
            return value
        if token == "frac":
            numerator = self.argument()
            return numerator / self.argument()
        if token == "sqrt":
            degree = 2.0
            if self.peek() == "[":
                self.take()
                degree = self.expression()
                self.take("]")
            return math.pow(self.argument(), 1.0 / degree)
        if token == "root":
            return math.sqrt(self.signed())
        raise _NotANumber(" ".join(self.tokens))

    def argument(self) -> float:
        """A command argument: a braced group, or a single character as in ``\\frac12``."""
        token = self.peek()
        if token is not None and token[0].isdigit() and len(token) > 1:
            self.tokens[self.position] = token[1:]
            return float(token[0])
        return self.primary()


def parse_number(text: str) -> float | None:
    """The value of a cleaned answer such as ``5\\sqrt{3}``, ``\\frac{3}{4}`` or ``12\\pi``; None if not numeric."""
    try:
        value = _ExpressionReader(_number_tokens(text)).read()
    except (_NotANumber, ArithmeticError, ValueError):
        return None
    return value if math.isfinite(value) else None


def answers_match(answer: str, label: str) -> bool:
    """Whether ``answer`` equals ``label`` after cleaning: numerically within tolerance, else as text."""
    cleaned_answer, cleaned_label = _clean(answer), _clean(label)
    if not cleaned_answer:
        return False
    answer_value, label_value = parse_number(cleaned_answer), parse_number(cleaned_label)
    if answer_value is not None and label_value is not None:
        return math.isclose(answer_value, label_value, rel_tol=RELATIVE_TOLERANCE, abs_tol=ABSOLUTE_TOLERANCE)
    return "".join(cleaned_answer.lower().split()) == "".join(cleaned_label.lower().split())


def score_answer(answer: str, label: str) -> float:
    """1.0 when ``answer`` matches ``label`` (see :func:`answers_match`), else 0.0."""
    return 1.0 if answers_match(answer, label) else 0.0


# --------------------------------------------------------------------------------------------------------------
# The environment


def _describe(sample: Any) -> str:
    return f"sample index={getattr(sample, 'index', None)} session_id={getattr(sample, 'session_id', None)}"


class Geo3KEnv:
    """One sample's Geo3K episode: scores tool-call answers against ``label`` for at most ``max_turns`` steps."""

    def __init__(self, *, sample: Any, label: str, max_turns: int) -> None:
        self.sample = sample
        self.label = label
        self.max_turns = max_turns
        self.turns = 0
        self.scores: list[float] = []

    @property
    def reward(self) -> float:
        """The best score of the episode so far (0.0 before anything scored)."""
        return max(self.scores, default=0.0)

    def reset(self) -> None:
        """Start the episode over and write the empty reward and metadata to the sample."""
        self.turns = 0
        self.scores = []
        self._write_reward()

    def step(self, response_text: str) -> tuple[str, bool, dict[str, Any]]:
        """Score the turn's last tool call (or its final boxed answer) and say what to do next."""
        self.turns += 1
        answer: str | None = None
        score: float | None = None
        problem: str | None = None
        block = _last_tool_call(response_text)
        if block is None:
            answer = extract_boxed(response_text)
            if answer is not None:
                score = self._score(answer)
                observation = f"No tool call; the final answer {answer} scored {score}."
            else:
                observation = f"No tool call and no \\boxed{{}} answer; the reward stays {self.reward}."
            done = True
        else:
            try:
                answer = _answer(block)
            except _BadToolCall as error:
                problem = str(error)
                observation = f"{problem} Call the tool as {TOOL_CALL_EXAMPLE}"
            else:
                score = self._score(answer)
                observation = CORRECT_FEEDBACK if score == 1.0 else INCORRECT_FEEDBACK
            done = False  # the rollout's turn limit ends the episode (truncated/max_turns)
        self._write_reward()
        info = {"turn": self.turns, "answer": answer, "score": score, "reward": self.reward, "problem": problem}
        return observation, done, info

    def format_observation(self, observation: Any) -> dict[str, Any]:
        """The observation as a text-only user message."""
        return {"role": "user", "content": [{"type": "text", "text": str(observation)}]}

    def close(self) -> None:
        """Nothing to release."""

    def snapshot(self) -> dict[str, Any]:
        """The episode so far as plain JSON, for resuming a suspended sample in another process."""
        return {"turns": self.turns, "scores": list(self.scores)}

    def restore(self, state: Any) -> None:
        """Continue the episode a :meth:`snapshot` describes (instead of :meth:`reset`)."""
        if (
            not isinstance(state, dict)
            or not isinstance(state.get("turns"), int)
            or not isinstance(state.get("scores"), list)
        ):
            raise Geo3KSetupError(f"{_describe(self.sample)}: a Geo3K snapshot is {{turns, scores}}; got {state!r}")
        self.turns = state["turns"]
        self.scores = [float(score) for score in state["scores"]]
        self._write_reward()

    def _score(self, answer: str) -> float:
        score = score_answer(answer, self.label)
        self.scores.append(score)
        return score

    def _write_reward(self) -> None:
        self.sample.reward = self.reward
        if getattr(self.sample, "metadata", None) is None:
            self.sample.metadata = {}
        self.sample.metadata["geo3k"] = {"turns": self.turns, "scores": list(self.scores)}


def build_env(*, sample: Any, args: Any) -> Geo3KEnv:
    """Build the Geo3K environment for ``sample`` (needs ``sample.label``) with ``args.max_turns`` steps at most."""
    label = getattr(sample, "label", None)
    if label is None or not str(label).strip():
        raise Geo3KSetupError(
            f"{_describe(sample)}: the Geo3K environment needs the ground-truth answer in sample.label; got {label!r}"
        )
    max_turns = getattr(args, "max_turns", None)
    if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns <= 0:
        raise Geo3KSetupError(
            f"{_describe(sample)}: the Geo3K environment needs args.max_turns as a positive integer; got {max_turns!r}"
        )
    return Geo3KEnv(sample=sample, label=str(label), max_turns=max_turns)
