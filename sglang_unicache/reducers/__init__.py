"""Reducers: what happens to tokens not kept, and the storage transforms after selection.

- ``base.py``     the reducer contract, ``keep_only``
- ``evict.py``    drop them (baselines, AirCache)
- ``merge.py``    fold redundant ones into kept entries (UniCache §6.1-6.2)
- ``quantize.py`` per-head int8/int4 of the kept entries (UniCache §6.3)
- ``apply.py``    the executor: a plan -> compressed K/V (head merging from ``../heads.py``)
"""

from .evict import EvictReducer
from .merge import MergeReducer

__all__ = ["EvictReducer", "MergeReducer"]
