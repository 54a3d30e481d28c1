"""Score capture: the observation queries of each eligible request, taken during its prefill.

The AROUND hook on ``AttentionBackend.forward`` (``hooks.py``) sees every layer's post-RoPE queries
of the tokens being extended, for any attention backend. Before the forward, ``QueryCapture``
computes once which rows of the flattened batch are the last W prompt positions of the requests that
will be compressed; each layer costs one gather (no loop, no host sync). Memory:
``layers x W x q_heads x head_dim`` per request. Keys need no capture: they are in the KV pool
after the forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class CaptureTarget:
    """One request whose observation queries this forward collects."""

    rid: str
    batch_index: int
    rows: range  # rows of the flattened extend tokens (the last W of this request)
    positions: range  # their token positions in the request


@dataclass
class QueryCapture:
    """Observation queries of every target, per layer: ``queries[layer] = [sum W, Hq, D]``."""

    targets: list[CaptureTarget]
    index: torch.Tensor  # [sum W] int64 rows, in target order
    starts: dict[str, int]  # rid -> first row of its queries in ``index``
    queries: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def for_targets(cls, targets: list[CaptureTarget], device) -> QueryCapture:
        rows, starts = [], {}
        for target in targets:
            starts[target.rid] = len(rows)
            rows += target.rows
        return cls(targets, torch.tensor(rows, dtype=torch.int64, device=device), starts)

    def record(self, layer_id: int, q: torch.Tensor, head_dim: int) -> None:
        q = q.reshape(q.shape[0], -1, head_dim)
        self.queries[layer_id] = q.index_select(0, self.index)

    def queries_of(self, target: CaptureTarget) -> list[torch.Tensor]:
        """Per layer ``[W, Hq, D]`` for one target, in layer order."""
        start = self.starts[target.rid]
        stop = start + len(target.rows)
        return [self.queries[layer][start:stop] for layer in sorted(self.queries)]
