"""Self-check of a plan (UniCache seed §7.1): does attention still see the same thing?

Seed: compare the attention of the last layers before and after compression; past a threshold
the compression went too far and the caller keeps the full KV. The seed's statistic is the KL
divergence of the attention distributions with a threshold of 0.1.

Every statistic below is computed over the observation queries of the last ``selfcheck_layers``
layers, on the full keys P and on the keys as compression leaves them Q (text and uncompressed
tokens as they are, each span replaced by its compressed entries), reduced to one number per layer
(a mean over queries and query heads unless said otherwise) and then to the maximum over layers:

- ``kl``: ``KL(Q~ || P)``, the seed's statistic. Q is spread back onto source tokens (entry j's
  probability split among its members by their merge weights, evicted tokens get 0), so it is
  finite; for pure eviction it equals ``-log(kept attention mass)`` (0.1: ~9.5% of the mass lost).
- ``kl_head``: the largest per-KV-head mean KL (the spread of loss across heads).
- ``image_mass_lost``: the share of each query's attention *on the image* that falls on tokens
  that are not kept entries (the attention mass kept per layer, normalised to the image).
- ``output_error``: ``||o_Q - o_P|| / ||o_P||``, the relative change of the attention output
  (what the next layer reads), which discounts lost mass whose values the kept entries repeat.
- ``key_coverage``: question-independent: ``1 - max cos(k, kept k)`` averaged over the span's
  tokens and heads: how far the kept keys are from the keys they replace, whatever the question.

One statistic needs no query and looks at the first layer instead (ours, not in the seed):

- ``content_lost``: how much of the image the plan drops, whatever the question: the relative
  error of the first layer's values (the image as the vision encoder hands it to the language
  model) when every kept entry is exact and every other token is replaced by the span's
  background, its median value ``m``: ``sum(||v_i - m|| over dropped tokens) / sum(||v_i||)`` per
  KV head, averaged over heads (merged members count as dropped). It is low when what stands out
  of the background is kept (objects on a plain background, or a plain image) and high when the
  image's information is spread over all of it (a dense grid), where a plan that follows one
  question cannot serve the next.

The verdict needs both: the deciding statistic at most ``selfcheck_threshold`` *and*
``content_lost`` at most ``selfcheck_content_threshold``. The first guards the question that
compressed the image, the second the later questions a shared span will be asked: on the grid
task (the second trained model) no question-following statistic saw the harm
(docs/selfcheck.md).

Means are taken per KV head first, then over the heads of every tensor-parallel rank
(``policy/ranks.py``), so every rank reaches the same verdict.

The query statistic that decides, and its threshold, are ``selfcheck_statistic`` /
``selfcheck_threshold`` (defaults from the measurement in docs/selfcheck.md: which statistic
predicts that a compressed, reused image answers later questions differently). The seed's KL
predicted best (ROC AUC 0.885) and stays the statistic. Departure from the seed: its threshold of
0.1 rejects every image at a 10x keep ratio on the models we measured; the default is 0.9 (the
best separation of harmed from unharmed images). A failed check escalates the budget
(``compressor.Method.plan``).

Only observation queries that see each compressed span either fully or not at all are used (a
query inside a span would see a partial span); with none left (or no queries at all) only
``content_lost`` decides. Memory: ``[H, G, W, N]`` per span and ``[H, G, W, chunk]`` for the
rest, never ``[T, T]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_unicache.policy.config import SELFCHECK_QUERY_STATISTICS
from sglang_unicache.policy.executor import execute_layer, execute_one
from sglang_unicache.policy.kernels.reference import (
    _logits,
    attend_from_logits,
    window_attend,
    window_lse,
)
from sglang_unicache.policy.plans import CompressionPlan, SelfCheckResult

Tensor = torch.Tensor

CONTENT_LAYER = 0  # content_lost reads the first layer: the image as the vision encoder gave it
KL_STATISTICS = ("kl", "kl_head")  # what ``layer_stats(kl_only=True)`` returns, in that order


def reference_attention(ctx, layer: int, q: Tensor, pos: Tensor, rows: Tensor, spans: tuple,
                        outputs: bool = True
                        ) -> tuple[Tensor | None, Tensor, Tensor | None, Tensor, list[Tensor]]:
    """The attention of the observation queries ``q`` (``rows`` of the window, at ``pos``) over
    the full request, plan-independent: ``(out_p, lse_p, out_rest, lse_rest, l_orig)``, the
    output ``[H, G, W', D]`` and normaliser ``[H, G, W']`` over every key and over the keys
    outside the spans, and each span's logits ``[H, G, W', N]`` (``-inf`` where a query does
    not see it). ``outputs=False``: the normalisers and logits alone (what the KL reads), the
    outputs None.

    When the context keeps the layer's logits (no head merging, T within ``stats_chunk``) they
    are sliced, not recomputed: the rest is attended over its own columns and the full output
    is the rest's, rescaled, plus each span's. Otherwise two chunked passes (``window_attend``,
    or ``window_lse`` without outputs)."""
    inp = ctx.inputs
    keys, values = inp.keys[layer], inp.values[layer]
    compressed = torch.zeros(inp.num_tokens, dtype=torch.bool, device=keys.device)
    for start, end in spans:
        compressed[start:end] = True
    lg = ctx.logits(layer) if ctx.head_clusters(layer) is None else None
    if lg is None:
        if outputs:
            out_p, lse_p = window_attend(q, keys, values, inp.scale, pos, None, ctx.stats_chunk)
            out_rest, lse_rest = window_attend(q, keys, values, inp.scale, pos, ~compressed,
                                               ctx.stats_chunk)
        else:
            out_p = out_rest = None
            lse_p = window_lse(q, keys, inp.scale, pos, None, ctx.stats_chunk)
            lse_rest = window_lse(q, keys, inp.scale, pos, ~compressed, ctx.stats_chunk)
        l_orig = [_logits(q, keys[start:end], inp.scale)
                  .masked_fill(~(pos >= end - 1).view(1, 1, -1, 1), float("-inf"))
                  for start, end in spans]
        return out_p, lse_p, out_rest, lse_rest, l_orig
    lg = lg[:, :, rows]  # causal: a valid query sees a span whole or not at all
    rest = (~compressed).nonzero().flatten()
    l_rest = lg[..., rest]
    lse_rest = torch.logsumexp(l_rest, dim=-1)
    lse_p = torch.logsumexp(lg, dim=-1)
    l_orig = [lg[..., start:end] for start, end in spans]
    if not outputs:
        return None, lse_p, None, lse_rest, l_orig
    out_rest = attend_from_logits(l_rest, lse_rest, values[rest])
    safe_p = torch.where(torch.isfinite(lse_p), lse_p, torch.zeros_like(lse_p))
    out_p = out_rest * torch.exp(lse_rest - safe_p).nan_to_num(0.0).unsqueeze(-1)
    for (start, end), lo in zip(spans, l_orig, strict=True):
        out_p = out_p + attend_from_logits(lo, lse_p, values[start:end])
    return out_p, lse_p, out_rest, lse_rest, l_orig


def _reference(ctx, layer: int, spans: tuple, kl_only: bool = False) -> dict | None:
    """Everything of one layer's check that does not depend on the plan, computed once per
    ``Method.plan`` (an escalation re-plans at a larger K and reuses it): the valid observation
    queries, the full and the rest-of-request attention over them (``reference_attention``),
    each span's original log-probabilities, probabilities and unit keys, the attention on the
    images. None when no observation query is valid. ``kl_only``: what the KL reads (the
    normalisers and each span's log-probabilities), unless the whole is already computed."""

    def compute(outputs: bool) -> dict | None:
        inp = ctx.inputs
        pos = ctx.obs_positions
        valid = torch.ones_like(pos, dtype=torch.bool)
        for start, end in spans:
            valid &= (pos >= end - 1) | (pos < start)
        if not bool(valid.any()):
            return None
        q, pos = inp.obs_queries[layer][valid], pos[valid]
        out_p, lse_p, out_rest, lse_rest, l_orig = reference_attention(
            ctx, layer, q, pos, valid, spans, outputs)
        per_span, image_p = [], torch.zeros_like(lse_p)
        for (start, end), lo in zip(spans, l_orig, strict=True):
            sees = (pos >= end - 1).view(1, 1, -1, 1)
            log_p = lo - lse_p.unsqueeze(-1)
            if not outputs:
                per_span.append((sees, log_p, None, None))
                continue
            p_span = torch.exp(log_p)
            image_p = image_p + p_span.sum(-1)
            unit = torch.nn.functional.normalize(ctx.keys(layer)[start:end].float(), dim=-1)
            per_span.append((sees, log_p, p_span, unit.transpose(0, 1)))  # unit: [H, N, D]
        return {"q": q, "out_p": out_p, "lse_p": lse_p, "out_rest": out_rest,
                "lse_rest": lse_rest, "image_p": image_p, "spans": per_span}

    full = f"selfcheck reference {spans}"
    if kl_only and not ctx.has(full, layer):
        return ctx.cached(f"selfcheck kl reference {spans}", layer, lambda: compute(False))
    return ctx.cached(full, layer, lambda: compute(True))


def key_coverage(unit: Tensor, kept: Tensor, seen: dict) -> Tensor:
    """``[H]`` ``key_coverage`` of one span: ``1 - max cos(k, kept k)`` averaged over its tokens,
    from unit keys ``[H, N, D]`` and the kept tokens ``[H, K]``. A kept token covers itself
    (its term is 0), so only the others are compared with the kept keys. ``seen`` carries the
    span's previous level (an escalation raises K): when this level keeps every token that
    one kept, only the keys new to this level are compared, and the maxima over the others are
    reused."""
    h, n, _ = unit.shape
    k = kept.shape[1]
    heads = torch.arange(h, device=unit.device).unsqueeze(1)
    is_kept = torch.zeros(h, n, dtype=torch.int8, device=unit.device).scatter_(1, kept, 1)
    others = torch.argsort(is_kept, dim=1, stable=True)[:, : n - k]  # [H, N - K]
    cols, near = kept, None
    if "kept" in seen and bool((seen["kept"] <= is_kept).all()):
        new = torch.argsort(is_kept - seen["kept"], dim=1, descending=True, stable=True)
        cols, near = new[:, : k - seen["k"]], seen["near"].gather(1, others)
    if cols.shape[1] > 0:
        sim = torch.bmm(unit[heads, others], unit[heads, cols].transpose(1, 2)).amax(-1)
        near = sim if near is None else torch.maximum(near, sim)
    seen.update(kept=is_kept, k=k, near=torch.zeros_like(unit[:, :, 0]).scatter_(1, others, near))
    return (1.0 - near).sum(-1) / n


def member_kl(log_qc: Tensor, log_p: Tensor, assign: Tensor, weight: Tensor) -> Tensor:
    """``[H, G, W]``: one span's part of ``KL(Q~ || P)``, ``sum q~ (log q~ - log p)`` over its
    tokens, where entry j's log-probability ``log_qc [H, G, W, K]`` is split among its members
    by their merge weights and ``log_p [H, G, W, N]`` is the original. An evicted token has
    q~ = 0 and adds nothing, so only members are visited (per head, padded to the largest
    member count)."""
    h, g, w, _ = log_qc.shape
    member = assign >= 0
    m = int(member.sum(1).max())
    tok = torch.argsort(member.to(torch.int8), dim=1, descending=True, stable=True)[:, :m]
    ok = member.gather(1, tok).view(h, 1, 1, m)
    entry = assign.gather(1, tok).long().clamp_min(0).view(h, 1, 1, m).expand(h, g, w, m)
    log_w = torch.log(weight.gather(1, tok).float().clamp_min(1e-30)).view(h, 1, 1, m)
    log_qt = torch.gather(log_qc, 3, entry) + log_w
    log_pt = torch.gather(log_p, 3, tok.view(h, 1, 1, m).expand(h, g, w, m))
    term = torch.exp(log_qt) * (log_qt - log_pt)
    return torch.where(ok & torch.isfinite(term), term, torch.zeros_like(term)).sum(-1)


def layer_stats(ctx, layer: int, plans: list[CompressionPlan], kl_only: bool = False
                ) -> Tensor | None:
    """One layer's statistics, in the order of config's ``SELFCHECK_QUERY_STATISTICS``, or None
    (no valid observation query). ``kl_only``: just ``kl`` and ``kl_head`` (what a level that
    fails on them needs: ``SelfCheck.kl_check``)."""
    inp = ctx.inputs
    plans = [p for p in plans if not p.skipped]
    if not plans:
        return None
    ref = _reference(ctx, layer, tuple((p.span.start, p.span.end) for p in plans), kl_only)
    if ref is None:
        return None
    q, lse_p, lse_rest = ref["q"], ref["lse_p"], ref["lse_rest"]
    parts, coverage = [], []
    for p, (sees, log_p, p_span, unit) in zip(plans, ref["spans"], strict=True):
        sl = slice(p.span.start, p.span.end)
        lp = p.layers[layer]
        if kl_only:  # the KL reads the compressed keys alone
            k_c, v_c = execute_one(lp, ctx.keys(layer)[sl]), None
        else:
            k_c, v_c = execute_layer(lp, ctx.keys(layer)[sl], ctx.values(layer)[sl])
        l_comp = _logits(q, k_c, inp.scale).masked_fill(~sees, float("-inf"))
        parts.append((lp, log_p, p_span, l_comp, v_c))
        if not kl_only:
            seen = ctx.cached(f"selfcheck coverage {p.span.start}", layer, dict)
            coverage.append(key_coverage(unit, lp.kept, seen))
    lse_q = lse_rest
    for *_, l_comp, _ in parts:
        lse_q = torch.logaddexp(lse_q, torch.logsumexp(l_comp, dim=-1))
    safe_q = torch.where(torch.isfinite(lse_q), lse_q, torch.zeros_like(lse_q))
    out_q = (None if kl_only else
             ref["out_rest"] * torch.exp(lse_rest - safe_q).nan_to_num(0.0).unsqueeze(-1))
    kl = torch.exp(lse_rest - lse_q).nan_to_num(0.0) * (lse_p - lse_q)
    image_kept = torch.zeros_like(lse_p)
    for lp, log_p, p_span, l_comp, v_c in parts:
        log_qc = l_comp - safe_q.unsqueeze(-1)  # [H, G, W, K]
        kl = kl + member_kl(log_qc, log_p, lp.assign, lp.weight)
        if kl_only:
            continue
        h, g, w, _ = log_qc.shape
        vh = v_c.float().transpose(0, 1)  # [H, K, D]
        out_q = out_q + torch.einsum("hgwk,hkd->hgwd", torch.exp(log_qc), vh)
        kept = lp.kept.long().view(h, 1, 1, -1).expand(h, g, w, -1)
        image_kept = image_kept + torch.gather(p_span, 3, kept).sum(-1)
    if kl_only:
        per_kv_head = kl.mean(dim=(1, 2)).unsqueeze(1)  # [H, 1]
        return torch.stack([ctx.shards.mean(per_kv_head)[0],
                            ctx.shards.max(per_kv_head[:, 0].max())])
    image_p = ref["image_p"]
    out_p = ref["out_p"]
    error = (out_q - out_p).norm(dim=-1) / out_p.norm(dim=-1).clamp_min(1e-12)
    lost = torch.where(image_p > 0, 1.0 - image_kept / image_p.clamp_min(1e-30), 0.0)
    # Per KV head, then over every rank's heads (``ranks.py``): the verdict is the same on each.
    per_head = torch.stack([kl.mean(dim=(1, 2)), lost.mean(dim=(1, 2)), error.mean(dim=(1, 2)),
                            *coverage], dim=1)  # [H, 3 + spans]
    means = ctx.shards.mean(per_head)
    kl_head = ctx.shards.max(per_head[:, 0].max())
    return torch.stack([means[0], kl_head, means[1], means[2], means[3:].max()])


def _content(ctx, start: int, end: int) -> tuple[Tensor, Tensor]:
    """(``[H, N]`` each span token's distance from the background in the content layer, ``[H]``
    the span's total value norm), once per ``Method.plan``: an escalation changes only what is
    kept."""

    def compute() -> tuple[Tensor, Tensor]:
        v = ctx.values(CONTENT_LAYER)[start:end].float().transpose(0, 1)  # [H, N, D]
        content = (v - v.median(dim=1, keepdim=True).values).norm(dim=-1)  # [H, N]
        return content, v.norm(dim=-1).sum(-1).clamp_min(1e-30)

    return ctx.cached(f"content {start}", CONTENT_LAYER, compute)


def _lost(ctx, content: Tensor, total: Tensor, kept_content: Tensor) -> Tensor:
    lost = ((content.sum(-1) - kept_content) / total).clamp_max(1.0)  # [H]
    return ctx.shards.mean(lost.unsqueeze(-1))[0]


def content_lost(ctx, plans: list[CompressionPlan]) -> Tensor | None:
    """``content_lost`` (module docstring) of the worst span, a 0-d tensor; None with no plan."""
    plans = [p for p in plans if not p.skipped]
    if not plans:
        return None
    worst = []
    for p in plans:
        content, total = _content(ctx, p.span.start, p.span.end)
        kept = content.gather(1, p.layers[CONTENT_LAYER].kept.long()).sum(-1)
        worst.append(_lost(ctx, content, total, kept))
    return torch.stack(worst).amax()


def content_floor(ctx, span_counts: list[tuple]) -> Tensor | None:
    """The least ``content_lost`` of any plan that keeps ``k`` entries of each ``(span, k)`` in
    the content layer: every head keeping its ``k`` tokens farthest from the background. A 0-d
    tensor; None with no span."""
    worst = []
    for span, k in span_counts:
        content, total = _content(ctx, span.start, span.end)
        best = content.topk(min(k, content.shape[1]), dim=1).values.sum(-1)
        worst.append(_lost(ctx, content, total, best))
    return torch.stack(worst).amax() if worst else None


# content_floor and content_lost add the same numbers in different orders: a floor this little
# above the threshold is not evidence that the plan would fail.
FLOOR_MARGIN = 1e-5


@dataclass(frozen=True)
class SelfCheck:
    """The §7.1 check, built from the config's ``selfcheck_*`` fields: ``statistic`` (one of
    ``SELFCHECK_STATISTICS``, default "kl"), ``threshold`` (fails above it, default 0.9),
    ``layers`` (the last layers checked, default 2), ``content_threshold`` (``content_lost``
    fails above it, default 0.15; 1 turns that half of the check off) and ``all_statistics``
    (compute every statistic for the record, not only those that decide)."""

    statistic: str = "kl"
    threshold: float = 0.9
    layers: int = 2
    content_threshold: float = 0.15
    all_statistics: bool = False

    def unchecked(self, layers: tuple[int, ...] = (), at_bound: bool = False) -> SelfCheckResult:
        """The passing result of a check that saw nothing (identity plan, no valid query) or
        was not computed (``at_bound``: the plan is at the top of its bounded ladder)."""
        return SelfCheckResult(self.statistic, 0.0, self.threshold, layers, False, True,
                               at_bound=at_bound)

    def content_hopeless(self, ctx, span_counts: list[tuple]) -> bool:
        """True when no plan keeping these counts (``content_floor``) can pass the
        ``content_lost`` half of the check: the caller may skip planning it."""
        if self.content_threshold >= 1.0:  # content_lost is at most 1: this half always passes
            return False
        floor = content_floor(ctx, span_counts)
        return floor is not None and float(floor) > self.content_threshold + FLOOR_MARGIN

    def checked_layers(self, num_layers: int) -> tuple[int, ...]:
        """The last ``layers`` layers, whose attention the query statistics compare."""
        return tuple(range(max(0, num_layers - self.layers), num_layers))

    def layers_read(self, num_layers: int) -> tuple[int, ...]:
        """Every layer whose plan the check reads (the checked layers and ``CONTENT_LAYER``):
        the compressor plans only these until a level passes."""
        return tuple(sorted({CONTENT_LAYER, *self.checked_layers(num_layers)}))

    @property
    def decided_by_kl(self) -> bool:
        """Whether the deciding statistic is one ``kl_check`` computes alone."""
        return self.statistic in KL_STATISTICS

    def _kl_statistics(self, ctx, plans: list[CompressionPlan], plan_layer=None,
                       early_stop: bool = False) -> dict | None:
        """``kl`` and ``kl_head`` of the plans over the checked layers (the worst layer), or
        None when no observation query sees a compressed span. ``plan_layer(li)``, when given,
        plans layer ``li`` of ``plans`` just before it is read. ``early_stop`` (``kl_check``):
        the layers are read the last first and the first whose deciding statistic is above
        the threshold ends the reading; the statistic is a maximum over the layers, so that is
        the verdict of every layer, and that layer's statistics are the result."""
        if not ctx.has_queries or all(p.skipped for p in plans):
            return None
        layers = self.checked_layers(ctx.num_layers)
        which = KL_STATISTICS.index(self.statistic) if early_stop else None
        per_layer = []
        for li in reversed(layers) if early_stop else layers:
            if plan_layer is not None:
                plan_layer(li)
            v = layer_stats(ctx, li, plans, kl_only=True)
            if v is None:
                continue
            per_layer.append(v)
            if early_stop and float(v[which]) > self.threshold:  # one host sync per layer read
                break
        if not per_layer:
            return None
        return dict(zip(KL_STATISTICS, torch.stack(per_layer).amax(dim=0).tolist(), strict=True))

    def kl_check(self, ctx, plans: list[CompressionPlan],
                 plan_layer=None) -> SelfCheckResult | None:
        """The verdict of the deciding statistic (``kl`` or ``kl_head``) alone, computed without
        the other statistics, ``content_lost`` or the content layer's plan; None when the KL
        does not decide or cannot be computed. A level below the escalation cap that fails here
        is escalated at the cost of its KL; a level that passes hands this result to the full
        check (``__call__``), which does not compute it again. The checked layers are planned
        (``plan_layer``) and read one at a time, the last first, up to the first whose KL fails
        (``_kl_statistics``'s ``early_stop``): a failed level plans and reads no other."""
        stats = (self._kl_statistics(ctx, plans, plan_layer, early_stop=True)
                 if self.decided_by_kl else None)
        if stats is None:
            return None
        layers = self.checked_layers(ctx.num_layers)
        value = stats[self.statistic]
        return SelfCheckResult(self.statistic, value, self.threshold, layers, True,
                               value <= self.threshold, stats, self.content_threshold)

    def __call__(self, ctx, plans: list[CompressionPlan],
                 kl: SelfCheckResult | None = None) -> SelfCheckResult:
        """Run the check over the last ``layers`` layers. ``plans``' ``layers`` need hold only
        the ones ``layers_read`` names; ``kl``: these plans' ``kl_check``, if already made.
        Unless ``all_statistics``, only what decides is computed: the deciding statistic (with
        a KL one, just ``kl`` and ``kl_head``) and ``content_lost`` while its half is on."""
        layers = self.checked_layers(ctx.num_layers)
        if all(p.skipped for p in plans):
            return self.unchecked(layers)
        lean = self.decided_by_kl and not self.all_statistics
        stats = {}
        if lean:
            stats = dict(kl.stats) if kl is not None else self._kl_statistics(ctx, plans) or {}
        elif ctx.has_queries:
            per_layer = [v for v in (layer_stats(ctx, li, plans) for li in layers)
                         if v is not None]
            if per_layer:
                stats = dict(zip(SELFCHECK_QUERY_STATISTICS,
                                 torch.stack(per_layer).amax(dim=0).tolist(), strict=True))
        queried = bool(stats)
        if not lean or self.content_threshold < 1.0 or not queried:
            stats["content_lost"] = float(content_lost(ctx, plans))
        if queried:
            value = stats[self.statistic]
            passed = value <= self.threshold
        else:  # no query sees the spans: only the question-free half decides
            value, passed = stats.get(self.statistic, 0.0), True
        lost = stats.get("content_lost")
        passed = passed and (lost is None or lost <= self.content_threshold)
        return SelfCheckResult(self.statistic, value, self.threshold, layers, True, passed, stats,
                               self.content_threshold)
