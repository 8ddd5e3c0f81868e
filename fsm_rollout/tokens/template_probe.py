"""The start-up template probe: what a chat template does to a rollout's history, and which history policy fits.

:func:`probe_template` renders made-up conversations the way a rollout builds them and reports, for each
observation role (``user``, ``tool``):

* **cuttable**: whether the observation boundary can be cut from the template with the dummy-prefix method that the
  ``append`` policy uses (:class:`~fsm_rollout.tokens.chat.ObservationEncoder`): the template must render the dummy
  prefix the same with the observation after it. Where it cannot, ``append`` fails at every observation.
* **stable**: whether the template, given the conversation so far plus the observation, renders exactly the tokens the
  rollout holds (prompt, generated turns, boundaries). Each role is probed with turns that reason and turns that do
  not, written as a model writes them after the template's generation prompt: after an open ``<think>\\n`` a
  reasoning turn is ``reasoning</think>\\n\\nanswer`` and a turn that did not reason is ``\\n</think>\\n\\nanswer``;
  after a pre-filled empty block (thinking switched off) a turn is the answer alone; otherwise a reasoning turn
  brings its own ``<think>`` block. Where a template is not stable the report names the first differing token, with
  decoded context on both sides.

A role whose boundary cannot be cut is still probed for stability: its conversations are built with boundaries cut
at the EOS that closes the dummy assistant turn (the template rewrote what came before it).

:func:`choose_history_policy` turns a report and the requested ``history_policy`` into the policy a run uses.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import structlog

from fsm_rollout.errors import ConfigError, TemplateError, TemplateNotPrefixStable
from fsm_rollout.sample import Sample
from fsm_rollout.tokens.chat import (
    DUMMY_PREFIXES,
    PROBE_OBSERVATIONS,
    PROBE_QUESTION,
    ObservationEncoder,
    observation_shape,
    render_key,
    template_identity,
)
from fsm_rollout.tokens.parity import ParityReport, check_template_parity, record_observation, template_token_ids
from fsm_rollout.types import TokenIds

__all__ = [
    "HISTORY_POLICIES",
    "PROBE_ROLES",
    "PROBE_TOOLS",
    "AppendRefused",
    "ConversationFinding",
    "Difference",
    "HistoryPolicy",
    "HistoryPolicyChooser",
    "RoleFinding",
    "TemplateReport",
    "choose_history_policy",
    "probe_template",
]

logger = logging.getLogger(__name__)

HistoryPolicy = Literal["append", "fork", "per_turn", "auto"]
HISTORY_POLICIES: Final[tuple[str, ...]] = ("append", "fork", "per_turn", "auto")
PROBE_ROLES: Final[tuple[str, ...]] = ("user", "tool")
"""The observation roles the probe checks."""

PROBE_TOOLS: Final[tuple[dict[str, Any], ...]] = (
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    },
)
"""The tools the ``tool`` role is probed with when none are given."""

_REASONING: Final = {"user": "Six sevens are forty-two.", "tool": "I will check both products with the tool."}
_ANSWER: Final = {
    "user": "The answer is 42.",
    "tool": (
        '<tool_call>\n{"name": "calc", "arguments": {"expression": "6*7"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "calc", "arguments": {"expression": "7*6"}}\n</tool_call>'
    ),
}
CONTEXT_CHARS: Final = 80
"""Characters of decoded context kept on each side of a difference."""


class AppendRefused(TemplateError):
    """``history_policy="append"`` was asked for, but the template's observation boundary cannot be cut."""


@dataclass(frozen=True, slots=True)
class Difference:
    """The first token where the template's rendering departs from what the rollout holds."""

    position: int
    """Index in the rollout's tokens (its length when they end first)."""
    where: str
    """The part of the conversation it is in: ``the prompt``, ``assistant turn N``, ``observation N``, ..."""
    before: str
    """Decoded tokens just before it (the same on both sides)."""
    held: str
    """Decoded tokens the rollout holds from there on."""
    rendered: str
    """Decoded tokens the template renders from there on."""

    def describe(self) -> str:
        return (
            f"token {self.position} (in {self.where}): after {self.before!r} the rollout holds {self.held!r} "
            f"where the template renders {self.rendered!r}"
        )


