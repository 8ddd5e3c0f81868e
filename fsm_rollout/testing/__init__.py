"""Test support shipped with fsm-rollout: a fake vLLM server, scripted environments, a real Qwen tokenizer.

Its modules are internal, except :mod:`~fsm_rollout.testing.fake_vllm` (a package: import from it),
:mod:`~fsm_rollout.testing.envs`, :mod:`~fsm_rollout.testing.templates`, :mod:`~fsm_rollout.testing.chat_templates`
(real thinking-model chat templates) and :mod:`~fsm_rollout.testing.tokenizer`.
"""

from fsm_rollout.trace import capture_transitions

__all__ = ["capture_transitions"]
