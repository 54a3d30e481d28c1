"""Plain-dict (de)serialisation of the plan dataclasses, driven by their fields' annotations.

``to_dict(obj)`` gives str/int/float/bool/None, lists and dicts only (``json.dumps``-able, and
``torch.save``-able with ``weights_only=True``): a tensor becomes ``{"dtype", "shape", "data"}``
(``data`` flat, so the exact dtype and shape, empty dimensions included, come back), a tuple a
list, a nested dataclass its own dict. ``from_dict(cls, d)`` reads the annotations of ``cls``
(``Tensor``, ``X | None``, ``tuple[...]``, ``list[X]``, ``dict[str, X]``, dataclasses, scalars)
to rebuild each field; tensors come back on the CPU, missing keys take the field default.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

import torch

Tensor = torch.Tensor


def to_dict(obj: Any) -> dict[str, Any]:
    """The fields of dataclass ``obj`` as plain values (see the module docstring)."""
    return {f.name: _encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)}


def from_dict(cls: type, d: dict[str, Any]) -> Any:
    """Inverse of ``to_dict`` for dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    kwargs = {
        f.name: _decode(hints[f.name], d[f.name])
        for f in dataclasses.fields(cls)
        if f.init and f.name in d
    }
    return cls(**kwargs)


def _encode(x: Any) -> Any:
    if isinstance(x, Tensor):
        t = x.detach().cpu()
        return {
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "data": t.flatten().tolist(),
        }
    if dataclasses.is_dataclass(x):
        return to_dict(x)
    if isinstance(x, (list, tuple)):
        return [_encode(v) for v in x]
    if isinstance(x, dict):
        return {k: _encode(v) for k, v in x.items()}
    return x


def _decode(tp: Any, x: Any) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):  # X | None
        if x is None:
            return None
        return _decode(next(a for a in args if a is not type(None)), x)
    if tp is Tensor:
        if isinstance(x, Tensor):
            return x
        return torch.tensor(x["data"], dtype=getattr(torch, x["dtype"])).reshape(x["shape"])
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, x)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v) for v in x)
        return tuple(_decode(a, v) for a, v in zip(args, x, strict=True))
    if origin is list:
        return [_decode(args[0], v) for v in x]
    if origin is dict:
        return {k: _decode(args[1], v) for k, v in x.items()}
    if tp in (int, float, str, bool):
        return tp(x)
    return x
