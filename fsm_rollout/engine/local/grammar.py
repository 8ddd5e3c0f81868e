"""Constrained decoding for the embedded engine: vLLM's ``structured_outputs`` compiled by xgrammar (the library
vLLM uses), and a token bitmask applied to each decode step's logits.

xgrammar is the optional extra ``structured`` (``pip install 'fsm-rollout[structured]'``); it is imported when a
request first asks for a grammar, and a request that asks without it installed gets a clear 400. One compiler per
tokenizer caches what it compiled, so a schema sent again compiles once.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from fsm_rollout.engine.schema import RequestError

__all__ = ["GrammarMask", "grammar_available"]

_MISSING = (
    "structured_outputs needs xgrammar on the embedded engine: pip install 'fsm-rollout[structured]' "
    "(or send the request to a vLLM server)"
)

_compilers: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def grammar_available() -> bool:
    """Whether xgrammar can be imported."""
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


def _compiler(tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int]) -> Any:
    try:
        import xgrammar
    except ImportError as error:
        raise RequestError(400, _MISSING, "structured_outputs") from error
    with _lock:
        found = _compilers.get(tokenizer)
        if found is None or found[0] != (vocab_size, stop_token_ids):
            info = xgrammar.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
            )
            found = ((vocab_size, stop_token_ids), xgrammar.GrammarCompiler(info))
            _compilers[tokenizer] = found
        return found[1]


def _compile(compiler: Any, spec: Mapping[str, Any]) -> Any:
    """The compiled grammar of a checked ``structured_outputs`` (as vLLM's xgrammar backend compiles each kind)."""
    any_whitespace = not spec.get("disable_any_whitespace")
    if spec.get("json") is not None:
        schema = spec["json"]
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=any_whitespace)
    if spec.get("json_object"):
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
    if spec.get("regex") is not None:
        return compiler.compile_regex(spec["regex"])
    if spec.get("grammar") is not None:
        return compiler.compile_grammar(spec["grammar"])
    if spec.get("choice") is not None:
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(item) for item in spec["choice"]))
    if spec.get("structural_tag") is not None:
        return compiler.compile_structural_tag(spec["structural_tag"])
    raise RequestError(400, "structured_outputs names no constraint", "structured_outputs")


class GrammarMask:
    """One request's grammar state: which tokens the grammar allows next, and the tokens it has taken.

    :meth:`apply` sets every disallowed logit to -inf in place, so the token is sampled, and its logprob computed,
    from the masked distribution; :meth:`accept` advances the grammar by the sampled token.
    """

    def __init__(
        self, spec: Mapping[str, Any], *, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int]
    ) -> None:
        compiler = _compiler(tokenizer, vocab_size, stop_token_ids)
        import xgrammar  # importable: _compiler refused otherwise

        if spec.get("whitespace_pattern") is not None:
            raise RequestError(
                400, "structured_outputs.whitespace_pattern is not supported with xgrammar", "structured_outputs"
            )
        try:
            compiled = _compile(compiler, spec)
        except RequestError:
            raise
        except Exception as error:  # xgrammar's own errors name the bad schema, regex or grammar
            raise RequestError(400, f"structured_outputs: {error}", "structured_outputs") from error
        self._xgrammar = xgrammar
        self._matcher = xgrammar.GrammarMatcher(compiled)
        self._bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
        self._vocab_size = vocab_size

    def apply(self, logits: torch.Tensor) -> None:
        """Mask ``logits`` (one row, float32) to what the grammar allows next."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        self._xgrammar.apply_token_bitmask_inplace(logits.view(1, -1), self._bitmask, vocab_size=self._vocab_size)

    def accept(self, token: int) -> None:
        """Advance the grammar by the sampled token (which :meth:`apply` allowed)."""
        if not self._matcher.is_terminated():
            self._matcher.accept_token(token)
