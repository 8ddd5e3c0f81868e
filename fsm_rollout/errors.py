"""The exceptions fsm-rollout raises: one base, one class per thing that can be wrong.

Every class also derives from the builtin exception the seed raised in the same situation (``ValueError``,
``TypeError``, ``RuntimeError``, ...), so code written against the seed's errors keeps working.
"""

from __future__ import annotations


class RolloutError(Exception):
    """Base class of every error fsm-rollout raises on purpose."""


class ConfigError(RolloutError, ValueError):
    """A configuration value is invalid (found before any request is sent)."""


class TokenizerNotFoundError(ConfigError, OSError):
    """No tokenizer could be loaded from local files for the model (an ``OSError`` too, as transformers raises)."""


class SamplingParamsError(RolloutError, KeyError):
    """The sampling parameters lack a required key."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class IncompatibleOptionsError(ConfigError, RuntimeError):
    """Two options cannot be used together (e.g. routing replay with an EOS appended after stop strings)."""


class TemplateKwargsError(ConfigError, TypeError):
    """``apply_chat_template_kwargs`` sets an argument the rollout passes itself."""


class SampleStateError(RolloutError, ValueError):
    """The sample cannot start a rollout (not pending, or carries response data already)."""


class PromptError(SampleStateError):
    """The sample's prompt is neither a non-empty string nor a list of chat messages."""


class SampleAppendError(RolloutError, ValueError):
    """Tokens, logprobs or metadata appended to a sample break the sample's rules."""


class InvariantViolation(RolloutError, AssertionError):
    """The sample's token, mask and logprob arrays no longer line up."""


class EngineError(RolloutError):
    """Base class for failures talking to the inference engine."""


class EngineConnectionError(EngineError, ConnectionError):
    """The engine could not be reached (after the retries the policy allows)."""


class EngineTimeoutError(EngineError, TimeoutError):
    """The engine did not answer within the configured timeout."""


class EngineHTTPError(EngineError, RuntimeError):
    """The engine answered with an HTTP error status."""

    def __init__(self, message: str, *, status: int, url: str, body: str) -> None:
        super().__init__(message)
        self.status = status
        self.url = url
        self.body = body


class ModelListError(EngineError, ValueError):
    """The ``GET /v1/models`` answer does not list models in vLLM's shape."""


class RenderError(EngineError, ValueError):
    """The render endpoint's answer cannot be used as a prompt."""


class MalformedRenderError(RenderError, TypeError):
    """Prompt token ids in a render answer have the wrong type."""


class GenerationError(EngineError, ValueError):
    """The generate endpoint's answer breaks the protocol (shape, finish reason, lengths)."""


class MalformedTokensError(GenerationError, TypeError):
    """Token ids or logprobs in an engine answer have the wrong type."""


class BudgetExceededError(GenerationError):
    """The engine generated more tokens than the request allowed."""


class RoutingReplayError(RolloutError, RuntimeError, ValueError):
    """Routing replay data is missing, mis-sized, or cannot cover a token."""


class EnvironmentLoadError(RolloutError, ImportError):
    """The environment module cannot be imported."""


class EnvironmentNotFoundError(EnvironmentLoadError, ModuleNotFoundError):
    """The environment module or file does not exist, or a module it imports is not installed.

    A ``ModuleNotFoundError`` as well, as the seed raised there; ``name`` is the module that was not found.
    """


class EnvironmentContractError(RolloutError, ValueError):
    """The environment module or object does not follow the environment protocol."""


class ObservationError(RolloutError, ValueError, TypeError):
    """An observation message is not a chat message the rollout can take (text, and image parts)."""


class TemplateError(RolloutError, ValueError):
    """The chat template cannot produce observation boundary tokens."""


class TemplateNotPrefixStable(TemplateError):
    """Rendering one more message changed the tokens of the messages before it."""


class ParityInputError(RolloutError, ValueError):
    """A sample cannot be rebuilt into a conversation for the template-parity check (its observation records are
    missing or do not fit its tokens)."""


class MultimodalError(RolloutError, RuntimeError):
    """Images, their render features and their placeholder tokens do not agree."""


class ImageInputError(RolloutError, ValueError):
    """An image in the prompt cannot be turned into a render URL."""


class ImageObservationError(ObservationError):
    """An observation's image part cannot be taken: a media part other than an image, or an image the engine's
    render did not encode into matching placeholders and features."""


class VideoObservationError(ImageObservationError):
    """An observation carries a video part: observations take images only."""


class ImageTooLargeError(ImageInputError):
    """An image is over the configured byte or pixel limit (a decompression bomb, or just too big)."""


class MalformedFeaturesError(MultimodalError, TypeError):
    """The render answer's ``features`` do not have vLLM's shape (a map with per-modality lists)."""


class FeatureCodecError(MultimodalError, ValueError):
    """A multimodal feature item cannot be decoded from (or encoded into) vLLM's base64 msgpack wire format."""


class ImageFeaturesMissingError(MultimodalError):
    """The prompt has images, but the render answer carries no image tensors for (some of) them."""


class ImageObservationFeaturesMissingError(ImageObservationError, ImageFeaturesMissingError):
    """An observation holds images, but the engine's render of it answered no image features (a text-only model,
    or a server that does not encode images): the observation cannot be taken."""


class ImageMergeSizeUnknownError(MultimodalError):
    """The prompt has image grids, but neither the processor nor the config gives the image merge size."""


class ImageTokenMismatchError(MultimodalError):
    """The number of image placeholder tokens differs from ``sum(t*h*w) / merge_size**2`` over the image grids."""

    def __init__(self, message: str, *, image_tokens: int, expected: int) -> None:
        super().__init__(message)
        self.image_tokens = image_tokens
        self.expected = expected


class ResumeError(SampleStateError):
    """A suspended sample cannot be resumed here (its resume state is missing, damaged, or needs an environment
    that can restore a snapshot)."""


class PoolError(RolloutError, RuntimeError):
    """A :class:`~fsm_rollout.distributed.RayRolloutPool` cannot do what was asked: Ray is missing, its workers did
    not start, or none of them is alive."""


class MissingExtraError(EnvironmentNotFoundError):
    """An environment adapter needs an optional package that is not installed; the message names the extra."""

    def __init__(self, *, adapter: str, package: str, extra: str) -> None:
        super().__init__(
            f"the {adapter} adapter needs {package}, which is not installed: pip install 'fsm-rollout[{extra}]'",
            name=package,
        )
        self.adapter = adapter
        self.extra = extra


class AdapterProtocolError(EnvironmentContractError):
    """A foreign environment behind an adapter broke its own protocol: ``adapter`` and ``call`` name where."""

    def __init__(self, adapter: str, call: str, problem: str) -> None:
        super().__init__(f"{adapter} adapter: {call} {problem}")
        self.adapter = adapter
        self.call = call
