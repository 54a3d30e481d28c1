"""Scorers: which tokens matter (one file per method: its scorer and its ``catalog.method`` line;
the contract is ``base.py``). A new method is a new file here: importing this package
imports every module in it, which registers it.

- ``snapkv.py``    observation-window attention + max pool (SnapKV)
- ``h2o.py``       accumulated attention, + recent tokens via the template (H2O)
- ``knorm.py``     low key norm (question-independent)
- ``random.py``    seeded random
- ``full.py``      identity
- ``aircache.py``  elite observation window (AirCache, key design 1)
- ``tova.py``      the last position's head-averaged attention (TOVA)
- ``unicache.py``  unified importance w_a a + w_c c - w_d d + w_r r (UniCache seed §4.2)
- ``alignment.py`` alignment tokens and protection with discount (UniCache seed §5.3)

Scorers read their signals from ``PlanContext`` (``../context.py``, helpers in ``../signals.py``).
"""

from importlib import import_module
from pkgutil import iter_modules

for _module in iter_modules(__path__):
    import_module(f"{__name__}.{_module.name}")
