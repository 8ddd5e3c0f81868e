"""A fake vLLM server for tests: vLLM's token-in/token-out HTTP endpoints, answered from scripted turns.

``FakeVLLMServer`` listens on loopback over real HTTP (aiohttp) and answers the endpoints the rollout client
uses with vLLM's JSON shapes:

* ``POST /v1/chat/completions/render`` renders the conversation with the tokenizer's chat template;
* ``POST /inference/v1/generate`` answers with the next ``ScriptedTurn`` of the request's session, cut by
  ``stop`` strings, ``stop_token_ids``, EOS, ``min_tokens`` and ``max_tokens`` the way vLLM would cut a real
  generation;
* ``POST /inference/v1/abort_requests`` ends delayed or hanging generate requests with
  ``finish_reason="abort"`` and the tokens a turn's ``held_after`` says they had produced; a later request
  whose ``token_ids`` add those tokens to the prompt continues the turn;
* the weight-update endpoints: ``POST /pause?mode=abort|wait|keep``, ``POST /resume``, ``GET /is_paused``,
  ``POST /update_weight_version``, ``GET /weight_info`` and ``POST /update_weights`` (recorded only); every
  generate answer labels its tokens with ``choices[0].weight_versions``;
* ``GET /health`` and ``GET /v1/models``.

Parsing, answers and errors are the serving frame's (:mod:`fsm_rollout.engine.serving`), shared with the embedded
engine and the bench's server. Every request is recorded (``requests``); ``fail_next`` injects faults (HTTP errors,
malformed JSON, dropped connections) ahead of the normal handling. Tokenizer work runs in one worker thread so the
event loop stays free.

The parts: :mod:`~fsm_rollout.testing.fake_vllm.scripting` (scripted turns and recorded requests),
:mod:`~fsm_rollout.testing.fake_vllm.faults` (fault injection), :mod:`~fsm_rollout.testing.fake_vllm.generation`
(a scripted turn cut and answered the way vLLM would), :mod:`~fsm_rollout.testing.fake_vllm.turns` (which turn
a request answers), :mod:`~fsm_rollout.testing.fake_vllm.waiting` (held requests, pauses, aborts),
:mod:`~fsm_rollout.testing.fake_vllm.images` (a Qwen2-VL-like image render hook) and
:mod:`~fsm_rollout.testing.fake_vllm.server` (the server). The names a test uses are importable from here.
"""

from fsm_rollout.engine.schema import (
    ABORT_PATH,
    GENERATE_PATH,
    HEALTH_PATH,
    IS_PAUSED_PATH,
    MODELS_PATH,
    PAUSE_PATH,
    RENDER_PATH,
    RESUME_PATH,
    UPDATE_WEIGHT_VERSION_PATH,
    UPDATE_WEIGHTS_PATH,
    WEIGHT_INFO_PATH,
)
from fsm_rollout.testing.fake_vllm.generation import LogprobEntryStyle
from fsm_rollout.testing.fake_vllm.images import QwenLikeImageRender
from fsm_rollout.testing.fake_vllm.scripting import OMIT, SESSION_HEADER, RecordedRequest, ScriptedTurn
from fsm_rollout.testing.fake_vllm.server import FakeVLLMServer, RenderFeaturesHook

__all__ = [
    "ABORT_PATH",
    "GENERATE_PATH",
    "HEALTH_PATH",
    "IS_PAUSED_PATH",
    "MODELS_PATH",
    "OMIT",
    "PAUSE_PATH",
    "RENDER_PATH",
    "RESUME_PATH",
    "SESSION_HEADER",
    "UPDATE_WEIGHTS_PATH",
    "UPDATE_WEIGHT_VERSION_PATH",
    "WEIGHT_INFO_PATH",
    "FakeVLLMServer",
    "LogprobEntryStyle",
    "QwenLikeImageRender",
    "RecordedRequest",
    "RenderFeaturesHook",
    "ScriptedTurn",
]
