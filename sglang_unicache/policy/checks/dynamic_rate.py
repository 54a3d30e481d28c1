"""Dynamic compression rate from input complexity (UniCache seed §7.2).

    complexity = log(V) + log(T) + lambda * N_align / (T + V)        (lambda = 2)

V image tokens, T text tokens, N_align alignment tokens, all of the *original* input (seed §9: the
estimate must be made before compressing, on uncompressed counts). The score maps to a compression
rate in [dynamic_rate_min, dynamic_rate_max] = [0.4, 0.75], higher complexity -> lower rate.

Departure: the seed gives no mapping; we map linearly between ``complexity_low`` (8.0 -> rate 0.75)
and ``complexity_high`` (18.0 -> rate 0.4), clamped. log(0) is avoided with log(max(1, n)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def complexity(n_visual: int, n_text: int, n_align: int, lam: float = 2.0) -> float:
    total = n_visual + n_text
    ratio = n_align / total if total else 0.0
    return math.log(max(1, n_visual)) + math.log(max(1, n_text)) + lam * ratio


def rate_from_complexity(
    c: float, rate_min: float, rate_max: float, c_low: float, c_high: float
) -> float:
    """Linear, clamped: ``c <= c_low`` -> rate_max, ``c >= c_high`` -> rate_min."""
    t = min(1.0, max(0.0, (c - c_low) / (c_high - c_low)))
    return rate_max - t * (rate_max - rate_min)


@dataclass(frozen=True)
class DynamicRate:
    """Parameters: ``complexity_lambda`` 2.0 (seed); the rate range ``dynamic_rate_min`` 0.4 /
    ``dynamic_rate_max`` 0.75 (seed); ``complexity_low`` 8.0 / ``complexity_high`` 18.0 (ours)."""

    complexity_lambda: float = 2.0
    dynamic_rate_min: float = 0.4
    dynamic_rate_max: float = 0.75
    complexity_low: float = 8.0
    complexity_high: float = 18.0

    def keep_ratio(self, n_visual: int, n_text: int, n_align: int) -> tuple[float, float]:
        """(keep ratio = 1 - rate, complexity) of a request with these counts."""
        c = complexity(n_visual, n_text, n_align, self.complexity_lambda)
        rate = rate_from_complexity(
            c,
            self.dynamic_rate_min,
            self.dynamic_rate_max,
            self.complexity_low,
            self.complexity_high,
        )
        return 1.0 - rate, c
