"""Contract of a scorer (the "which tokens" axis).

``score(ctx, layer) -> [H, T]`` fp32: the importance of every token of the request for each KV
head of ``layer``; higher = keep. Scores of text tokens are computed too (used when
``compress_text`` is on) but only span columns are ever ranked, and only against tokens of the same
span, so scorers need not make spans comparable. A scorer reads signals from ``PlanContext`` and
never modifies inputs. Its fields are its parameters (built from the config by
``catalog.from_config``); ``@scorer(name, needs_queries=..., query_dependent=...)`` makes it a
frozen dataclass and sets its name and the capabilities below as class attributes.

Capabilities (read by the compressor and the engine instead of isinstance checks):
- ``needs_queries``: cannot run without observation queries (raises a clear ValueError).
- ``query_dependent``: the selection depends on the question that was prefilled; a span compressed
  by such a scorer and shared through the radix tree serves later questions less well
  (``docs/method.md``, "Query robustness").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from sglang_unicache.policy.context import PlanContext


class Scorer(Protocol):
    name: str
    needs_queries: bool
    query_dependent: bool

    def score(self, ctx: PlanContext, layer: int) -> torch.Tensor: ...
