"""fsm-rollout as a verl agent loop: :class:`FsmRolloutAgentLoop`, registered with verl as ``fsm_rollout``.

verl's agent-loop workers call ``run(sampling_params, **row)`` once per sample, with the dataset row's fields
(``raw_prompt``, ``reward_model``, ``extra_info``, ...). The loop rolls the row out through the lifecycle machine,
with an environment of ours (``env=``: a module name, a ``.py`` path, or an adapter's name such as ``gym:ID``),
and verl's server manager as the engine: :class:`VerlServerTransport` is a
:class:`~fsm_rollout.engine.transport.Transport` that answers the client's render requests with the tokenizer's
chat template and its generate requests with ``server_manager.generate(request_id, prompt_ids, sampling_params)``,
so the rollout's tokens are exactly the ones verl's servers produced. The answer is verl's ``AgentLoopOutput``:
the prompt and response ids, the loss mask (1 for the model's tokens, 0 for observations), the log-probs,
``reward_score`` (the environment's reward, None when it gave none), ``num_turns`` and, in ``extra_fields``, the
rollout's status and reason.

Use it from verl's agent-loop config (``_target_: fsm_rollout.adapters.verl_agent_loop.FsmRolloutAgentLoop``,
``env: gym:...``) or by importing this module (the ``register`` call) and setting a row's ``agent_name`` to
``fsm_rollout``. Text only: an image observation is refused by the render. The rollout keeps one sequence
(history policy ``append``), since an ``AgentLoopOutput`` holds one.

verl does not install beside this project's pins with pip's resolver: verl 0.9.1 requires
``transformers>=5.5.3,<5.11,!=5.6.0``, this package ``transformers>=5.16``.
Its agent-loop module imports with them when installed without its dependencies plus the few it needs::

    pip install --no-deps verl==0.9.1 tensordict==0.15.3 pyvers==0.2.3 codetiming==1.4.0 cachetools==8.0.2 \
        hydra-core==1.4.0rc3 omegaconf==2.4.1rc1

(hydra-core 1.3's grammar needs the antlr runtime 4.9, which omegaconf 2.4 replaced; hydra-core 1.4.0rc3 needs
omegaconf 2.4.1rc1). So verl is no extra of this project: this module imports it and fails without it.
"""

from __future__ import annotations

import operator
import uuid
from collections.abc import Mapping
from typing import Any

try:
    from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register
except ImportError as error:  # verl is no extra (see above): say how to install it, in one line
    raise ImportError(
        "fsm_rollout.adapters.verl_agent_loop needs verl, which is not an extra of fsm-rollout: pip install "
        "--no-deps verl==0.9.1 tensordict==0.15.3 pyvers==0.2.3 codetiming==1.4.0 cachetools==8.0.2 "
        f"hydra-core==1.4.0rc3 omegaconf==2.4.1rc1 ({error})"
    ) from error

from fsm_rollout.config import RolloutConfig
from fsm_rollout.engine.client import VLLMClient
from fsm_rollout.engine.schema import ABORT_PATH, GENERATE_PATH, RENDER_PATH, RequestError
from fsm_rollout.engine.serving import (
    GenerateOutcome,
    generate_answer,
    parse_generate_request,
    parse_render_request,
    render_answer,
)
from fsm_rollout.envs.protocol import load_env_factory
from fsm_rollout.errors import EngineHTTPError, RolloutError
from fsm_rollout.rollout import Rollout
from fsm_rollout.sample import Sample

AGENT_NAME = "fsm_rollout"
SERVER_LABEL = "http://verl-server-manager.invalid"
"""The engine URL the rollout's config and errors name: requests go to verl's server manager, not over HTTP."""
_VERL_SAMPLING = ("temperature", "top_p", "top_k", "repetition_penalty", "min_p", "seed")
"""The sampling settings of a request that go on to verl's server (with ``max_tokens``, stops and log-probs)."""


