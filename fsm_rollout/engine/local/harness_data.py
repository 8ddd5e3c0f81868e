"""Internal: the harness model's training conversations, written from the harnesses' real first requests.

The harness model (:mod:`~fsm_rollout.engine.local.harness_model`) learns one task in the prompts Codex CLI and
Claude Code really send: "create a file named NAME containing TEXT". Each harness's first request, as the gateway
turns it into chat messages and tools, is shipped beside this module (:data:`SHIPPED_TEMPLATES`, written by
``python -m tools.harness_model_data`` from recorded requests) with placeholders where a run differs: the task, the
working directory, the harness's home, the date. :func:`harness_conversations` fills them (names, texts, paths and
dates drawn from a seeded generator) and adds the turns: one call of the harness's shell tool in its own argument
format, the tool's report as the harness sends it back, and a short final answer. :func:`encode_conversation` turns
one into token ids exactly as a gateway session on the embedded engine sees them: the prompt as the engine renders
it, each answer then ``<|im_end|>``, the report as the library's observation encoder encodes it.

:func:`copy_drills` are short conversations beside them, the task alone and the call, trained only on the command's
tokens: in the long prompts copying the name and the text is learned too slowly for a short build (the model first
learns the format and the commonest command), and a short drill teaches the attention that copies them cheaply.
"""

from __future__ import annotations

import gzip
import json
import pathlib
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

__all__ = [
    "FINAL_ANSWER",
    "HARNESSES",
    "HELD_OUT",
    "NAMES",
    "PLACEHOLDERS",
    "SHIPPED_TEMPLATES",
    "TEXTS",
    "EncodedConversation",
    "HarnessConversation",
    "HarnessTemplate",
    "copy_drills",
    "encode_conversation",
    "harness_conversations",
    "read_templates",
    "shell_command",
    "task_text",
    "write_templates",
]

HARNESSES: Final = ("codex", "claude")
"""The harnesses trained for: Codex CLI (``codex exec``, Responses) and Claude Code (``claude -p``, Messages)."""

SHIPPED_TEMPLATES: Final = pathlib.Path(__file__).with_name("harness_data.json.gz")

PLACEHOLDERS: Final = {
    "task": "{{task}}",
    "home": "{{home}}",
    "cwd_slug": "{{cwd_slug}}",
    "cwd": "{{cwd}}",
    "date": "{{date}}",
}
"""What stands in the shipped templates where a run differs (``cwd_slug``: Claude Code's project folder name)."""

NAMES: Final = ("apple.txt", "banana.txt", "cherry.txt", "grape.txt", "lemon.txt", "mango.txt", "plum.txt", "kiwi.md")
"""The file names of the training tasks (a few, so that each is seen often in a short training)."""

TEXTS: Final = ("tiger", "zebra", "otter", "panda", "eagle", "koala", "horse", "whale")
"""The words the training tasks write."""

HELD_OUT: Final = ("plum.txt", "otter")
"""A name and a text never asked together in training (the tests ask for them)."""

FINAL_ANSWER: Final = "The file is written."
_TASK: Final = "Create a file named {name} containing {text}."
_CALL: Final = {"codex": ("exec_command", "cmd"), "claude": ("Bash", "command")}
_WORDS: Final = ("work", "repo", "project", "sandbox", "tmp", "data", "run", "case", "job", "src")


@dataclass(frozen=True)
class HarnessTemplate:
    """A harness's first request as chat messages and tools, with :data:`PLACEHOLDERS`."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]


@dataclass(frozen=True)
class HarnessConversation:
    """One training conversation: the filled messages and tools, the tool call, the report and the answer."""

    harness: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    call: str
    report: dict[str, Any]
    answer: str


@dataclass(frozen=True)
class EncodedConversation:
    token_ids: list[int]
    trainable: list[bool]
    prompt_length: int


def write_templates(templates: Mapping[str, HarnessTemplate], path: pathlib.Path) -> pathlib.Path:
    data = {name: {"messages": each.messages, "tools": each.tools} for name, each in sorted(templates.items())}
    text = json.dumps(data, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()
    path.write_bytes(gzip.compress(text, compresslevel=9, mtime=0))
    return path


def read_templates(path: pathlib.Path = SHIPPED_TEMPLATES) -> dict[str, HarnessTemplate]:
    data = json.loads(gzip.decompress(path.read_bytes()))
    return {name: HarnessTemplate(data[name]["messages"], data[name]["tools"]) for name in HARNESSES}


def task_text(name: str, text: str) -> str:
    """The task a user gives the harness."""
    return _TASK.format(name=name, text=text)


def shell_command(name: str, text: str) -> str:
    """The shell command the model runs for the task."""
    return f"echo {text} > {name}"


def tool_call_text(harness: str, command: str) -> str:
    """The model's call of the harness's shell tool, in Qwen's (Hermes) markup."""
    tool, argument = _CALL[harness]
    return f"<tool_call>\n{json.dumps({'name': tool, 'arguments': {argument: command}})}\n</tool_call>"


def _fill(value: Any, fields: Mapping[str, str]) -> Any:
    if isinstance(value, str):
        for field, placeholder in PLACEHOLDERS.items():
            value = value.replace(placeholder, fields[field])
        return value
    if isinstance(value, list):
        return [_fill(each, fields) for each in value]
    if isinstance(value, dict):
        return {key: _fill(each, fields) for key, each in value.items()}
    return value


