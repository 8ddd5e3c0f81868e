"""Test support shipped with fsm-rollout: a fake vLLM server, scripted environments, a real Qwen tokenizer."""

from fsm_rollout.trace import capture_transitions

__all__ = ["capture_transitions"]
