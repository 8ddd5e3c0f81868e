"""The ``observing`` activity's work for an observation with images: one render by the engine, the boundary cut out.

A text observation's boundary comes from the local chat template (:class:`~fsm_rollout.tokens.chat.ObservationEncoder`).
An image observation's cannot: only the engine knows how many placeholder tokens each image becomes, and only its
processor makes the features the model and the trainer need. So the observation is rendered by the engine after
the same dummy prefix the text path uses (one render request per observation); the engine's ids of that prefix
must equal the local template's, and the boundary is cut at the same EOS. The render's image features are then
placed in the sample's sequence (:func:`~fsm_rollout.multimodal.place_features`), checked against the
observation's placeholder tokens, and kept in the context until the observation is appended
(:func:`fsm_rollout.rollout.steps.append_observation` merges them), so an observation that does not fit the budget
leaves nothing of itself behind.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fsm_rollout.errors import (
    ImageObservationError,
    ImageObservationFeaturesMissingError,
    TemplateNotPrefixStable,
)
from fsm_rollout.multimodal import (
    ImageLimits,
    RenderMessages,
    check_encoded_sizes,
    check_image_limits,
    check_observation_tokens,
    fill_null_items,
    image_features,
    known_items,
    merge_features,
    place_features,
    prepare_render_messages,
)
from fsm_rollout.rollout.context import RolloutContext
from fsm_rollout.types import RenderedPrompt

Render = Callable[[dict[str, Any]], Awaitable[RenderedPrompt]]
"""Sends one render request (through the rollout's client and cancel scope) and returns its parsed answer."""


def image_limits(ctx: RolloutContext) -> ImageLimits:
    """The rollout's limits on one observation image."""
    config = ctx.deps.config
    return ImageLimits(max_bytes=config.observation_image_max_bytes, max_pixels=config.observation_image_max_pixels)


async def encode_image_observation(ctx: RolloutContext, messages: list[dict[str, Any]], render: Render) -> None:
    """Encode an observation with images: set ``observation_tokens``, ``observation_features``,
    ``observation_image_hashes`` and ``observation_messages`` (images as their hashes) on ``ctx``."""
    sample, deps, sample_id = ctx.sample, ctx.deps, ctx.sample_id
    config = deps.config
    what = f"observation {ctx.turn_index}"
    messages = [_as_image_parts(message) for message in messages]
    prepared = _prepared(ctx, messages)
    tools = sample.metadata.get("tools")
    dummy, prefix, eos_index = deps.encoder.image_render_prefix(
        messages, tools=tools, template_kwargs=config.apply_chat_template_kwargs
    )
    payload: dict[str, Any] = {"model": config.model, "messages": [*dummy, *prepared.messages]}
    if tools is not None:
        payload["tools"] = tools
    if config.apply_chat_template_kwargs:
        payload["chat_template_kwargs"] = dict(config.apply_chat_template_kwargs)
    rendered = await render(payload)
    ids = rendered.token_ids
    if ids[: len(prefix)] != prefix:
        raise TemplateNotPrefixStable(
            f"sample {sample_id}: the engine's render of the dummy prefix before {what} differs from the local chat "
            "template's: the engine and the local tokenizer must use the same chat template"
        )
    tokens = sample.tokens
    cut = eos_index + (1 if tokens and tokens[-1] == deps.encoder.eos_token_id else 0)
    boundary = list(ids[cut:])
    features = image_features(rendered.generate_body.get("features"), what=what, sample_id=sample_id)
    images = len(prepared.image_hashes)
    if features is None:
        raise ImageObservationFeaturesMissingError(
            f"sample {sample_id}: {what} holds {images} image(s) but the engine's render answered no image features "
            "(is the served model a vision-language model?)"
        )
    found = len(features["mm_placeholders"]["image"])
    if found != images:
        raise ImageObservationError(
            f"sample {sample_id}: {what} holds {images} image(s) but the engine's render placed {found}"
        )
    current = ctx.rendered.generate_body.get("features") if ctx.rendered is not None else None
    placed = place_features(
        features,
        shift=len(tokens) - cut,
        first_offset=len(tokens),
        end=len(tokens) + len(boundary),
        known=known_items(current),
        what=what,
        sample_id=sample_id,
    )
    check_observation_tokens(
        boundary,
        placed,
        tokenizer=deps.tokenizer,
        processor=deps.processor,
        placeholder_token=config.image_placeholder_token,
        merge_size=config.image_merge_size,
        sample_id=sample_id,
    )
    ctx.observation_tokens = boundary
    ctx.observation_features = placed
    ctx.observation_image_hashes = prepared.image_hashes
    ctx.observation_messages = hashed_messages(messages, prepared.image_hashes)


def render_ready_observation(ctx: RolloutContext, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An observation with images as the render request sends it (images as ``data:`` URLs, within the limits),
    with ``observation_image_hashes`` set on ``ctx``: what the ``fork`` and ``per_turn`` policies put in the
    conversation they re-render, so every later render and generate request carries the images of its prefix."""
    prepared = _prepared(ctx, [_as_image_parts(message) for message in messages])
    ctx.observation_image_hashes = prepared.image_hashes
    return prepared.messages


def filling_render(ctx: RolloutContext, render: Render) -> Render:
    """``render`` for the re-renders of the ``fork`` and ``per_turn`` policies: a null image item in the answer (the
    engine's processor cache has the image from an earlier request of the sample) is filled from the sample's item
    of the same hash, or refused, before any generate request could carry it."""

    async def filled(payload: dict[str, Any]) -> RenderedPrompt:
        rendered = await render(payload)
        features = rendered.generate_body.get("features")
        current = ctx.rendered.generate_body.get("features") if ctx.rendered is not None else None
        complete = fill_null_items(features, sample_id=ctx.sample_id, known=known_items(current))
        if complete is features:
            return rendered
        return RenderedPrompt(
            token_ids=rendered.token_ids, generate_body={**rendered.generate_body, "features": complete}
        )

    return filled


def _prepared(ctx: RolloutContext, messages: list[dict[str, Any]]) -> RenderMessages:
    limits = image_limits(ctx)
    check_image_limits(messages, limits, sample_id=ctx.sample_id)
    prepared = prepare_render_messages(messages, sample_id=ctx.sample_id, fast=True)
    check_encoded_sizes(prepared.messages, limits, sample_id=ctx.sample_id)
    return prepared


def with_observation_features(rendered: RenderedPrompt | None, features: dict[str, Any]) -> RenderedPrompt:
    """The rendered prompt whose generate body carries ``features`` (placed) after its own: every later request
    sends every image so far, and :func:`~fsm_rollout.rollout.steps.finalize` decodes them all, in order."""
    assert rendered is not None  # an observation follows a rendered prompt
    body = dict(rendered.generate_body)
    body["features"] = merge_features(body.get("features"), features)
    return RenderedPrompt(token_ids=rendered.token_ids, generate_body=body)


def _as_image_parts(message: dict[str, Any]) -> dict[str, Any]:
    """An ``image_url`` part whose URL is not a ``data:``/``http(s)`` URL (a file path, a PIL image) as an ``image``
    part, which the render preparation turns into a data URL like a prompt's."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    parts = []
    for part in content:
        value = part.get("image_url") if isinstance(part, dict) and part.get("type") == "image_url" else None
        url = value.get("url") if isinstance(value, dict) else value
        if value is not None and not (isinstance(url, str) and url.startswith(("data:", "http://", "https://"))):
            part = {"type": "image", "image": url}
        parts.append(part)
    return {**message, "content": parts}


def hashed_messages(messages: list[dict[str, Any]], hashes: tuple[str, ...]) -> list[dict[str, Any]]:
    """The messages with each image part replaced by ``{"type": "image", "image_hash": HASH}``: what the sample's
    observation records keep (the pixels are in its features)."""
    out: list[dict[str, Any]] = []
    index = 0
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(dict(message))
            continue
        parts = []
        for part in content:
            if isinstance(part, dict) and (
                part.get("type") in ("image", "image_url") or "image" in part or "image_url" in part
            ):
                parts.append({"type": "image", "image_hash": hashes[index] if index < len(hashes) else None})
                index += 1
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out


__all__ = [
    "Render",
    "encode_image_observation",
    "filling_render",
    "hashed_messages",
    "image_limits",
    "render_ready_observation",
    "with_observation_features",
]
