"""The harness model's shipped request templates and the conversations written from them."""

from __future__ import annotations

import json

from fsm_rollout.engine.local.harness_data import (
    HARNESSES,
    HELD_OUT,
    PLACEHOLDERS,
    copy_drills,
    harness_conversations,
    read_templates,
    shell_command,
    task_text,
)
from tools.harness_model_data import harness_templates


def test_the_shipped_templates_are_what_the_tool_writes_from_the_recorded_requests() -> None:
    assert read_templates() == harness_templates()


def test_conversations_fill_every_placeholder_and_never_ask_the_held_out_task() -> None:
    conversations = harness_conversations({"codex": 40, "claude": 40}, seed=3, environments=3)
    assert [each.harness for each in conversations] == [name for name in HARNESSES for _ in range(40)]
    held_out = task_text(*HELD_OUT)
    for each in conversations:
        text = json.dumps([each.messages, each.tools])
        assert not any(placeholder in text for placeholder in PLACEHOLDERS.values())
        assert held_out not in text
        [task] = [m["content"] for m in each.messages if m["role"] == "user" and "Create a file" in str(m["content"])]
        call = json.loads(each.call.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
        tool, argument = ("exec_command", "cmd") if each.harness == "codex" else ("Bash", "command")
        assert call["name"] == tool and list(call["arguments"]) == [argument]
        text_, name = call["arguments"][argument].removeprefix("echo ").split(" > ")
        assert shell_command(name, text_) == call["arguments"][argument]
        assert task.endswith(task_text(name, text_))
    counts = {"codex": 5, "claude": 3}
    assert harness_conversations(counts, seed=3, environments=2) == harness_conversations(counts, 3, 2)


def test_copy_drills_train_only_the_command_of_a_task_they_ask() -> None:
    from fsm_rollout.testing.tokenizer import load_qwen_tokenizer

    tokenizer = load_qwen_tokenizer()
    for drill in copy_drills(20, seed=5, tokenizer=tokenizer):
        trained = tokenizer.decode([t for t, bit in zip(drill.token_ids, drill.trainable, strict=True) if bit])
        text, name = trained.removeprefix("echo ").split(" > ")
        assert (name, text) != HELD_OUT
        assert task_text(name, text) in tokenizer.decode(drill.token_ids[: drill.prompt_length])
