"""What the policy sees of one request: its K/V, image spans and observation queries. Every tensor
shape of the policy layer is documented here and in ``plans.py`` once.

Notation: ``L`` layers, ``T`` prompt tokens of one request, ``H`` KV heads, ``Hq`` query heads
(``Hq = H * G`` for GQA, query head ``h`` reads KV head ``h // G``), ``D`` head dim, ``W``
observation queries, ``N`` tokens of one span, ``K_l`` entries kept for a span in layer ``l``.

Layout: K/V are token-major ``[T, H, D]`` per layer (SGLang's pool layout), keys after RoPE.
``ScoreInputs`` accepts either a sequence of per-layer tensors or one stacked ``[L, T, H, D]``
tensor and stores a tuple of per-layer views (no copy).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

Tensor = torch.Tensor


class LayerView(Sequence[Tensor]):
    """Per-layer ``[T, H, D]`` tensors made on access (``get(layer)``, e.g. gathered from a KV
    pool one layer at a time), so a long prompt's K/V is never held for every layer at once
    (``policy/stacked.py`` stacks a group of layers bounded by ``GROUP_BYTES``, only for prompts
    within ``stats_chunk``). The layer read last is kept, so the steps that read one layer in
    turn gather it once.
    Every layer has ``shape``, ``dtype`` and ``device``."""

    def __init__(self, num_layers: int, shape: tuple[int, ...], get: Callable[[int], Tensor],
                 dtype: torch.dtype, device: torch.device):
        self._n, self.shape, self._get = num_layers, tuple(shape), get
        self.dtype, self.device = dtype, device
        self._last: tuple[int, Tensor] | None = None

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, layer):
        if isinstance(layer, slice):
            return [self[i] for i in range(*layer.indices(self._n))]
        if layer < 0:
            layer += self._n
        if not 0 <= layer < self._n:
            raise IndexError(layer)
        if self._last is None or self._last[0] != layer:
            self._last = (layer, self._get(layer))
        return self._last[1]


def page_end(position, size: int):
    """The first page boundary at or after ``position`` (an int or an int tensor), in pages of
    ``size`` slots: where a paged KV cache's allocation of ``position`` slots ends."""
    return (position + size - 1) // size * size


def _shape(layers: Sequence[Tensor]) -> tuple[int, ...]:
    return layers.shape if isinstance(layers, LayerView) else tuple(layers[0].shape)


def _per_layer(x: Sequence[Tensor] | Tensor | None, name: str) -> tuple[Tensor, ...] | None:
    if x is None:
        return None
    if isinstance(x, LayerView):
        return x
    if isinstance(x, Tensor):
        return tuple(x.unbind(0))
    if not isinstance(x, Sequence) or not all(isinstance(t, Tensor) for t in x):
        raise ValueError(f"{name} must be a stacked tensor or a sequence of per-layer tensors")
    return tuple(x)


@dataclass(frozen=True)
class ImageSpan:
    """A compressible token range ``[start, end)`` (half-open) of one request.

    SGLang's ``mm_items[i].offsets`` are inclusive: use ``ImageSpan.from_offsets(s, e)``.
    ``modality`` is "image" for image spans; the library itself also builds "text" segments when
    ``compress_text`` is on. ``grid`` (rows, cols) is the optional patch grid (e.g. Qwen2-VL's
    merged ``h, w``); with it the redundancy signal uses row and column neighbours (UniCache §4.2).

    ``page`` (size, offset): a KV cache paged by ``size`` slots stores the span's entries from
    ``offset`` in a page on and frees only whole pages, so a plan keeps as many entries as fill
    the span's last page (``stored``; the engine's ``--page-size``). Default: one slot a page.
    """

    start: int
    end: int
    modality: str = "image"
    grid: tuple[int, int] | None = None
    page: tuple[int, int] = (1, 0)

    def __post_init__(self) -> None:
        if not (0 <= self.start < self.end):
            raise ValueError(f"ImageSpan needs 0 <= start < end, got [{self.start}, {self.end})")
        if self.modality not in ("image", "text"):
            raise ValueError(f"ImageSpan.modality must be image or text, got {self.modality!r}")
        size, offset = self.page
        if size < 1 or not 0 <= offset < size:
            raise ValueError(f"ImageSpan.page needs size >= 1 and 0 <= offset < size, got "
                             f"{self.page}")

    @classmethod
    def from_offsets(cls, start: int, end_inclusive: int) -> ImageSpan:
        return cls(start, end_inclusive + 1)

    @property
    def length(self) -> int:
        return self.end - self.start

    def stored(self, counts: Tensor) -> Tensor:
        """Entries a plan keeping ``counts`` (any int tensor) stores: each rounded up until the
        span's entries end on a page boundary; the whole span where that would drop less than a
        page (a lossy plan that frees no memory)."""
        size, offset = self.page
        if size == 1:
            return counts
        filled = page_end(counts + offset, size) - offset
        return torch.where(self.length - filled < size, self.length, filled)