@dataclass(frozen=True, slots=True)
class ConversationFinding:
    """One probe conversation of a role: its turns reason (``thinking``) or not (``no_thinking``)."""

    variant: Literal["thinking", "no_thinking"]
    turn: str
    """The text of each generated turn."""
    difference: Difference | None = None

    @property
    def stable(self) -> bool:
        return self.difference is None


@dataclass(frozen=True, slots=True)
class RoleFinding:
    """What the probe found for one observation role."""

    role: str
    cuttable: bool
    cut_problem: str | None = None
    """Why the boundary cannot be cut (``None`` when it can)."""
    conversations: tuple[ConversationFinding, ...] = ()

    @property
    def stable(self) -> bool:
        """The template writes every probe conversation of this role as the rollout holds it."""
        return bool(self.conversations) and all(finding.stable for finding in self.conversations)

    def describe(self) -> str:
        parts = [f"{self.role} observations:"]
        parts.append("boundary can be cut;" if self.cuttable else f"boundary cannot be cut ({self.cut_problem});")
        if not self.conversations:
            parts.append("history not probed")
        for finding in self.conversations:
            if finding.difference is None:
                parts.append(f"{finding.variant} turns: history written as the rollout holds it;")
            else:
                parts.append(f"{finding.variant} turns: history rewritten at {finding.difference.describe()};")
        return " ".join(parts).rstrip(";")


