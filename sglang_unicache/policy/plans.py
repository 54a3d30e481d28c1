"""What the policy decides for one request, and the executor's output: every tensor shape of the
plans is documented here once (notation in ``inputs.py``).

Every plan dataclass has ``to_dict()`` / ``from_dict(d)`` (``serial.py``: plain lists and dicts,
``json``- and ``torch.save``-able).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from sglang_unicache.policy import serial
from sglang_unicache.policy.inputs import ImageSpan

Tensor = torch.Tensor


class Serial:
    """``to_dict()`` and ``from_dict(d)`` of a plan dataclass, through ``serial.py``."""

    def to_dict(self) -> dict[str, Any]:
        return serial.to_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Any:
        return serial.from_dict(cls, d)


@dataclass
class LayerPlan(Serial):
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


@dataclass(frozen=True)
class ByteReport(Serial):
    """Exact bytes of one span's K+V, all layers. ``element_bytes`` is the input dtype's size.

    full: uncompressed span. nominal: sum over layers of K_l entries (what ``execute`` returns).
    physical: L * physical_slots entries, what a pool whose slot spans all layers holds
    (``docs/policy.md``, "Honest memory accounting"). quantized: int8/int4 payload + fp32 per-head
    scales of the nominal entries, 0 if quantization is off. head_merged: nominal entries stored
    once per head cluster (seed §3; needs its own storage, an MHA pool cannot realise it). metadata:
    bytes of the plan's tensors.
    """

    full: int
    nominal: int
    physical: int
    quantized: int
    head_merged: int
    metadata: int
    element_bytes: int


@dataclass(frozen=True)
class SelfCheckResult(Serial):
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
    content_threshold: float | None = None  # ``content_lost`` passes at or below it
    # Not computed because the plan sat at the top of its bounded ladder (``view_max_keep``):
    # it is decoded whatever a check would say.
    at_bound: bool = False

    @property
    def kl(self) -> float:
        return self.stats.get("kl", 0.0)

    def failure(self) -> str:
        """Each half of the check that failed, with its value and threshold ("" if passed)."""
        failed = []
        if self.value > self.threshold:
            failed.append(f"{self.statistic} {self.value:.3f} > {self.threshold:.3f}")
        lost = self.stats.get("content_lost")
        if lost is not None and self.content_threshold is not None \
                and lost > self.content_threshold:
            failed.append(f"content_lost {lost:.3f} > {self.content_threshold:.3f}")
        return " and ".join(failed)


@dataclass
class CompressionPlan(Serial):
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


@dataclass
class RequestPlan(Serial):
    """All span plans of one request plus request-level decisions.

    keep_ratio: the ratio actually used (differs from the config with dynamic_rate, §7.2).
    complexity: the §7.2 complexity score of the original input (None when not computed).
    escalations: how many times a failed self-check raised the keep ratio (``keep_ratio`` is
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


@dataclass
class QuantizedTensor(Serial):
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
class CompressedKV(Serial):
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
