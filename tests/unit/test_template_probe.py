"""The start-up template probe over real thinking templates, and the history policy it chooses.

Each expected finding follows from what the template text does (the comments say which line of it); the
probe must find it by rendering, for every shipped template, observation role and thinking switch.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any

import pytest
from structlog.testing import capture_logs

import fsm_rollout
from fsm_rollout.errors import ConfigError, TemplateError
from fsm_rollout.testing.chat_templates import CHAT_TEMPLATE_NAMES, chat_template, tokenizer_with_chat_template
from fsm_rollout.testing.qwen3_6_tokenizer import load_qwen3_6_tokenizer
from fsm_rollout.testing.templates import (
    MINIMAL_CHATML_TEMPLATE,
    THINK_STRIPPING_CHAT_TEMPLATE,
    qwen_tokenizer_with_template,
)
from fsm_rollout.tokens.template_probe import (
    PROBE_TOOLS,
    AppendRefused,
    HistoryPolicyChooser,
    TemplateReport,
    choose_history_policy,
    probe_template,
)

OFF: Mapping[str, Any] = {"enable_thinking": False}
PRESERVE: Mapping[str, Any] = {"preserve_thinking": True}
SWITCHES: Mapping[str, Mapping[str, Any]] = {"default": {}, "thinking_off": OFF, "preserve_thinking": PRESERVE}

TH, NO = "thinking", "no_thinking"
# (template, switches) -> generation prompt, then per role: (boundary cuttable, {variant: stable})
Finding = tuple[bool, dict[str, bool]]
EXPECTED: dict[tuple[str, str], tuple[str, dict[str, Finding]]] = {
    # Qwen3: the last assistant message after the query gets a <think> block even when empty, so the dummy prefix
    # changes once anything follows it (no cut for either role); turns at or before the last user query lose
    # their thinking (user role), turns after it keep non-empty thinking (tool role).
    ("qwen3", "default"): (
        "plain",
        {"user": (False, {TH: False, NO: True}), "tool": (False, {TH: True, NO: True})},
    ),
    # enable_thinking=false pre-fills '<think>\n\n</think>\n\n'; history never writes an empty block back.
    ("qwen3", "thinking_off"): (
        "closed_think",
        {"user": (False, {NO: False}), "tool": (False, {NO: False})},
    ),
    # Qwen3 has no preserve_thinking switch: the same as by default.
    ("qwen3", "preserve_thinking"): (
        "plain",
        {"user": (False, {TH: False, NO: True}), "tool": (False, {TH: True, NO: True})},
    ),
    # Qwen3.5 opens '<think>\n'; history writes '<think>\n' + reasoning + '\n</think>\n\n' after the last query
    # only: the user role loses it, the tool role keeps it, and a turn that did not reason comes back as a closed
    # empty block whose '\n\n' is one token where the rollout holds two.
    ("qwen3_5", "default"): (
        "open_think",
        {"user": (False, {TH: False, NO: False}), "tool": (True, {TH: True, NO: False})},
    ),
    ("qwen3_5", "thinking_off"): (
        "closed_think",
        {"user": (False, {NO: False}), "tool": (True, {NO: True})},
    ),
    ("qwen3_5", "preserve_thinking"): (
        "open_think",
        {"user": (False, {TH: False, NO: False}), "tool": (True, {TH: True, NO: False})},
    ),
    ("qwen3_6", "default"): (
        "open_think",
        {"user": (False, {TH: False, NO: False}), "tool": (True, {TH: True, NO: False})},
    ),
    ("qwen3_6", "thinking_off"): (
        "closed_think",
        {"user": (False, {NO: False}), "tool": (True, {NO: True})},
    ),
    # preserve_thinking keeps every turn's block: reasoning turns are stable in both roles and the user boundary
    # can be cut; a turn that did not reason still merges whitespace.
    ("qwen3_6", "preserve_thinking"): (
        "open_think",
        {"user": (True, {TH: True, NO: False}), "tool": (True, {TH: True, NO: False})},
    ),
    # Qwen3.8 keeps a block on every turn but reads reasoning from reasoning_content only: a turn's text after the
    # open '<think>\n' comes back after a closed empty block, whether it reasoned or not.
    ("qwen3_8", "default"): (
        "open_think",
        {"user": (True, {TH: False, NO: False}), "tool": (True, {TH: False, NO: False})},
    ),
    # thinking off: the pre-filled empty block is exactly what history writes.
    ("qwen3_8", "thinking_off"): (
        "closed_think",
        {"user": (True, {NO: True}), "tool": (True, {NO: True})},
    ),
    ("qwen3_8", "preserve_thinking"): (
        "open_think",
        {"user": (True, {TH: False, NO: False}), "tool": (True, {TH: False, NO: False})},
    ),
    # keeps thinking on tool-call turns only: the user role's reasoning turns lose it.
    ("tool_call_thinking", "default"): (
        "plain",
        {"user": (True, {TH: False, NO: True}), "tool": (True, {TH: True, NO: True})},
    ),
    ("tool_call_thinking", "thinking_off"): (
        "plain",
        {"user": (True, {TH: False, NO: True}), "tool": (True, {TH: True, NO: True})},
    ),
    ("tool_call_thinking", "preserve_thinking"): (
        "plain",
        {"user": (True, {TH: False, NO: True}), "tool": (True, {TH: True, NO: True})},
    ),
}  # fmt: skip


@functools.cache
def shipped(name: str) -> Any:
    return tokenizer_with_chat_template(name)


@functools.cache
def probed(name: str, switches: str) -> TemplateReport:
    return probe_template(shipped(name), template_kwargs=SWITCHES[switches])


def test_every_shipped_template_and_switch_has_an_expected_finding() -> None:
    assert set(EXPECTED) == {(name, switches) for name in CHAT_TEMPLATE_NAMES for switches in SWITCHES}


@pytest.mark.parametrize(("name", "switches"), sorted(EXPECTED))
def test_the_probe_finds_what_each_template_does_per_role_and_switch(name: str, switches: str) -> None:
    report = probed(name, switches)
    generation, roles = EXPECTED[(name, switches)]
    assert report.generation_prompt == generation
    assert report.template_kwargs == SWITCHES[switches]
    found = {
        role: (finding.cuttable, {c.variant: c.stable for c in finding.conversations})
        for role, finding in report.roles.items()
    }
    assert found == roles
    for finding in report.roles.values():
        assert (finding.cut_problem is None) == finding.cuttable
        assert finding.stable == all(roles[finding.role][1].values())


def test_a_difference_names_the_token_and_both_sides() -> None:
    user = probed("qwen3", "default").roles["user"]
    (thinking,) = [c for c in user.conversations if c.variant == "thinking"]
    assert thinking.difference is not None
    assert thinking.difference.where == "assistant turn 0"
    assert thinking.difference.before.endswith("<|im_start|>assistant\n")
    assert thinking.difference.held.startswith("<think>\nSix sevens")
    assert thinking.difference.rendered.startswith("The answer is 42.")
    assert "the dummy prefix renders differently with a user observation" in (user.cut_problem or "")
    assert "'<think>\\n\\n</think>\\n\\nI am an assistant." in (user.cut_problem or "")


def test_a_turn_that_did_not_reason_differs_in_tokens_not_text_under_preserve_thinking() -> None:
    tool = probed("qwen3_6", "preserve_thinking").roles["tool"]
    (plain,) = [c for c in tool.conversations if c.variant == "no_thinking"]
    assert plain.turn.startswith("\n</think>\n\n")
    assert plain.difference is not None
    # the same text on both sides: the closed empty block's whitespace is tokenized as one piece in history
    assert plain.difference.rendered.startswith(plain.difference.held[:20])
    tokenizer = shipped("qwen3_6")
    assert tokenizer.encode("<think>\n\n</think>") != tokenizer.encode("<think>\n") + tokenizer.encode("\n</think>")


def test_append_only_templates_are_stable_and_cuttable_in_both_roles() -> None:
    report = probe_template(qwen_tokenizer_with_template(MINIMAL_CHATML_TEMPLATE))
    assert report.stable_for(["user", "tool"]) and report.cuttable_for(["user", "tool"])
    assert choose_history_policy(report, "auto", ["user", "tool"]) == "append"


def test_the_report_traces_as_plain_data() -> None:
    summary = probed("qwen3_6", "default").to_dict()
    assert summary["generation_prompt"] == "open_think"
    assert summary["roles"]["user"]["cuttable"] is False and summary["roles"]["tool"]["cuttable"] is True
    assert set(summary["roles"]["tool"]["differences"]) == {"no_thinking"}
    assert "token" in summary["roles"]["tool"]["differences"]["no_thinking"]


def test_tools_given_are_rendered_and_named() -> None:
    tools = [{**PROBE_TOOLS[0], "function": {**PROBE_TOOLS[0]["function"], "name": "adder"}}]
    report = probe_template(shipped("qwen3"), tools=tools)
    assert report.tools == ("adder",)
    assert probe_template(shipped("qwen3")).tools == ()


def test_roles_can_be_chosen_and_unknown_ones_are_refused() -> None:
    assert list(probe_template(shipped("qwen3_6"), roles=["user"]).roles) == ["user"]
    with pytest.raises(ValueError, match="assistant"):
        probe_template(shipped("qwen3_6"), roles=["assistant"])


def test_a_template_that_cannot_render_a_prompt_is_a_template_error_naming_it() -> None:
    broken = qwen_tokenizer_with_template("{{ raise_exception('no prompts here') }}")
    with pytest.raises(TemplateError, match="no prompts here"):
        probe_template(broken)


def test_the_probe_is_exported() -> None:
    assert fsm_rollout.probe_template is probe_template
    assert fsm_rollout.choose_history_policy is choose_history_policy


def test_shipped_templates_name_their_source_and_unknown_names_are_refused() -> None:
    for name in CHAT_TEMPLATE_NAMES:
        header = chat_template(name).split("-#}", 1)[0]
        assert header.startswith("{#-") and ("huggingface/trl" in header or "Written for fsm-rollout" in header)
    with pytest.raises(ValueError, match="qwen3"):
        chat_template("qwen4")


# --------------------------------------------------------------------------------------------- the policy


@pytest.mark.parametrize(
    ("name", "switches", "roles", "policy"),
    [
        ("qwen3_6", "default", ["user"], "fork"),  # history rewritten, no cut
        ("qwen3_6", "thinking_off", ["tool"], "append"),  # the tool role keeps the pre-filled block
        ("qwen3_6", "thinking_off", ["user", "tool"], "fork"),
        ("qwen3", "default", ["tool"], "fork"),  # stable history, but the boundary cannot be cut
        ("qwen3_8", "thinking_off", ["user", "tool"], "append"),
        ("tool_call_thinking", "default", ["tool"], "append"),
        ("tool_call_thinking", "default", ["user"], "fork"),
    ],
)
def test_auto_appends_only_where_history_is_kept_and_the_boundary_cut(
    name: str, switches: str, roles: list[str], policy: str
) -> None:
    assert choose_history_policy(probed(name, switches), "auto", roles) == policy


def test_append_proceeds_on_a_template_that_rewrites_history_when_the_boundary_can_be_cut() -> None:
    report = probed("tool_call_thinking", "default")
    assert not report.stable_for(["user"])
    assert choose_history_policy(report, "append", ["user"]) == "append"


def test_append_is_refused_where_the_boundary_cannot_be_cut_with_the_probes_explanation() -> None:
    with pytest.raises(AppendRefused) as refused:
        choose_history_policy(probed("qwen3_6", "default"), "append", ["user"])
    assert isinstance(refused.value, TemplateError)
    assert "boundary cannot be cut" in str(refused.value) and "history_policy='fork'" in str(refused.value)


@pytest.mark.parametrize("policy", ["fork", "per_turn"])
def test_fork_and_per_turn_need_no_boundary(policy: str) -> None:
    assert choose_history_policy(probed("qwen3_6", "default"), policy, ["user", "tool"]) == policy


def test_an_unknown_policy_or_role_is_refused() -> None:
    with pytest.raises(ConfigError, match="history_policy"):
        choose_history_policy(probed("qwen3", "default"), "rewrite", ["user"])
    with pytest.raises(ConfigError, match="history_policy"):
        HistoryPolicyChooser("rewrite")
    with pytest.raises(ValueError, match="assistant"):
        choose_history_policy(probed("qwen3", "default"), "auto", ["assistant"])


# --------------------------------------------------------------------------------------------- at start-up


def test_the_chooser_probes_once_per_tool_set_traces_each_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    stripping = qwen_tokenizer_with_template(THINK_STRIPPING_CHAT_TEMPLATE)
    chooser = HistoryPolicyChooser("append", template_kwargs=OFF)
    with capture_logs() as events, caplog.at_level(logging.WARNING, logger="fsm_rollout.tokens.template_probe"):
        assert chooser.resolve(stripping) == "append"
        assert chooser.resolve(stripping) == "append"  # the same tool set: no second probe
        assert chooser.resolve(stripping, tools=list(PROBE_TOOLS)) == "append"
    probes = [event for event in events if event["event"] == "template_probe"]
    assert [list(event["roles"]) for event in probes] == [["user"], ["user", "tool"]]
    assert all(event["policy"] == "append" and event["template_kwargs"] == OFF for event in probes)
    warnings = [record for record in caplog.records if record.name == "fsm_rollout.tokens.template_probe"]
    assert len(warnings) == 1
    assert "rewrites history" in warnings[0].getMessage() and "user observations" in warnings[0].getMessage()


def test_the_chooser_does_not_warn_when_auto_forks_or_history_is_kept(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="fsm_rollout.tokens.template_probe"):
        assert HistoryPolicyChooser("auto").resolve(shipped("qwen3_6")) == "fork"
        assert HistoryPolicyChooser("append").resolve(qwen_tokenizer_with_template(MINIMAL_CHATML_TEMPLATE)) == "append"
    assert not [record for record in caplog.records if record.name == "fsm_rollout.tokens.template_probe"]


def test_the_chooser_refuses_append_once_and_traces_the_refusal() -> None:
    chooser = HistoryPolicyChooser("append")
    with capture_logs() as events, pytest.raises(AppendRefused):
        chooser.resolve(shipped("qwen3_6"))
    (event,) = [event for event in events if event["event"] == "template_probe"]
    assert event["policy"] is None and "boundary cannot be cut" in event["refused"]


# --------------------------------------------------------------------------------------------- real Qwen3.6 vocab


@functools.cache
def qwen3_6_real() -> Any:
    return load_qwen3_6_tokenizer()  # it wears the Qwen3.6 template


@pytest.mark.parametrize("switches", list(SWITCHES))
def test_the_findings_hold_on_the_real_qwen3_6_vocabulary(switches: str) -> None:
    tokenizer = qwen3_6_real()
    report = probe_template(tokenizer, template_kwargs=SWITCHES[switches])
    generation, roles = EXPECTED[("qwen3_6", switches)]
    assert report.generation_prompt == generation
    found = {
        role: (finding.cuttable, {c.variant: c.stable for c in finding.conversations})
        for role, finding in report.roles.items()
    }
    assert found == roles


def test_the_real_vocabulary_writes_the_think_tags_as_special_tokens() -> None:
    tokenizer = qwen3_6_real()
    think, end_think = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    assert (think, end_think) == (248068, 248069)
    # the Qwen3.8-style merge: history's '\n\n' is one token where a turn sampled after '<think>\n' holds two
    assert tokenizer.encode("<think>\n\n</think>") == [think, 271, end_think]
    assert tokenizer.encode("<think>\n") + tokenizer.encode("\n</think>") == [think, 198, 198, end_think]