@dataclass(frozen=True, slots=True)
class TemplateReport:
    """What :func:`probe_template` found, per observation role."""

    template: str
    """The template's identity (tokenizer name and a hash of the template text)."""
    template_kwargs: Mapping[str, Any]
    tools: tuple[str, ...]
    """Names of the tools the probe rendered with."""
    generation_prompt: Literal["plain", "open_think", "closed_think"]
    """How the generation prompt ends: as is, inside an open ``<think>`` block, or after an empty closed one."""
    roles: Mapping[str, RoleFinding] = field(default_factory=dict)

    def stable_for(self, roles: Sequence[str]) -> bool:
        return all(self.roles[role].stable for role in roles)

    def cuttable_for(self, roles: Sequence[str]) -> bool:
        return all(self.roles[role].cuttable for role in roles)

    def describe(self, roles: Sequence[str] | None = None) -> str:
        chosen = list(roles) if roles is not None else list(self.roles)
        findings = "; ".join(self.roles[role].describe() for role in chosen)
        return f"chat template {self.template} with {dict(self.template_kwargs)}: {findings}"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (for traces)."""
        return {
            "template": self.template,
            "template_kwargs": dict(self.template_kwargs),
            "tools": list(self.tools),
            "generation_prompt": self.generation_prompt,
            "roles": {
                name: {
                    "cuttable": finding.cuttable,
                    "cut_problem": finding.cut_problem,
                    "stable": finding.stable,
                    "differences": {
                        conversation.variant: conversation.difference.describe()
                        for conversation in finding.conversations
                        if conversation.difference is not None
                    },
                }
                for name, finding in self.roles.items()
            },
        }


def probe_template(
    tokenizer: Any,
    tools: Sequence[Mapping[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    *,
    roles: Sequence[str] = PROBE_ROLES,
) -> TemplateReport:
    """Probe ``tokenizer``'s chat template (see the module docstring).

    ``tokenizer`` needs ``apply_chat_template``, ``encode``, ``decode`` and an integer ``eos_token_id``. ``tools``
    are rendered as a rollout with them would; the ``tool`` role is probed with :data:`PROBE_TOOLS` when none are
    given. A template that cannot render the probe's prompt at all raises a
    :class:`~fsm_rollout.errors.TemplateError` naming it.
    """
    unknown = [role for role in roles if role not in PROBE_ROLES]
    if unknown:
        raise ValueError(f"unknown observation role(s) {unknown}; the probe knows {list(PROBE_ROLES)}")
    missing = [
        name for name in ("apply_chat_template", "encode", "decode") if not callable(getattr(tokenizer, name, None))
    ]
    if missing:
        raise TemplateError(f"the template probe needs tokenizer.{' and tokenizer.'.join(missing)}")
    kwargs = dict(template_kwargs or {})
    encoder = ObservationEncoder(tokenizer)
    if encoder.eos_token_id is None:
        raise TemplateError("tokenizer.eos_token_id must be an integer (the chat turn terminator)")
    identity = template_identity(tokenizer)
    given = [dict(tool) for tool in tools] if tools else None
    generation = _generation_prompt(tokenizer, given, kwargs, identity)
    findings = {}
    for role in roles:
        role_tools = given if given or role != "tool" else [dict(tool) for tool in PROBE_TOOLS]
        findings[role] = _probe_role(encoder, role, role_tools, kwargs, generation)
    names = tuple(str((tool.get("function") or tool).get("name", "?")) for tool in given or ())
    return TemplateReport(identity, kwargs, names, generation, findings)


def choose_history_policy(report: TemplateReport, requested: str, roles: Sequence[str]) -> str:
    """The history policy a run uses, given the probe's report and the roles its environment observes in.

    ``"auto"`` is ``"append"`` when the template writes history as the rollout holds it and the boundary can be cut
    for every role in ``roles``, ``"fork"`` otherwise. ``"append"`` stays ``"append"`` on a template that rewrites
    history (the model is trained on what it saw; the caller warns once) but raises :class:`AppendRefused` where the
    boundary cannot be cut. ``"fork"`` and ``"per_turn"`` re-render and need no boundary.
    """
    if requested not in HISTORY_POLICIES:
        raise ConfigError(f"history_policy must be one of {list(HISTORY_POLICIES)}, got {requested!r}")
    unknown = [role for role in roles if role not in report.roles]
    if unknown:
        raise ValueError(f"the report has no finding for role(s) {unknown}")
    if requested == "auto":
        fits = report.stable_for(roles) and report.cuttable_for(roles)
        return "append" if fits else "fork"
    if requested == "append" and not report.cuttable_for(roles):
        raise AppendRefused(
            f"history_policy='append' cannot run: {report.describe(roles)}. Append cuts each observation's "
            "boundary tokens from the template with a dummy conversation, which this template renders differently "
            "once the observation follows it; use history_policy='fork' or 'per_turn' (or 'auto')"
        )
    return requested


# ------------------------------------------------------------------------------------------------ internals


def _render(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Any,
    kwargs: Mapping[str, Any],
    *,
    generation: bool,
    what: str,
) -> TokenIds:
    return template_token_ids(
        tokenizer.apply_chat_template(
            [dict(message) for message in messages],
            tools=tools,
            tokenize=True,
            add_generation_prompt=generation,
            **kwargs,
        ),
        what=what,
    )


def _prompt_messages() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": PROBE_QUESTION},
    ]


def _generation_prompt(
    tokenizer: Any, tools: Any, kwargs: Mapping[str, Any], identity: str
) -> Literal["plain", "open_think", "closed_think"]:
    try:
        with_prompt = _render(tokenizer, _prompt_messages(), tools, kwargs, generation=True, what="probe prompt")
        without = _render(tokenizer, _prompt_messages(), tools, kwargs, generation=False, what="probe prompt")
    except TemplateError:
        raise
    except Exception as error:  # the template raised on a system and a user message
        raise TemplateError(
            f"chat template {identity} cannot render a prompt: {type(error).__name__}: {error}"
        ) from error
    common = 0
    while common < min(len(with_prompt), len(without)) and with_prompt[common] == without[common]:
        common += 1
    tail = str(tokenizer.decode(with_prompt[common:])).rstrip(" ")
    if tail.rstrip().endswith("</think>"):
        return "closed_think"
    if tail.endswith("<think>\n") or tail.endswith("<think>"):
        return "open_think"
    return "plain"


def _turns(role: str, generation: str) -> list[tuple[Literal["thinking", "no_thinking"], str]]:
    reasoning, answer = _REASONING[role], _ANSWER[role]
    if generation == "closed_think":  # thinking is switched off: the prompt closed an empty block already
        return [("no_thinking", answer)]
    if generation == "open_think":
        return [("thinking", f"{reasoning}\n</think>\n\n{answer}"), ("no_thinking", f"\n</think>\n\n{answer}")]
    return [("thinking", f"<think>\n{reasoning}\n</think>\n\n{answer}"), ("no_thinking", answer)]


def _probe_role(
    encoder: ObservationEncoder, role: str, tools: Any, kwargs: Mapping[str, Any], generation: str
) -> RoleFinding:
    observation = [dict(message) for message in PROBE_OBSERVATIONS[role]]
    cut_problem: str | None = None
    try:
        encoder.encode(observation, ends_with_eos=True, tools=tools, template_kwargs=kwargs)
    except TemplateNotPrefixStable:
        cut_problem = _dummy_prefix_difference(encoder, role, observation, tools, kwargs)
    except TemplateError as error:
        cut_problem = str(error)
    except Exception as error:  # the template raised on this role
        return RoleFinding(role, False, f"the template cannot render it: {type(error).__name__}: {error}")
    try:
        boundary = (
            encoder.encode(observation, ends_with_eos=True, tools=tools, template_kwargs=kwargs)
            if cut_problem is None
            else _boundary_after_rewrite(encoder, observation, tools, kwargs)
        )
    except TemplateError as error:
        return RoleFinding(role, False, cut_problem or str(error))
    conversations = tuple(
        _conversation(encoder, variant, turn, observation, boundary, tools, kwargs)
        for variant, turn in _turns(role, generation)
    )
    return RoleFinding(role, cut_problem is None, cut_problem, conversations)


def _dummy_prefix_difference(
    encoder: ObservationEncoder, role: str, observation: list[dict[str, Any]], tools: Any, kwargs: Mapping[str, Any]
) -> str:
    """Where the dummy prefix renders differently once the observation follows it."""
    tokenizer = encoder.tokenizer
    shape = observation_shape(observation)
    prefix = _render(tokenizer, DUMMY_PREFIXES[shape], tools, kwargs, generation=False, what="dummy prefix")
    full = _render(
        tokenizer, [*DUMMY_PREFIXES[shape], *observation], tools, kwargs, generation=True, what="observation"
    )
    index = next((i for i, (a, b) in enumerate(zip(prefix, full, strict=False)) if a != b), min(len(prefix), len(full)))
    return (
        f"the dummy prefix renders differently with a {role} observation after it, at token {index}: after "
        f"{_tail(tokenizer, prefix[:index])!r} it renders {_head(tokenizer, prefix[index:])!r} alone but "
        f"{_head(tokenizer, full[index:])!r} with the observation"
    )


def _boundary_after_rewrite(
    encoder: ObservationEncoder, observation: list[dict[str, Any]], tools: Any, kwargs: Mapping[str, Any]
) -> TokenIds:
    """The boundary (after the closing EOS) cut at the EOS that closes the dummy assistant turn, for a template that
    rewrote the dummy prefix: the prefix's EOS count locates it."""
    tokenizer, eos = encoder.tokenizer, encoder.eos_token_id
    assert eos is not None  # probe_template checked it
    shape = observation_shape(observation)
    prefix = _render(tokenizer, DUMMY_PREFIXES[shape], tools, kwargs, generation=False, what="dummy prefix")
    full = _render(
        tokenizer, [*DUMMY_PREFIXES[shape], *observation], tools, kwargs, generation=True, what="observation"
    )
    closing = prefix.count(eos)
    positions = [index for index, token in enumerate(full) if token == eos]
    if closing == 0 or len(positions) < closing:
        raise TemplateError("the template's rendering with the observation lacks the EOS closing the assistant turn")
    return full[positions[closing - 1] + 1 :]


