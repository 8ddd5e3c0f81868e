"""Talking to inference engines: the vLLM client and strict parsing of its answers.

Its modules are internal, except the client (:mod:`~fsm_rollout.engine.client`), the transport seam
(:mod:`~fsm_rollout.engine.transport`), the probe (:mod:`~fsm_rollout.engine.probe`), the embedded engine's package
(:mod:`fsm_rollout.engine.local`) and its default model (:mod:`~fsm_rollout.engine.local.default_model`).
"""

from fsm_rollout.engine.client import VLLMClient

__all__ = ["VLLMClient"]
