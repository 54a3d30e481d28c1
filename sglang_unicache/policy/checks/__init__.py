"""Quality checks (UniCache seed §7).

- ``selfcheck.py`` KL self-check on the last layers -> fallback flag (§7.1)
- ``dynamic_rate.py``  dynamic rate from input complexity (§7.2)
"""

from sglang_unicache.policy.checks.dynamic_rate import DynamicRate, complexity, rate_from_complexity
from sglang_unicache.policy.checks.selfcheck import SelfCheck

__all__ = ["DynamicRate", "SelfCheck", "complexity", "rate_from_complexity"]