def _conversation(
    encoder: ObservationEncoder,
    variant: Literal["thinking", "no_thinking"],
    turn_text: str,
    observation: list[dict[str, Any]],
    boundary: TokenIds,
    tools: Any,
    kwargs: Mapping[str, Any],
) -> ConversationFinding:
    """Prompt, turn, observation, turn, observation, as a rollout appends them; then the template's rendering of the
    whole conversation (which ends with the generation prompt) is compared with those tokens."""
    tokenizer, eos = encoder.tokenizer, encoder.eos_token_id
    assert eos is not None  # probe_template checked it
    prompt = _prompt_messages()
    sample = Sample(prompt=prompt, metadata={"tools": list(tools)} if tools else {})
    sample.tokens = _render(tokenizer, prompt, tools, kwargs, generation=True, what="probe prompt")
    turn = [*tokenizer.encode(turn_text, add_special_tokens=False), eos]
    for _ in range(2):
        sample.append_response_tokens(turn, [0.0] * len(turn), trainable=True)
        start = sample.response_length
        sample.append_response_tokens(list(boundary), trainable=False)
        record_observation(sample.metadata, observation, start=start, end=sample.response_length)
    try:
        report = check_template_parity(sample, tokenizer, tools=tools, template_kwargs=kwargs)
    except TemplateError:
        raise
    except Exception as error:
        raise TemplateError(
            f"the template cannot render the probe conversation: {type(error).__name__}: {error}"
        ) from error
    return ConversationFinding(variant, turn_text, None if report.ok else _difference(report))


