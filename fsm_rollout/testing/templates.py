"""Chat templates for tests of observation encoding and template parity, and the Qwen tokenizer wearing them.

* :data:`GROUPED_TOOLS_CHAT_TEMPLATE`: ChatML as Qwen2.5 renders it with tools: consecutive ``tool`` messages share
  one ``<|im_start|>user`` turn, one ``<tool_response>`` block each, so a tool result renders differently
  depending on the message after it; assistant ``tool_calls`` render as ``<tool_call>`` blocks. Append-only.
* :data:`MINIMAL_CHATML_TEMPLATE`: every message as ``<|im_start|>{role}\\n{text}<|im_end|>\\n``, ``tool`` messages
  under their own role, no default system message, tools ignored. Append-only.
* :data:`THINK_STRIPPING_CHAT_TEMPLATE`: ChatML that drops the ``<think>...</think>`` block of every assistant
  message before the last user message, as reasoning-model templates do. Not append-only, although a dummy
  prefix without a ``<think>`` block renders the same under it.
* :data:`TOOL_CALL_REQUIRED_CHAT_TEMPLATE`: the grouped template, but a ``tool`` message after anything other than
  an assistant message with ``tool_calls`` (or another ``tool`` message) raises.

:func:`qwen_tokenizer_with_template` loads a separate copy of the tokenizer
:func:`~fsm_rollout.testing.tokenizer.load_qwen_tokenizer` returns, with another chat template (the shared one is
never changed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, cast

from fsm_rollout.testing.tokenizer import qwen_tokenizer_dir

if TYPE_CHECKING:
    import pathlib

    from transformers import PreTrainedTokenizerFast

__all__ = [
    "GROUPED_TOOLS_CHAT_TEMPLATE",
    "MINIMAL_CHATML_TEMPLATE",
    "THINK_STRIPPING_CHAT_TEMPLATE",
    "TOOL_CALL_REQUIRED_CHAT_TEMPLATE",
    "qwen_tokenizer_with_template",
]

# Text of a message's content: a string, or the text of its text parts (other parts render nothing).
_TEXT_MACRO: Final = r"""
{%- macro text_of(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is not none -%}
        {%- for part in content -%}
            {%- if part.type == 'text' -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
"""

_GROUPED_BODY: Final = r"""
{%- set has_system = messages and messages[0].role == 'system' -%}
{{- '<|im_start|>system\n' -}}
{%- if has_system -%}
    {{- text_of(messages[0].content) -}}
{%- else -%}
    {{- 'You are a helpful assistant.' -}}
{%- endif -%}
{%- if tools -%}
    {{- '\n\n# Tools\n\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- '\n</tools>' -}}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- for message in messages -%}
    {%- if loop.first and has_system -%}
    {%- elif message.role == 'tool' -%}
        {%- set previous = messages[loop.index0 - 1] if not loop.first else none -%}
        {%- if CHECK_CALLS and (previous is none or (previous.role != 'tool'
                and not (previous.role == 'assistant' and previous.tool_calls))) -%}
            {{- raise_exception('a tool message must follow an assistant message with tool_calls') -}}
        {%- endif -%}
        {%- if previous is none or previous.role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + text_of(message.content) + '\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- elif message.role == 'assistant' and message.tool_calls -%}
        {{- '<|im_start|>assistant' -}}
        {%- if message.content -%}
            {{- '\n' + text_of(message.content) -}}
        {%- endif -%}
        {%- for tool_call in message.tool_calls -%}
            {%- set call = tool_call.function if tool_call.function is defined else tool_call -%}
            {{- '\n<tool_call>\n{"name": ' + (call.name | tojson) + ', "arguments": ' -}}
            {%- if call.arguments is string -%}
                {{- call.arguments -}}
            {%- else -%}
                {{- call.arguments | tojson -}}
            {%- endif -%}
            {{- '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- else -%}
        {{- '<|im_start|>' + message.role + '\n' + text_of(message.content) + '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""

GROUPED_TOOLS_CHAT_TEMPLATE: Final = (_TEXT_MACRO + "{%- set CHECK_CALLS = false -%}" + _GROUPED_BODY).strip()
"""ChatML with Qwen2.5's grouping of consecutive tool results into one user turn."""

TOOL_CALL_REQUIRED_CHAT_TEMPLATE: Final = (_TEXT_MACRO + "{%- set CHECK_CALLS = true -%}" + _GROUPED_BODY).strip()
"""The grouped template, refusing a tool result that does not follow a tool call."""

MINIMAL_CHATML_TEMPLATE: Final = (
    _TEXT_MACRO
    + r"""
{%- for message in messages -%}
    {{- '<|im_start|>' + message.role + '\n' + text_of(message.content) + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""
).strip()
"""Plain ChatML: each message on its own, nothing added."""

THINK_STRIPPING_CHAT_TEMPLATE: Final = (
    _TEXT_MACRO
    + r"""
{%- set ns = namespace(last_user=-1) -%}
{%- for message in messages -%}
    {%- if message.role == 'user' -%}
        {%- set ns.last_user = loop.index0 -%}
    {%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
    {%- set text = text_of(message.content) -%}
    {%- if message.role == 'assistant' and loop.index0 < ns.last_user and '</think>' in text -%}
        {%- set text = text.split('</think>')[-1].lstrip('\n') -%}
    {%- endif -%}
    {{- '<|im_start|>' + message.role + '\n' + text + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""
).strip()
"""ChatML that drops ``<think>`` blocks from assistant turns before the last user message."""


def qwen_tokenizer_with_template(chat_template: str, cache: pathlib.Path | None = None) -> PreTrainedTokenizerFast:
    """A fresh copy of the Qwen tokenizer (same vocabulary, special tokens and EOS) with ``chat_template``."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = cast(
        "PreTrainedTokenizerFast",
        PreTrainedTokenizerFast.from_pretrained(str(qwen_tokenizer_dir(cache).resolve()), local_files_only=True),
    )
    tokenizer.chat_template = chat_template
    return tokenizer
