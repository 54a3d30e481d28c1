"""The keep ratio's one owner: from the request's first plan to its span's last re-compression.

1. **Start**: ``keep_ratio``, or with ``dynamic_rate`` the ratio the request's complexity gives
   (UniCache seed §7.2, ``checks/dynamic_rate.py``), raised ``view_rungs`` rungs up the ladder
   (a request's own view, with host copies: its span rests at ``keep_ratio``).
2. **Escalation**: a failed self-check multiplies it by ``escalate_factor`` (sqrt 2), up to
   ``escalate_max_keep`` (the cap; a start above it is not escalated). A level whose plan
   cannot pass the check's content half is skipped without being planned (``climb``); past
   the cap the request keeps its full KV. With ``view_max_keep`` (a request's own view, with
   host copies) the ladder takes no rung above that bound, and a view that cannot climb
   further decodes on the level it has (``bounded``): no full-KV fallback.
3. **Re-compression** under memory pressure: a cached span of K entries keeps
   ``ceil(K * recompress_factor)``, never below ``ceil(N * recompress_floor)`` or 1
   (``shrunk``; which entries go is ``shrink.shrink_order``'s).
4. **At rest**, with a full copy of the image in host memory: a span its request's check
   escalated above ``keep_ratio`` goes back to ``round(keep_ratio * N)`` entries once no request
   uses it (``at_rest``): the copy serves later questions, each with its own view, and the span
   only their prefix match and the chat's history.

Between these, the parts turn the ratio into counts and never change it: the modality budgets
split it between image and text (``budgets/modality.py``), the layer budget spreads a span's
share over the layers, alignment protection spends part of it (``scorers/alignment.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class KeepRatio:
    keep_ratio: float = 0.1
    escalate_max_keep: float = 0.4
    escalate_factor: float = 2**0.5
    view_rungs: int | None = None  # None: 0 (the engine resolves it with host copies)
    view_max_keep: float | None = None  # None or 0: no bound (the engine sets it with host copies)
    recompress_factor: float = 0.5
    recompress_floor: float = 0.02

    def start(self, dynamic: float | None = None) -> float:
        """The ratio a request is planned at first (``dynamic``: the dynamic rate's, if on):
        ``keep_ratio`` climbed ``view_rungs`` rungs, never past the cap (the engine sets
        ``view_rungs`` only with host copies, where the span goes back to ``keep_ratio`` at
        rest). A view rung is not an escalation."""
        keep = self.keep_ratio if dynamic is None else dynamic
        for _ in range(self.view_rungs or 0):
            if not self.can_escalate(keep):
                break
            keep = self.escalated(keep)
        return keep

    @property
    def bounded(self) -> bool:
        """Whether the plan is a view under ``view_max_keep``: at the top of its ladder it
        decodes on what it has instead of falling back to the full KV."""
        return bool(self.view_max_keep)

    def can_escalate(self, keep: float) -> bool:
        """Whether a level above ``keep`` exists: below the cap and, with ``view_max_keep``,
        a next rung within that bound (a rung that would pass it is not taken)."""
        if keep >= self.escalate_max_keep:
            return False
        return (not self.view_max_keep
                or self.escalated(keep) <= self.view_max_keep * (1 + 1e-9))

    def escalated(self, keep: float) -> float:
        """The next level after a failed check at ``keep``: times ``escalate_factor``, capped
        (a level within rounding of the cap is the cap: 0.1 x sqrt(2)^4 is 0.4, not a rung below
        it)."""
        level = keep * self.escalate_factor
        return self.escalate_max_keep if level >= self.escalate_max_keep * (1 - 1e-9) else level

    def climb(self, keep: float, hopeless: Callable[[float], bool]) -> tuple[float, int]:
        """(the first level from ``keep`` up whose plan can pass, the levels skipped): a
        ``hopeless(level)`` level below the cap is skipped; the cap is always planned (its check
        is the one reported)."""
        skipped = 0
        while self.can_escalate(keep) and hopeless(keep):
            keep = self.escalated(keep)
            skipped += 1
        return keep, skipped

    def top(self) -> float:
        """The level a request planned at ``start()`` reaches if every check fails."""
        keep = self.start()
        while self.can_escalate(keep):
            keep = self.escalated(keep)
        return keep

    @property
    def highest(self) -> float:
        """The largest ratio a plan may reach before it falls back (the cap, or a start above
        it); a bounded view never falls back."""
        return max(self.escalate_max_keep, self.keep_ratio)

    def at_rest(self, current: int, original: int) -> int:
        """Entries a span of ``current`` entries (``original`` tokens) keeps at rest when its
        image has a host copy: what ``keep_ratio`` gives (the uniform budget's count), or
        ``current`` if that is fewer."""
        return min(current, max(1, round(self.keep_ratio * original)))

    def shrunk(self, current: int, original: int) -> int:
        """Entries a span of ``current`` entries (``original`` tokens before compression) keeps
        after one re-compression; ``current`` when it is already at its floor.

        Alignment-protected entries are no floor: compression caps them at the smallest layer
        budget, and a re-compression is a smaller budget, so they are kept first (they rank
        highest) and dropped last. As a floor they froze every span whose smallest layer they
        filled (with a uniform budget, all of them), which was then evicted instead of halved."""
        lowest = max(1, math.ceil(original * self.recompress_floor))
        return max(min(current, lowest), math.ceil(current * self.recompress_factor))