def _difference(report: ParityReport) -> Difference:
    return Difference(
        position=report.position if report.position is not None else report.sample_length,
        where=report.segment or "the end",
        before=report.before,
        held=report.sample_text,
        rendered=report.rendered_text,
    )


def _tail(tokenizer: Any, tokens: TokenIds) -> str:
    return str(tokenizer.decode(tokens[-12:]))[-CONTEXT_CHARS:]


def _head(tokenizer: Any, tokens: TokenIds) -> str:
    return str(tokenizer.decode(tokens[:12]))[:CONTEXT_CHARS]


# ------------------------------------------------------------------------------------------------ at start-up


class HistoryPolicyChooser:
    """Probes a tokenizer's template once per tool set and resolves the requested history policy for it.

    Each resolution is traced as one structlog event ``template_probe`` (the report's summary and the policy). A
    template that rewrites history under ``"append"`` is logged as a warning once (the first time; every finding is
    traced);
    :class:`AppendRefused` is raised where append cannot cut the boundary. The roles probed are ``user``, and
    ``tool`` too when the tool set is not empty.
    """

    def __init__(self, requested: str, template_kwargs: Mapping[str, Any] | None = None) -> None:
        if requested not in HISTORY_POLICIES:
            raise ConfigError(f"history_policy must be one of {list(HISTORY_POLICIES)}, got {requested!r}")
        self.requested = requested
        self.template_kwargs = dict(template_kwargs or {})
        self._resolved: dict[bytes, str] = {}
        self._warned = False

    def resolve(self, tokenizer: Any, tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The policy for rollouts with ``tools`` (probing the template the first time this tool set is seen)."""
        # the tools as given: templates write their keys in that order, so another order may render otherwise
        key = template_identity(tokenizer).encode() + b"\x00" + render_key(tools or None, None)
        known = self._resolved.get(key)
        if known is not None:
            return known
        roles = ("user", "tool") if tools else ("user",)
        report = probe_template(tokenizer, tools, self.template_kwargs, roles=roles)
        # structlog's processors (the user's, if configured) on top of this module's stdlib logger: nothing is
        # printed unless the host asks for it
        event = structlog.wrap_logger(logger)
        try:
            policy = choose_history_policy(report, self.requested, roles)
        except AppendRefused as error:
            event.info("template_probe", requested=self.requested, policy=None, refused=str(error), **report.to_dict())
            raise
        event.info("template_probe", requested=self.requested, policy=policy, **report.to_dict())
        if policy == "append" and not report.stable_for(roles) and not self._warned:
            self._warned = True  # once: samples may each bring a tool set of their own
            logger.warning(
                "history_policy=%r on a template that rewrites history: the model is trained on the tokens it saw, "
                "but deployment will show it a different history. %s",
                self.requested,
                report.describe(roles),
            )
        self._resolved[key] = policy
        return policy
