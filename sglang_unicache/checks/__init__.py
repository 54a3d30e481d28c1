"""Quality checks (UniCache seed §7).

- ``selfcheck.py`` KL self-check on the last layers -> fallback flag (§7.1)
- ``dynamic_rate.py``  dynamic rate from input complexity (§7.2)
"""

from .dynamic_rate import complexity, dynamic_keep_ratio, rate_from_complexity
from .selfcheck import self_check

__all__ = ["complexity", "dynamic_keep_ratio", "rate_from_complexity", "self_check"]
