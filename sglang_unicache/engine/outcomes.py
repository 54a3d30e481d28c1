"""What the self-check decided, kept where a user looks: the last checks in ``/server_info``,
and one warning line when most recent images kept their full KV (the user is running a no-op and
should know which keys to look at)."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from sglang_unicache.engine.stats import Stats
from sglang_unicache.policy.catalog import from_config
from sglang_unicache.policy.config import UniCacheConfig
from sglang_unicache.policy.keep import KeepRatio

logger = logging.getLogger("sglang_unicache")

# One warning line when more than this share of the last FALLBACK_WINDOW checked requests kept
# their full KV.
FALLBACK_WINDOW = 32
FALLBACK_WARN_SHARE = 0.5
RECENT_CHECKS = 64  # self-check outcomes kept for /server_info


@dataclass
class Outcomes:
    config: UniCacheConfig
    stats: Stats
    recent_checks: deque = field(default_factory=lambda: deque(maxlen=RECENT_CHECKS))
    full_kept: deque = field(default_factory=lambda: deque(maxlen=FALLBACK_WINDOW))
    since_warning: int = FALLBACK_WINDOW

    def check(self, rid: str, plan) -> None:
        """A plan's self-check: its escalations counted, its verdict kept and recorded."""
        self.stats.escalations += plan.escalations
        check = plan.selfcheck
        if check is not None and check.at_bound:
            self.stats.views_unchecked += 1
        if check is not None and check.checked:
            self.recent_checks.append({
                "rid": rid, "statistic": check.statistic, "value": check.value,
                "threshold": check.threshold, "passed": check.passed,
                "keep_ratio": plan.keep_ratio, "escalations": plan.escalations,
                "stats": check.stats})
        self.record(plan.fallback)

    def record(self, full_kept: bool) -> None:
        """One image request's outcome; warn once per window when most kept their full KV."""
        self.full_kept.append(full_kept)
        self.since_warning += 1
        share = sum(self.full_kept) / len(self.full_kept)
        if (len(self.full_kept) == FALLBACK_WINDOW and self.since_warning >= FALLBACK_WINDOW
                and share > FALLBACK_WARN_SHARE):
            self.since_warning = 0
            cfg = self.config
            logger.warning(
                "sglang-unicache: %d of the last %d image requests kept their full KV (self-check"
                " %s > %.3g or content_lost > %.3g even at keep %.3g); compression is mostly "
                "off: see the config keys selfcheck_threshold, selfcheck_content_threshold and "
                "escalate_max_keep (docs/selfcheck.md)",
                sum(self.full_kept), len(self.full_kept), cfg.selfcheck_statistic,
                cfg.selfcheck_threshold, cfg.selfcheck_content_threshold,
                from_config(KeepRatio, cfg).highest)
