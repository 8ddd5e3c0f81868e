"""The agent gateway: black-box agents over the OpenAI Chat Completions API, trained token-exact.

A gateway session is a rollout whose environment is the agent: the first call's messages are the prompt, each
later call's new messages are an observation, and closing the session is ``done``. See
:mod:`fsm_rollout.gateway.server` (the HTTP surface and :class:`AgentGateway`),
:mod:`fsm_rollout.gateway.session` (one session), :mod:`fsm_rollout.gateway.lineage` (one chain of a session's
calls, run as its own rollout), :mod:`fsm_rollout.gateway.lineages` (which chain a call belongs to, and compaction),
:mod:`fsm_rollout.gateway.conversation` (the history check by meaning), :mod:`fsm_rollout.gateway.openai_wire` and
:mod:`fsm_rollout.gateway.chat_answers` (Chat Completions requests, answers, streams, errors),
:mod:`fsm_rollout.gateway.responses_wire` and :mod:`fsm_rollout.gateway.responses_events` (the Responses API, read
into chat calls), :mod:`fsm_rollout.gateway.messages_wire` (Anthropic's Messages API, likewise) and
:mod:`fsm_rollout.gateway.hints` (what a client's headers say about a call).

Its modules are internal: import from this package.
"""

from fsm_rollout.gateway.openai_wire import GatewayError
from fsm_rollout.gateway.server import AgentGateway
from fsm_rollout.gateway.session import GatewaySession

__all__ = ["AgentGateway", "GatewayError", "GatewaySession"]
