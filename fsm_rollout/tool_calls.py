"""Tool calls in generated text: moved to :mod:`fsm_rollout.tokens.tool_calls`; this import path keeps working."""

from __future__ import annotations

from fsm_rollout.tokens.tool_calls import CLOSE_TAG as CLOSE_TAG
from fsm_rollout.tokens.tool_calls import OPEN_TAG as OPEN_TAG
from fsm_rollout.tokens.tool_calls import Loads as Loads
from fsm_rollout.tokens.tool_calls import ToolCall as ToolCall
from fsm_rollout.tokens.tool_calls import ToolCallParse as ToolCallParse
from fsm_rollout.tokens.tool_calls import ToolCallProblem as ToolCallProblem
from fsm_rollout.tokens.tool_calls import ToolCallProblemKind as ToolCallProblemKind
from fsm_rollout.tokens.tool_calls import parse_tool_calls as parse_tool_calls