class VerlServerTransport:
    """The engine client's transport over verl's server manager (see the module docstring).

    ``request_id`` is verl's sticky-session id: every generate request of the rollout carries it, so verl keeps
    the rollout on one server (its prefix cache). ``sampling_params`` are verl's for the sample; the request's own
    ``max_tokens``, stops and seed take precedence.
    """

    def __init__(
        self,
        server_manager: Any,
        tokenizer: Any,
        *,
        model: str,
        max_model_len: int,
        request_id: str,
        sampling_params: Mapping[str, Any] | None = None,
    ) -> None:
        self.server_manager = server_manager
        self.tokenizer = tokenizer
        self.model = model
        self.max_model_len = max_model_len
        self.request_id = request_id
        self.sampling_params = dict(sampling_params or {})

    @property
    def base_url(self) -> str:
        return SERVER_LABEL

    async def close(self) -> None:
        """Nothing: the server manager is verl's."""

    async def post_json(
        self, path: str, payload: Mapping[str, Any], *, headers: Mapping[str, str] | None = None
    ) -> Any:
        try:
            if path == RENDER_PATH:
                return self._render(payload)
            if path == GENERATE_PATH:
                return await self._generate(payload)
        except RequestError as error:
            raise EngineHTTPError(
                f"verl transport: {error.message}", status=error.status, url=self.base_url + path, body=error.message
            ) from error
        if path == ABORT_PATH:  # verl's server manager cancels no single request: the turn in flight runs out
            return {}
        raise EngineHTTPError(
            f"verl transport: {path} is not served (render and generate only)",
            status=404,
            url=self.base_url + path,
            body="",
        )

    def _render(self, payload: Mapping[str, Any]) -> Any:
        request = parse_render_request(payload, self.model)
        for index, message in enumerate(request.messages):
            if isinstance(message.get("content"), list) and any(
                isinstance(part, Mapping) and part.get("type") not in (None, "text") for part in message["content"]
            ):
                raise RequestError(400, f"messages[{index}]: only text parts go through verl's agent loop", "messages")
        ids = _token_ids(
            self.tokenizer.apply_chat_template(
                request.messages,
                tools=request.tools,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                tokenize=True,
                return_dict=False,
                **request.template_kwargs,
            )
        )
        return render_answer(request, ids, None, model=self.model, max_model_len=self.max_model_len)

    async def _generate(self, payload: Mapping[str, Any]) -> Any:
        request = parse_generate_request(payload, self.model, max_model_len=self.max_model_len)
        settings = request.settings
        asked = {
            "temperature": settings.temperature,
            "top_p": settings.top_p,
            "top_k": settings.top_k,
            "repetition_penalty": settings.repetition_penalty,
            "min_p": settings.min_p,
            "seed": settings.seed,
        }
        params = {key: value for key, value in self.sampling_params.items() if key in _VERL_SAMPLING}
        params.update({key: value for key, value in asked.items() if key in payload.get("sampling_params", {})})
        params = {key: value for key, value in params.items() if value is not None}
        params["max_tokens"] = settings.max_tokens
        params["logprobs"] = True
        if settings.stop:
            params["stop"] = list(settings.stop)
        if settings.stop_token_ids:
            params["stop_token_ids"] = sorted(settings.stop_token_ids)
        output = await self.server_manager.generate(
            request_id=self.request_id, prompt_ids=list(request.token_ids), sampling_params=params, image_data=None
        )
        tokens = [int(token) for token in output.token_ids]
        logprobs = list(output.log_probs or [])
        if len(logprobs) != len(tokens):
            raise RolloutError(
                f"verl's server manager answered {len(tokens)} tokens with {len(logprobs)} log-probs; the rollout "
                "needs one per token (sampling_params['logprobs'] was asked)"
            )
        outcome = GenerateOutcome(
            token_ids=tokens,
            finish=_finish(output, tokens, settings.max_tokens, self.tokenizer.eos_token_id),
            logprobs=[
                {"token_id": token, "logprob": float(value), "rank": 1, "top_logprobs": []}
                for token, value in zip(tokens, logprobs, strict=True)
            ],
            weight_versions=None,
        )
        return generate_answer(request.request_id, len(request.token_ids), outcome, model=self.model)


def _token_ids(encoded: Any) -> list[int]:
    """The ids ``apply_chat_template(tokenize=True)`` returned: a list, or a mapping with ``input_ids``."""
    if isinstance(encoded, Mapping) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]
    return [int(token) for token in encoded]


def _finish(output: Any, tokens: list[int], max_tokens: int, eos: int | None) -> Any:
    """vLLM's finish reason for verl's answer, which says only ``completed`` or ``aborted``."""
    if getattr(output, "stop_reason", None) == "aborted":
        return "abort"
    if len(tokens) >= max_tokens and (not tokens or tokens[-1] != eos):
        return "length"
    return "stop"


