"""Data types of the policy library; every tensor shape is documented here once.

Notation: ``L`` layers, ``T`` prompt tokens of one request, ``H`` KV heads, ``Hq`` query heads
(``Hq = H * G`` for GQA, query head ``h`` reads KV head ``h // G``), ``D`` head dim, ``W``
observation queries, ``N`` tokens of one span, ``K_l`` entries kept for a span in layer ``l``.

Layout: K/V are token-major ``[T, H, D]`` per layer (SGLang's pool layout), keys after RoPE.
``ScoreInputs`` accepts either a sequence of per-layer tensors or one stacked ``[L, T, H, D]``
tensor and stores a tuple of per-layer views (no copy).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

Tensor = torch.Tensor


def _cpu(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach().cpu()


class LayerView(Sequence[Tensor]):
    """Per-layer ``[T, H, D]`` tensors made on access (``get(layer)``, e.g. gathered from a KV
    pool one layer at a time), so a long prompt's K/V is never held for every layer at once.
    Every layer has ``shape``, ``dtype`` and ``device``."""

    def __init__(self, num_layers: int, shape: tuple[int, ...], get: Callable[[int], Tensor],
                 dtype: torch.dtype, device: torch.device):
        self._n, self.shape, self._get = num_layers, tuple(shape), get
        self.dtype, self.device = dtype, device

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, layer):
        if isinstance(layer, slice):
            return [self[i] for i in range(*layer.indices(self._n))]
        if layer < 0:
            layer += self._n
        if not 0 <= layer < self._n:
            raise IndexError(layer)
        return self._get(layer)


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
    """

    start: int
    end: int
    modality: str = "image"
    grid: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if not (0 <= self.start < self.end):
            raise ValueError(f"ImageSpan needs 0 <= start < end, got [{self.start}, {self.end})")
        if self.modality not in ("image", "text"):
            raise ValueError(f"ImageSpan.modality must be image or text, got {self.modality!r}")

    @classmethod
    def from_offsets(cls, start: int, end_inclusive: int) -> ImageSpan:
        return cls(start, end_inclusive + 1)

    @property
    def length(self) -> int:
        return self.end - self.start

    def to_dict(self) -> dict[str, Any]:
        return {
            "start": self.start,
            "end": self.end,
            "modality": self.modality,
            "grid": list(self.grid) if self.grid else None,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ImageSpan:
        grid = tuple(d["grid"]) if d.get("grid") else None
        return cls(int(d["start"]), int(d["end"]), d.get("modality", "image"), grid)  # type: ignore[arg-type]


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


@dataclass
class LayerPlan:
    """What happens to one span in one layer, per KV head (heads never disagree on the count).

    kept: ``[H, K]`` int64 source indices relative to the span, ascending per head. Entry j of the
        compressed layer holds (a merge onto) token ``kept[h, j]``.
    assign: ``[H, N]`` int32, compressed entry each source token folds into, -1 if evicted. A kept
        token ``kept[h, j]`` has ``assign == j``.
    weight: ``[H, N]`` float32 merge weight of each source token in its entry (each entry's
        weights sum to 1; a kept token with no merged neighbour has weight 1).
    budget: the layer's nominal budget K_l (``kept`` may be longer with layer_fill="next").
    head_map, head_weight: ``[H]`` head-merging bookkeeping (seed §3): KV head h is replaced by
        the weighted mean of the heads with the same ``head_map`` id. None when head merging is off.
    merges: False when no entry has more than one member (eviction only): the executor then only
        gathers. Set from the reducer's capability, so no device sync is needed to know it.
    priority: ``[H, K]`` float32 selection priority of each kept entry (protected entries rank
        above every other; see ``compressor.selection_key``): the order a later re-compression
        to a smaller budget drops entries in. None for plans built by hand.
    """

    kept: Tensor
    assign: Tensor
    weight: Tensor
    budget: int
    head_map: Tensor | None = None
    head_weight: Tensor | None = None
    merges: bool = True
    priority: Tensor | None = None

    @property
    def num_kept(self) -> int:
        return self.kept.shape[1]

    @property
    def num_merged(self) -> int:
        """Source tokens folded into an entry other than their own (all heads)."""
        return int((self.assign >= 0).sum()) - self.kept.numel()

    def to_dict(self) -> dict[str, Any]:
        return {
            "kept": _cpu(self.kept),
            "assign": _cpu(self.assign),
            "weight": _cpu(self.weight),
            "budget": self.budget,
            "head_map": _cpu(self.head_map),
            "head_weight": _cpu(self.head_weight),
            "merges": self.merges,
            "priority": _cpu(self.priority),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LayerPlan:
        return cls(
            d["kept"],
            d["assign"],
            d["weight"],
            int(d["budget"]),
            d.get("head_map"),
            d.get("head_weight"),
            bool(d.get("merges", True)),
            d.get("priority"),
        )


@dataclass(frozen=True)
class ByteReport:
    """Exact bytes of one span's K+V, all layers. ``element_bytes`` is the input dtype's size.

    full: uncompressed span. nominal: sum over layers of K_l entries (what ``execute`` returns).
    physical: L * physical_slots entries, what a pool whose slot spans all layers holds
    (DESIGN §5). quantized: int8/int4 payload + fp32 per-head scales of the nominal entries, 0 if
    quantization is off. head_merged: nominal entries stored once per head cluster (seed §3;
    needs its own storage, an MHA pool cannot realise it). metadata: bytes of the plan's tensors.
    """

    full: int
    nominal: int
    physical: int
    quantized: int
    head_merged: int
    metadata: int
    element_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ByteReport:
        return cls(**{k: int(v) for k, v in d.items()})


@dataclass(frozen=True)
class SelfCheckResult:
    """Self-check (seed §7.1): ``passed`` False tells the caller to escalate the budget or keep
    the full KV. ``value`` is the deciding ``statistic``; ``stats`` holds every statistic the check
    computed (``checks/selfcheck.py``), so they can be studied against answer quality."""

    statistic: str
    value: float
    threshold: float
    layers: tuple[int, ...]
    checked: bool  # False when no observation query sees the compressed spans
    passed: bool
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def kl(self) -> float:
        return self.stats.get("kl", 0.0)

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "layers": list(self.layers), "stats": dict(self.stats)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SelfCheckResult:
        return cls(
            str(d["statistic"]),
            float(d["value"]),
            float(d["threshold"]),
            tuple(d["layers"]),
            bool(d["checked"]),
            bool(d["passed"]),
            {k: float(v) for k, v in d.get("stats", {}).items()},
        )


@dataclass
class CompressionPlan:
    """The plan for one span: what the engine stores per cached image.

    physical_slots = max_l K_l: the slots a pool whose slot spans all layers must hold. In layers
    with K_l < physical_slots the remaining slots are not described by the plan unless
    ``layer_fill == "next"`` filled them with next-best tokens (then every layer has K = slots).
    protected: ``[P]`` int64 span-relative indices kept in every layer and head (alignment tokens
    and caller-protected tokens).
    """

    span: ImageSpan
    method: str
    layers: list[LayerPlan]
    protected: Tensor
    physical_slots: int
    bytes: ByteReport
    quantization: str = "off"
    skipped: bool = False  # span below min_image_tokens or method "full": identity plan
    selfcheck: SelfCheckResult | None = None

    @property
    def fallback(self) -> bool:
        return self.selfcheck is not None and not self.selfcheck.passed

    @property
    def layer_counts(self) -> list[int]:
        return [lp.num_kept for lp in self.layers]

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of str/int/float/bool/list and CPU tensors (``torch.save``-able with
        ``weights_only=True``)."""
        return {
            "span": self.span.to_dict(),
            "method": self.method,
            "layers": [lp.to_dict() for lp in self.layers],
            "protected": _cpu(self.protected),
            "physical_slots": self.physical_slots,
            "bytes": self.bytes.to_dict(),
            "quantization": self.quantization,
            "skipped": self.skipped,
            "selfcheck": self.selfcheck.to_dict() if self.selfcheck else None,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CompressionPlan:
        sc = d.get("selfcheck")
        return cls(
            span=ImageSpan.from_dict(d["span"]),
            method=d["method"],
            layers=[LayerPlan.from_dict(x) for x in d["layers"]],
            protected=d["protected"],
            physical_slots=int(d["physical_slots"]),
            bytes=ByteReport.from_dict(d["bytes"]),
            quantization=d.get("quantization", "off"),
            skipped=bool(d.get("skipped", False)),
            selfcheck=SelfCheckResult.from_dict(sc) if sc else None,
        )


@dataclass
class RequestPlan:
    """All span plans of one request plus request-level decisions.

    keep_ratio: the ratio actually used (differs from the config with dynamic_rate, §7.2).
    complexity: the §7.2 complexity score of the original input (None when not computed).
    escalations: how many times a failed self-check doubled the keep ratio (``keep_ratio`` is
        the one the spans were planned at).
    alignment: ``[T]`` bool alignment tokens found (seed §5.3), text and image; None if not
        computed.
    """

    method: str
    spans: list[CompressionPlan]
    keep_ratio: float
    selfcheck: SelfCheckResult | None = None
    complexity: float | None = None
    alignment: Tensor | None = None
    escalations: int = 0

    @property
    def fallback(self) -> bool:
        return self.selfcheck is not None and not self.selfcheck.passed

    def image_plans(self) -> list[CompressionPlan]:
        return [p for p in self.spans if p.span.modality == "image"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "spans": [p.to_dict() for p in self.spans],
            "keep_ratio": self.keep_ratio,
            "selfcheck": self.selfcheck.to_dict() if self.selfcheck else None,
            "complexity": self.complexity,
            "alignment": _cpu(self.alignment),
            "escalations": self.escalations,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestPlan:
        sc = d.get("selfcheck")
        return cls(
            d["method"],
            [CompressionPlan.from_dict(x) for x in d["spans"]],
            float(d["keep_ratio"]),
            SelfCheckResult.from_dict(sc) if sc else None,
            d.get("complexity"),
            d.get("alignment"),
            int(d.get("escalations", 0)),
        )


@dataclass
class QuantizedTensor:
    """Per-head symmetric quantization of ``[K, H, D]`` (seed §6.3).

    data: int8 ``[H, K*D]`` (bits=8) or uint8 ``[H, ceil(K*D/2)]`` holding two 4-bit codes per
    byte (bits=4, low nibble first, code = q + 8). scale: ``[H]`` float32.
    """

    data: Tensor
    scale: Tensor
    bits: int
    shape: tuple[int, int, int]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * 4


@dataclass
class CompressedKV:
    """Executor output for one span: per layer ``[K_l, H, D]`` keys and values in the input dtype
    (dequantized when quantization is on), plus the quantized payload if any."""

    keys: list[Tensor]
    values: list[Tensor]
    quantized_keys: list[QuantizedTensor] | None = None
    quantized_values: list[QuantizedTensor] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the dense K/V tensors returned (equals ``ByteReport.nominal``)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    @property
    def quantized_nbytes(self) -> int:
        """Bytes of the quantized payload (equals ``ByteReport.quantized``), 0 if none."""
        if self.quantized_keys is None or self.quantized_values is None:
            return 0
        return sum(q.nbytes for q in (*self.quantized_keys, *self.quantized_values))
