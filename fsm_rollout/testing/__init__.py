"""Test support shipped with fsm-rollout: a fake vLLM server, scripted environments, a real Qwen tokenizer."""