@dataclass
class ScoreInputs:
    """Everything the policy sees of ONE request (prefill finished, nothing compressed yet).

    keys, values: per layer ``[T, H, D]`` (keys post-RoPE), any float dtype.
    spans: image spans, sorted, non-overlapping; every other token is text.
    obs_queries: per layer ``[W, Hq, D]`` post-RoPE queries of the observation positions, or None
        (then only question-free methods run: knorm, random, full, unicache without attention).
    obs_positions: ``[W]`` token positions of those queries; default the last W prompt positions.
    accumulated_attention: per layer ``[H, T]`` attention each key received from all queries
        (H2O); None -> H2O uses the observation window (documented departure).
    protected: ``[T]`` bool, tokens that must survive (e.g. alignment metadata stored in the radix
        tree from an earlier compression); honoured by every method.
    scale: softmax scale; default ``1/sqrt(D)``.
    """

    keys: Sequence[Tensor] | Tensor
    values: Sequence[Tensor] | Tensor
    spans: Sequence[ImageSpan]
    obs_queries: Sequence[Tensor] | Tensor | None = None
    obs_positions: Tensor | None = None
    accumulated_attention: Sequence[Tensor] | Tensor | None = None
    protected: Tensor | None = None
    scale: float | None = None

    def __post_init__(self) -> None:
        self.keys = _per_layer(self.keys, "keys")
        self.values = _per_layer(self.values, "values")
        self.obs_queries = _per_layer(self.obs_queries, "obs_queries")
        self.accumulated_attention = _per_layer(self.accumulated_attention, "accumulated_attention")
        self.spans = tuple(sorted(self.spans, key=lambda s: s.start))
        if not self.keys or len(self.keys) != len(self.values):
            raise ValueError("keys and values need the same, non-zero number of layers")
        t, h, d = _shape(self.keys)
        if isinstance(self.keys, LayerView) or isinstance(self.values, LayerView):
            if _shape(self.values) != (t, h, d):
                raise ValueError(f"every layer's keys/values must be [T={t}, H={h}, D={d}]")
        else:
            for k, v in zip(self.keys, self.values, strict=True):
                if k.shape != (t, h, d) or v.shape != (t, h, d):
                    raise ValueError(f"every layer's keys/values must be [T={t}, H={h}, D={d}]")
        for a, b in zip(self.spans, self.spans[1:], strict=False):
            if a.end > b.start:
                raise ValueError(f"spans overlap: [{a.start},{a.end}) and [{b.start},{b.end})")
        if self.spans and self.spans[-1].end > t:
            raise ValueError(f"span end {self.spans[-1].end} beyond the {t} tokens")
        if self.obs_queries is not None:
            if len(self.obs_queries) != len(self.keys):
                raise ValueError("obs_queries needs one tensor per layer")
            w, hq, dq = self.obs_queries[0].shape
            if dq != d or hq % h != 0:
                raise ValueError(f"obs_queries must be [W, H*G, {d}] with H={h}, got {(w, hq, dq)}")
            if self.obs_positions is None:
                self.obs_positions = torch.arange(t - w, t)
            if self.obs_positions.shape != (w,):
                raise ValueError(f"obs_positions must be [W={w}]")
        if self.accumulated_attention is not None:
            if len(self.accumulated_attention) != len(self.keys):
                raise ValueError("accumulated_attention needs one tensor per layer")
            for a in self.accumulated_attention:
                if tuple(a.shape) != (h, t):
                    raise ValueError(f"accumulated_attention must be [H={h}, T={t}] per layer "
                                     f"(KV heads x tokens), got {tuple(a.shape)}")
        if self.protected is not None and self.protected.shape != (t,):
            raise ValueError(f"protected must be a bool tensor [T={t}]")
        if self.scale is None:
            self.scale = d**-0.5

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def num_tokens(self) -> int:
        return _shape(self.keys)[0]

    @property
    def num_kv_heads(self) -> int:
        return _shape(self.keys)[1]

    @property
    def head_dim(self) -> int:
        return self.keys[0].shape[2]

    @property
    def device(self) -> torch.device:
        return self.keys.device if isinstance(self.keys, LayerView) else self.keys[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype if isinstance(self.keys, LayerView) else self.keys[0].dtype