def _reward(value: Any) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _sample(row: Mapping[str, Any]) -> Sample:
    """The sample a verl dataset row describes: its chat prompt, its ground truth as the label, its fields as
    metadata (the JSON-able ones a tape can hold: ``extra_info``, ``reward_model``, ``data_source``, ...), its
    ``index`` (an integer, numpy's too) as the sample's index, which seeds a game's episode."""
    prompt = row.get("raw_prompt")
    if prompt is None:
        raise RolloutError("verl agent loop: the row has no raw_prompt (set data.return_raw_chat=True)")
    reward_model = row.get("reward_model")
    label = reward_model.get("ground_truth") if isinstance(reward_model, Mapping) else None
    metadata = {
        key: row[key]
        for key in ("data_source", "extra_info", "reward_model", "tools_kwargs", "index")
        if key in row and isinstance(row[key], str | int | float | dict | list)
    }
    index: Any = row.get("index")
    return Sample(
        prompt=[dict(message) for message in prompt],
        label=label,
        metadata=metadata,
        index=None if isinstance(index, bool) or not hasattr(index, "__index__") else operator.index(index),
    )


@register(AGENT_NAME)
class FsmRolloutAgentLoop(AgentLoopBase):  # type: ignore[misc]
    """verl's agent loop over an fsm-rollout rollout (see the module docstring).

    ``env`` names the environment (required); ``max_turns`` defaults to verl's
    ``multi_turn.max_assistant_turns`` (else 4); ``config`` holds further :class:`~fsm_rollout.RolloutConfig`
    fields. The response budget is verl's ``rollout.response_length``.
    """

    def __init__(
        self,
        *args: Any,
        env: str | None = None,
        max_turns: int | None = None,
        config: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if not env:
            raise RolloutError(
                "verl agent loop fsm_rollout needs env= (a module, a .py path or an adapter's name such as gym:ID)"
            )
        rollout = self.rollout_config
        if max_turns is None:
            multi_turn = rollout.get("multi_turn") or {}
            max_turns = multi_turn.get("max_assistant_turns") or 4
        self.env_factory = load_env_factory(env)
        self.response_length = int(rollout.response_length)
        self.max_model_len = int(rollout.get("max_model_len") or rollout.prompt_length + rollout.response_length)
        model = str(self.config.actor_rollout_ref.model.get("path") or AGENT_NAME)
        self.rollout_settings = RolloutConfig(
            engine_url=SERVER_LABEL,  # a label only: the transport goes to verl's server manager
            model=model,
            max_turns=int(max_turns),
            history_policy="append",
            **dict(config or {}),
        )

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        sample = _sample(kwargs)
        transport = VerlServerTransport(
            self.server_manager,
            self.tokenizer,
            model=self.rollout_settings.model,
            max_model_len=self.max_model_len,
            request_id=uuid.uuid4().hex,
            sampling_params=sampling_params,
        )
        ours = {"max_new_tokens": self.response_length, "temperature": sampling_params.get("temperature", 1.0),
                "top_p": sampling_params.get("top_p", 1.0)}  # fmt: skip
        rollout = Rollout(
            sample,
            config=self.rollout_settings,
            sampling_params=ours,
            client=VLLMClient(transport=transport),
            tokenizer=self.tokenizer,
            env_factory=self.env_factory,
        )
        await rollout.run()
        return agent_loop_output(sample)


def agent_loop_output(sample: Sample) -> AgentLoopOutput:
    """verl's ``AgentLoopOutput`` for a finished rollout."""
    if sample.branches:
        raise RolloutError("verl agent loop: the rollout forked into several sequences; an AgentLoopOutput holds one")
    length = sample.response_length
    split = len(sample.tokens) - length
    metadata = sample.metadata or {}
    turns = _runs(sample.loss_mask or [1] * length)
    return AgentLoopOutput(
        prompt_ids=list(sample.tokens[:split]),
        response_ids=list(sample.tokens[split:]),
        response_mask=[int(value) for value in (sample.loss_mask or [1] * length)],
        response_logprobs=[float(value) for value in (sample.rollout_log_probs or [0.0] * length)],
        multi_modal_data={},
        reward_score=_reward(sample.reward),
        num_turns=1 + turns,
        metrics={},
        extra_fields={
            "rollout_status": sample.status.value,
            "rollout_reason": metadata.get("rollout_reason"),
        },
    )


def _runs(mask: list[int]) -> int:
    """The turns in a response: its runs of equal mask values (the model's turns and the observations)."""
    return sum(1 for index, value in enumerate(mask) if index == 0 or value != mask[index - 1])
