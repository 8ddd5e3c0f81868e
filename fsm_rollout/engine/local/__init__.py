"""The embedded engine: vLLM's token-in/token-out HTTP endpoints served by a real Hugging Face model on the CPU.

A development and test engine (production is vLLM): ``fsm-rollout serve`` on the command line, or in process::

    async with LocalEngine() as engine:   # the default tiny random Qwen2 with the real Qwen vocabulary
        ...  # point a VLLMClient (or RolloutConfig.engine_url) at engine.url

Images: render expands ``image_url`` parts (``data:`` URLs) the way vLLM does for Qwen2-VL and returns vLLM's
multimodal ``features``; generate checks them and then generates with the text model, which sees the
``<|image_pad|>`` tokens as ordinary tokens (see :mod:`fsm_rollout.engine.local.images`). Configure the client's
image-token check with ``RolloutConfig(image_merge_size=engine.image_merge_size)``.

Weight updates: vLLM's ``/pause``, ``/resume``, ``/update_weight_version`` and ``/update_weights`` endpoints, or
in process ``await engine.pause("keep")``, ``await engine.load_weights(state_dict, version="step-1")``,
``await engine.resume()``; answers label every output token with the weight version it was sampled under.

Importing this package is cheap: torch and transformers load only when an engine starts or the tiny model is built.
"""

from fsm_rollout.engine.local.errors import LocalEngineError, ModelLoadError, WeightLoadError
from fsm_rollout.engine.local.server import LocalEngine
from fsm_rollout.engine.local.tiny import TINY_MODEL_NAME, tiny_model_dir

__all__ = ["TINY_MODEL_NAME", "LocalEngine", "LocalEngineError", "ModelLoadError", "WeightLoadError", "tiny_model_dir"]
