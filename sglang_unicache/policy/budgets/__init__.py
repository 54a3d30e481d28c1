"""Budgets: how many entries each layer keeps (the contract is ``base.py``).

- ``uniform.py``  same K in every layer; ``FullBudget`` keeps everything
- ``pyramid.py``  PyramidKV arithmetic decrease
- ``unicache.py`` UniCache cosine layer-rate curve (seed §4.3)
- ``aircache.py`` AirCache strength + skewness (key design 2)
- ``modality.py`` UniCache modality budgets by information density (seed §5.2)
"""

from sglang_unicache.policy.budgets.aircache import AirCacheBudget
from sglang_unicache.policy.budgets.base import LayerBudget, apportion
from sglang_unicache.policy.budgets.modality import ModalityBudget
from sglang_unicache.policy.budgets.pyramid import PyramidBudget
from sglang_unicache.policy.budgets.unicache import UniCacheBudget
from sglang_unicache.policy.budgets.uniform import FullBudget, UniformBudget

__all__ = [
    "AirCacheBudget",
    "FullBudget",
    "LayerBudget",
    "ModalityBudget",
    "PyramidBudget",
    "UniCacheBudget",
    "UniformBudget",
    "apportion",
]
