"""A sample's values as JSON-compatible data and back: enums, statistics, numpy arrays and tensors."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import numpy as np

from fsm_rollout.sample.status import PrefixCacheInfo, SpecInfo

_PLAIN = frozenset({int, float, str, bool, type(None)})
"""Types a list holds as they are: token ids, masks and logprobs are long lists of these, copied without a walk."""


def _plain_list(value: list[Any] | tuple[Any, ...]) -> bool:
    return set(map(type, value)) <= _PLAIN


def _is_tensor(value: Any) -> bool:
    """Duck-typed torch tensor check, so serialising never imports torch."""
    return (
        not isinstance(value, np.ndarray)
        and hasattr(value, "detach")
        and (hasattr(value, "numpy") or hasattr(value, "tolist"))
    )


def encode(value: Any) -> Any:
    """``value`` as ``Sample.to_dict`` writes it (the format is described there)."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, SpecInfo | PrefixCacheInfo):
        return asdict(value)
    if isinstance(value, np.ndarray):
        return {
            "__ndarray__": True,
            "dtype": str(value.dtype),
            "shape": list(value.shape),
            "data": value.ravel().tolist(),
        }
    if isinstance(value, np.generic):
        return value.item()
    if _is_tensor(value):
        tensor = value.detach().cpu()
        return {
            "__tensor__": True,
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "shape": list(tensor.shape),
            "data": tensor.reshape(-1).tolist(),
        }
    if isinstance(value, Mapping):
        return {key: encode(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return list(value) if _plain_list(value) else [encode(item) for item in value]
    return value


def decode(value: Any) -> Any:
    """The value :func:`encode` wrote, with arrays and tensors restored."""
    if isinstance(value, Mapping):
        if value.get("__ndarray__") is True:
            return np.asarray(value["data"], dtype=np.dtype(value["dtype"])).reshape(value["shape"])
        if value.get("__tensor__") is True:
            return _tensor_from(value)
        return {key: decode(item) for key, item in value.items()}
    if isinstance(value, list):
        return list(value) if _plain_list(value) else [decode(item) for item in value]
    return value


def _tensor_from(encoded: Mapping[str, Any]) -> Any:
    import torch  # only samples that carry tensors need torch

    dtype = getattr(torch, encoded["dtype"])
    return torch.tensor(encoded["data"], dtype=dtype).reshape(encoded["shape"])
