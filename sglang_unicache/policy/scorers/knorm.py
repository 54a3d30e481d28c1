"""Key-norm scorer (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV
Cache Compression"): keys with a *low* L2 norm tend to receive high attention, so score = -||k||.

Question-independent: the only baseline whose selection does not depend on the first question
(measured at 61% on reuse vs 15.6% for random at 10% keep; ``docs/quality-benchmark.md``,
"Why this benchmark").
"""

from __future__ import annotations

from sglang_unicache.policy.catalog import method, scorer


@scorer("knorm")
class KNormScorer:

    def score(self, ctx, layer):
        return -ctx.key_norm(layer)


method("knorm", scorer="knorm", budget="uniform", reducer="evict",
       summary="key norm: low-norm keys kept, question-independent")
