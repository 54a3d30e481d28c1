"""Scorers: which tokens matter (one file per method: its scorer and its ``catalog.method`` line;
the contract is ``base.py``). A new method is a new file here and its import below.

- ``snapkv.py``    observation-window attention + max pool (SnapKV)
- ``h2o.py``       accumulated attention, + recent tokens via the template (H2O)
- ``knorm.py``     low key norm (question-independent)
- ``random.py``    seeded random
- ``full.py``      identity
- ``aircache.py``  elite observation window (AirCache seed, design 1)
- ``tova.py``      the last position's head-averaged attention (TOVA)
- ``unicache.py``  unified importance w_a a + w_c c - w_d d + w_r r (UniCache seed §4.2)
- ``alignment.py`` alignment tokens and protection with discount (UniCache seed §5.3)

Scorers read their signals from ``PlanContext`` (``../context.py``, helpers in ``../signals.py``).
"""

from .aircache import AirCacheScorer
from .full import FullScorer
from .h2o import H2OScorer
from .knorm import KNormScorer
from .random import RandomScorer
from .snapkv import SnapKVScorer
from .tova import TOVAScorer
from .unicache import UniCacheScorer

__all__ = [
    "AirCacheScorer",
    "FullScorer",
    "H2OScorer",
    "KNormScorer",
    "RandomScorer",
    "SnapKVScorer",
    "TOVAScorer",
    "UniCacheScorer",
]
