"""Contract of the quality checks (UniCache seed §7).

Each check is a frozen dataclass whose fields are its parameters (built from the config by the
compressor, like the parts):

- ``SelfCheck(...)(ctx, plans) -> SelfCheckResult``: read-only; compares attention of the
  observation queries over the full and the planned KV; ``passed=False`` means "keep the full KV"
  (the caller escalates or falls back; no plan is modified).
- ``DynamicRate(...).keep_ratio(V, T, N_align) -> (keep, complexity)``: a pure function of counts
  of the *original* input, evaluated before any compression decision.
"""
