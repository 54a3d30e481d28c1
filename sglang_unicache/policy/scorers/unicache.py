"""UniCache unified importance (seed §2.3, §4.2, §4.3) with a query-robust blend (ours).

    s_i = w_a * a_i + w_c * c_i - w_d * d_i + w_r * r_i          (seed §4.2)

- a: attention token i receives from the observation queries, min-max normalised *within its
  modality* (image tokens among image tokens, text among text; seed §2.3, never globally).
- c: cross-modal interaction strength. Image token: attention received from the *text*
  observation queries (normalised within the image modality). Text token with a captured query:
  the share of its attention on image tokens; other text tokens 0.
- d: redundancy, mean K/V cosine to the k neighbours each side inside the same span/run (k =
  ``redundancy_window``, seed: 4-8); on the patch grid (row and column neighbours) when the span
  carries ``ImageSpan.grid``, in raster order otherwise; subtracted.
- r: recency prior, position inside the span/run scaled to [0, 1] (seed §4.2: later = higher).
- Layer-dependent weights (seed §4.3): first third of the layers w_d = 0.3, last third w_a = 0.5,
  middle third the defaults 0.4/0.3/0.2/0.1.

Budget (departure from §4.3): every layer keeps K = round(keep * N) entries. The seed's cosine layer
curve (shallow layers compress more) is ``budget: unicache``; in SGLang's pool a slot spans every
layer (``docs/policy.md``, "Honest memory accounting"), so the curve holds ``max_l K_l`` slots (8
instead of 6 of a 64-token image at keep 0.1) and the entries it takes from shallow layers free no
memory. Measured as shipped on the trained model (BENCHMARKS.md, "Defaults as shipped"): the
same answers with 7.4 slots per image instead of 8, the self-check escalating the images 6 slots
do not keep; 40 images resident in a full pool instead of 33. At the same keep ratio with
the self-check off it holds fewer slots than the curve and loses where that matters (keep 0.05).

Query robustness (ours, not in the seed; ``docs/method.md``): a span compressed after question 1 is
reused for questions 2..N. The question-dependent parts are blended with a question-free saliency u
(low key norm, normalised within modality; the knorm signal): ``a' = q*a + (1-q)*u``, same for c,
with ``q = query_weight`` (default 1.0 = the seed's formula). The template can also reserve
``anchor_fraction`` (default 0) of each budget for evenly spaced anchors (spatial coverage, which
matters: background cells carry position, ``docs/quality-benchmark.md``). Both defaults are
measured: in the reuse benchmark (BENCHMARKS.md) the blend 0.6 / 0.05 cost 5-9 points at every keep
ratio from 5% to 50% on the trained model, so question-free saliency is opt-in. Without observation
queries q is 0.
"""

from __future__ import annotations

import torch

from sglang_unicache.policy import stacked
from sglang_unicache.policy.catalog import method, scorer
from sglang_unicache.policy.signals import by_modality_minmax


def layer_weights(w, layer: int, num_layers: int) -> tuple[float, float, float, float]:
    """(w_a, w_c, w_d, w_r) of ``layer`` (seed §4.3 shallow/deep adjustments, by thirds); ``w``
    is a ``UniCacheScorer`` (or anything with its weight fields, e.g. the config)."""
    wa, wc, wd, wr = w.w_attention, w.w_cross, w.w_redundancy, w.w_recency
    if w.layer_dependent_weights and num_layers >= 3:
        third = layer * 3 // num_layers
        if third == 0:
            wd = w.shallow_w_redundancy
        elif third == 2:
            wa = w.deep_w_attention
    return wa, wc, wd, wr


def cross_modal(ctx, layer: int) -> torch.Tensor:
    """``[H, T]`` c_i in [0, 1] (see module docstring)."""
    return cross_modal_of(ctx, ctx.received_from_text(layer), ctx.visual_share(layer))


def cross_modal_of(ctx, received_text: torch.Tensor, share: torch.Tensor) -> torch.Tensor:
    """c_i ``[..., H, T]`` from the attention received from text queries ``[..., H, T]`` and
    each query's visual share ``[..., H, W]``."""
    vis = ctx.is_visual
    c = by_modality_minmax(received_text, vis) * vis.float()
    text_q = ctx.query_is_text
    c[..., ctx.obs_positions[text_q]] = share[..., text_q]
    return c


@scorer("unicache", query_dependent=True)
class UniCacheScorer:
    """Parameters (seed §8.1 defaults): the weights ``w_attention`` 0.4, ``w_cross`` 0.3,
    ``w_redundancy`` 0.2, ``w_recency`` 0.1; ``layer_dependent_weights`` (seed §4.3) replaces
    w_d by ``shallow_w_redundancy`` 0.3 in the first third of the layers and w_a by
    ``deep_w_attention`` 0.5 in the last; ``query_weight`` q (ours, 1.0 = the seed's formula)."""

    w_attention: float = 0.4
    w_cross: float = 0.3
    w_redundancy: float = 0.2
    w_recency: float = 0.1
    layer_dependent_weights: bool = True
    shallow_w_redundancy: float = 0.3
    deep_w_attention: float = 0.5
    query_weight: float = 1.0

    def score(self, ctx, layer):
        d = ctx.redundancy(layer)  # first: its unit K/V also give the key norms
        u = by_modality_minmax(-ctx.key_norm(layer), ctx.is_visual)
        received = cross = None
        if ctx.has_queries:
            received, cross = ctx.received(layer), cross_modal(ctx, layer)
        return self._combine(ctx, layer_weights(self, layer, ctx.num_layers), d, u, received,
                             cross)

    def score_layers(self, ctx, layers: range) -> torch.Tensor:
        """``score`` of every layer of ``layers``, stacked ``[g, H, T]``: the same numbers from
        the signals ``stacked.fill`` computes for the group at once."""
        sig = stacked.fill(ctx, layers)
        weights = torch.tensor([layer_weights(self, li, ctx.num_layers) for li in layers],
                               device=ctx.is_visual.device).T.reshape(4, -1, 1, 1)
        u = by_modality_minmax(-sig["key_norm"], ctx.is_visual)
        cross = cross_modal_of(ctx, sig["received_text"], sig["visual_share"])
        return self._combine(ctx, weights, sig["redundancy"], u, sig["received"], cross)

    def _combine(self, ctx, weights, d, u, received, cross):
        """s = w_a a + w_c c - w_d d + w_r r from the redundancy ``d``, the question-free
        saliency ``u``, the attention received and c (None without observation queries: a and
        c are then u); ``weights`` (w_a, w_c, w_d, w_r) are a layer's floats or ``[g, 1, 1]``
        tensors of a group's."""
        wa, wc, wd, wr = weights
        r = ctx.recency().unsqueeze(0)
        if received is None:
            a, c = u, u
        else:
            q = self.query_weight
            a = q * by_modality_minmax(received, ctx.is_visual) + (1 - q) * u
            c = q * cross + (1 - q) * u
        return wa * a + wc * c - wd * d + wr * r


method("unicache", scorer="unicache", budget="uniform", reducer="merge",
       summary="UniCache: unified scores, one budget for every layer, merge (docs/method.md)",
       anchor_fraction=lambda c: c.anchor_fraction,
       protects_alignment=lambda c: c.protect_alignment)
