"""Reducers: what happens to tokens not kept.

- ``base.py``     the reducer contract, ``keep_only``
- ``evict.py``    drop them (baselines, AirCache)
- ``merge.py``    fold redundant ones into kept entries (UniCache §6.1-6.2)

The executor that applies a plan (``../executor.py``) and the quantization after it
(``../quantize.py``, UniCache §6.3) are not reducers.
"""

from sglang_unicache.policy.reducers.evict import EvictReducer
from sglang_unicache.policy.reducers.merge import MergeReducer

__all__ = ["EvictReducer", "MergeReducer"]
