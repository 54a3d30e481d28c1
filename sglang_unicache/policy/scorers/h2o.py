"""H2O scorer (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference").

Heavy hitters = keys with the largest accumulated attention; H2O keeps them plus the most recent
tokens (``h2o_recent_fraction`` of each budget, 0.5 as in the paper, reserved by the template as
the last tokens of the span).

Departure: H2O accumulates attention over *all* queries. If the caller passes
``ScoreInputs.accumulated_attention`` ``[H, T]`` per layer we use it; otherwise (the engine only
captures the last W queries) we accumulate over the observation window.
"""

from __future__ import annotations

from sglang_unicache.policy.catalog import method, scorer


@scorer("h2o", query_dependent=True)
class H2OScorer:

    def score(self, ctx, layer):
        acc = ctx.inputs.accumulated_attention
        if acc is not None:
            return acc[layer].float()
        ctx.require_queries(self.name + " (without accumulated_attention)")
        return ctx.received(layer)


method("h2o", scorer="h2o", budget="uniform", reducer="evict",
       summary="H2O: heavy hitters plus recent tokens",
       recent_fraction=lambda c: c.h2o_recent_fraction)
