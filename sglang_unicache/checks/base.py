"""Contract of the quality checks (UniCache seed §7).

- ``self_check(ctx, plans) -> SelfCheckResult``: read-only; compares attention of the observation
  queries over the full and the planned KV; ``passed=False`` means "keep the full KV" (the caller
  falls back; no plan is modified).
- ``dynamic_keep_ratio(cfg, V, T, N_align) -> (keep, complexity)``: a pure function of counts of
  the *original* input, evaluated before any compression decision.
"""
