"""Talking to inference engines: the vLLM client and strict parsing of its answers."""

from fsm_rollout.engine.client import VLLMClient

__all__ = ["VLLMClient"]