def _directory(rng: random.Random) -> str:
    """A working directory like the ones a harness runs in (pytest's temporary folders among them)."""
    if rng.random() < 0.5:
        test = "_".join(rng.sample(_WORDS, 2))
        return f"/tmp/pytest-of-{rng.choice(('root', 'ci', 'dev'))}/pytest-{rng.randrange(1, 400)}/test_{test}0"
    return "/" + "/".join([rng.choice(("tmp", "home/dev", "srv", "root")), *rng.sample(_WORDS, rng.randrange(1, 3))])


def _report(harness: str, rng: random.Random, call_id: str) -> dict[str, Any]:
    if harness == "codex":
        text = (
            f"Chunk ID: {rng.randrange(16**6):06x}\nWall time: {rng.uniform(0.0, 0.5):.4f} seconds\n"
            "Process exited with code 0\nOriginal token count: 0\nOutput:\n"
        )
    else:
        text = "(Bash completed with no output)"
    return {"role": "tool", "content": text, "tool_call_id": call_id}


def _environment(rng: random.Random) -> dict[str, str]:
    """Where a run happens: its directories and its date."""
    parent = _directory(rng)
    cwd = f"{parent}/{rng.choice(_WORDS)}"
    return {
        "home": f"{parent}/{rng.choice(('home', 'codex-home', 'claude-home', '.home'))}",
        "cwd": cwd,
        "cwd_slug": re.sub(r"[^A-Za-z0-9]", "-", cwd),
        "date": f"{rng.randrange(2025, 2029)}-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d}",
    }


def harness_conversations(
    counts: Mapping[str, int], seed: int, environments: int, templates: Mapping[str, HarnessTemplate] | None = None
) -> list[HarnessConversation]:
    """``counts[harness]`` conversations of each harness, drawn with ``seed``: every task but the :data:`HELD_OUT`
    pair, each in one of ``environments`` environments per harness (a few, so that conversations share long prompt
    prefixes, which the training computes once)."""
    source = templates if templates is not None else read_templates()
    rng = random.Random(seed)
    pairs = [(name, text) for name in NAMES for text in TEXTS if (name, text) != HELD_OUT]
    conversations = []
    for harness in HARNESSES:
        places = [_environment(rng) for _ in range(environments)]
        for index in range(counts[harness]):
            name, text = rng.choice(pairs)
            fields = {"task": task_text(name, text), **places[index % environments]}
            template = source[harness]
            call_id = f"call_{rng.randrange(10**6)}"
            conversations.append(
                HarnessConversation(
                    harness,
                    _fill(template.messages, fields),
                    _fill(template.tools, fields),
                    tool_call_text(harness, shell_command(name, text)),
                    _report(harness, rng, call_id),
                    FINAL_ANSWER,
                )
            )
    return conversations


def encode_conversation(conversation: HarnessConversation, tokenizer: Any, encoder: Any) -> EncodedConversation:
    """Token ids as a gateway session on the embedded engine holds them, and which are the model's.

    ``encoder`` is an :class:`~fsm_rollout.tokens.chat.ObservationEncoder` of ``tokenizer`` (it caches the
    template's boundary renders, so one serves every conversation)."""
    from fsm_rollout.tokens.chat import template_token_ids

    prompt = template_token_ids(
        tokenizer.apply_chat_template(
            conversation.messages, tools=conversation.tools, add_generation_prompt=True, tokenize=True,
            return_dict=False,
        ),
        what="harness prompt",
    )  # fmt: skip
    eos = int(tokenizer.eos_token_id)
    ids, trainable = list(prompt), [False] * len(prompt)
    turns: Sequence[str] = (conversation.call, conversation.answer)
    for index, turn in enumerate(turns):
        turn_ids = [*tokenizer.encode(turn, add_special_tokens=False), eos]
        ids += turn_ids
        trainable += [True] * len(turn_ids)
        if index == 0:
            suffix = list(encoder.encode(conversation.report, ends_with_eos=True, tools=conversation.tools))
            ids += suffix
            trainable += [False] * len(suffix)
    return EncodedConversation(ids, trainable, len(prompt))


def copy_drills(count: int, seed: int, tokenizer: Any) -> list[EncodedConversation]:
    """``count`` short conversations (the task as the only message, then the call of a harness's shell tool) whose
    only trained tokens are the command's: what the model must copy from the task. Never the :data:`HELD_OUT`
    pair."""
    from fsm_rollout.tokens.chat import template_token_ids

    rng = random.Random(seed)
    pairs = [(name, text) for name in NAMES for text in TEXTS if (name, text) != HELD_OUT]
    drills = []
    for _ in range(count):
        name, text = rng.choice(pairs)
        harness = rng.choice(HARNESSES)
        prompt = template_token_ids(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": task_text(name, text)}], add_generation_prompt=True, tokenize=True,
                return_dict=False,
            ),
            what="copy drill prompt",
        )  # fmt: skip
        command = shell_command(name, text)
        call = tool_call_text(harness, command)
        start = call.index(command)
        encoded = tokenizer(call, add_special_tokens=False, return_offsets_mapping=True)
        trained = [begin < start + len(command) and end > start for begin, end in encoded["offset_mapping"]]
        ids = [*prompt, *encoded["input_ids"]]
        drills.append(EncodedConversation(ids, [False] * len(prompt) + trained, len(prompt)))
    return drills
