"""Observation boundary tokens (the dummy-prefix method) and the rule for the masked EOS after a stop string.

The canonical token history of a sample is what vLLM rendered and generated; it is never re-rendered. To append an
observation, only the *boundary* is encoded: the tokens that close the assistant turn, add the observation turn and
open the next assistant turn. They are cut out of a fixed dummy conversation rendered with the local chat template.
The dummy prefix is rendered once per (tokenizer, tools, template kwargs) and cached, so each
new observation costs one template render; boundaries of recently seen observation messages are cached too
(environments often repeat the same feedback), so a repeated one costs none.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from fsm_rollout.errors import ImageObservationError, ObservationError, TemplateError, TemplateNotPrefixStable
from fsm_rollout.multimodal import is_image_part
from fsm_rollout.types import TokenIds

BOUNDARY_CACHE_SIZE = 4096
"""Observation boundaries kept per encoder (least recently used ones are dropped)."""

DUMMY_MESSAGES: tuple[dict[str, str], ...] = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "I am a user."},
    {"role": "assistant", "content": "I am an assistant."},
)


def template_token_ids(value: Any, *, what: str) -> TokenIds:
    """Token ids from ``apply_chat_template(tokenize=True)``: a flat int list, or a mapping with ``input_ids``."""
    if isinstance(value, Mapping) or hasattr(value, "keys"):
        value = value.get("input_ids")
    if hasattr(value, "tolist"):
        value = value.tolist()
    if not isinstance(value, list) or not all(type(token) is int for token in value):
        raise TemplateError(f"{what}: apply_chat_template must return a flat list of integer token ids")
    return value


def validate_text_observation(message: Any) -> dict[str, Any]:
    """Check that an observation message is ``{"role", "content"}`` with text-only content; return it."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
        raise ObservationError(
            f"format_observation must return a {{'role': str, 'content': ...}} message, got {message!r:.200}"
        )
    content = message["content"]
    if isinstance(content, str):
        return message
    if not isinstance(content, list):
        raise ObservationError(
            f"observation content must be text or a list of text parts, got {type(content).__name__}"
        )
    for index, part in enumerate(content):
        if is_image_part(part):
            raise ImageObservationError(
                f"observation content[{index}] is an image part ({part.get('type')!r}): observations must be "
                "text-only; images belong in the prompt, whose image features are sent unchanged on every turn"
            )
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ObservationError(
                f"the suffix-only rollout supports text observations only; content[{index}]={part!r:.200}"
            )
    return message


class ObservationEncoder:
    """Encodes observation messages into boundary tokens with one tokenizer's chat template.

    ``tokenizer`` needs ``apply_chat_template`` and an integer ``eos_token_id`` (the chat turn terminator).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        eos_token_id = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_id: int | None = eos_token_id if type(eos_token_id) is int else None
        self._prefixes: dict[bytes, tuple[TokenIds, int]] = {}
        self._boundaries: OrderedDict[bytes, TokenIds] = OrderedDict()

    def _prefix(
        self, key: bytes, tools: Sequence[Mapping[str, Any]] | None, template_kwargs: Mapping[str, Any]
    ) -> tuple[TokenIds, int]:
        cached = self._prefixes.get(key)
        if cached is not None:
            return cached
        if self.eos_token_id is None:
            raise TemplateError("tokenizer.eos_token_id must be an integer (the chat turn terminator)")
        prefix = template_token_ids(
            self.tokenizer.apply_chat_template(
                list(DUMMY_MESSAGES),
                tools=tools,
                tokenize=True,
                add_generation_prompt=False,
                **template_kwargs,
            ),
            what="dummy observation prefix",
        )
        try:
            eos_index = len(prefix) - 1 - prefix[::-1].index(self.eos_token_id)
        except ValueError as error:
            raise TemplateError(
                f"Dummy observation prefix lacks eos_token_id={self.eos_token_id}: the chat template does not "
                "end assistant turns with the tokenizer's EOS"
            ) from error
        self._prefixes[key] = (prefix, eos_index)
        return prefix, eos_index

    def encode(
        self,
        message: Mapping[str, Any],
        *,
        ends_with_eos: bool,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> TokenIds:
        """Boundary tokens that follow the canonical history for this observation message.

        ``ends_with_eos`` says whether the canonical history already ends with EOS (the model stopped on it, or
        one was appended after a stop string); then the boundary's leading EOS is left out.
        """
        kwargs = template_kwargs or {}
        prefix_key = orjson.dumps([tools, dict(kwargs)], option=orjson.OPT_SORT_KEYS)
        key = prefix_key + b"\x00" + orjson.dumps(message, option=orjson.OPT_SORT_KEYS)
        cached = self._boundaries.get(key)
        if cached is None:
            cached = self._boundary(prefix_key, message, tools, kwargs)
            self._boundaries[key] = cached
            if len(self._boundaries) > BOUNDARY_CACHE_SIZE:
                self._boundaries.popitem(last=False)
        else:
            self._boundaries.move_to_end(key)
        return cached[1:] if ends_with_eos else list(cached)

    def _boundary(
        self,
        prefix_key: bytes,
        message: Mapping[str, Any],
        tools: Sequence[Mapping[str, Any]] | None,
        kwargs: Mapping[str, Any],
    ) -> TokenIds:
        """The boundary tokens starting with the EOS that closes the assistant turn."""
        prefix, eos_index = self._prefix(prefix_key, tools, kwargs)
        rendered = template_token_ids(
            self.tokenizer.apply_chat_template(
                [*DUMMY_MESSAGES, dict(message)],
                tools=tools,
                tokenize=True,
                add_generation_prompt=True,
                **kwargs,
            ),
            what="observation template",
        )
        if rendered[: len(prefix)] != prefix:
            raise TemplateNotPrefixStable(
                "Observation template is not prefix-stable: rendering one more message changed the tokens of the "
                "conversation before it (e.g. a template that rewrites earlier assistant turns)"
            )
        return prefix[eos_index:] + rendered[len(prefix) :]


def stop_string_eos_due(
    text: str,
    token_ids: Sequence[int],
    *,
    finish: str,
    stop: str | Sequence[str] | None,
    eos_token_id: int | None,
) -> bool:
    """Whether a masked EOS must follow this turn: it stopped on a stop string and did not end with EOS itself.

    Stops on ``stop_token_ids`` never qualify (the text does not end with a stop string).
    """
    if finish != "stop" or not stop or eos_token_id is None:
        return False
    stop_strings = (stop,) if isinstance(stop, str) else tuple(stop)
    if not text.endswith(stop_strings):
        return False
    return not (token_ids and token_ids[-1] == eos_token_id)
