"""The policy layer: which image tokens to keep, how many per layer, and how to reduce the rest.

Pure torch: nothing here imports SGLang (``tests/policy/test_layout.py`` checks the folder).

- ``config.py``      ``UniCacheConfig``: every parameter, its default and range, presets
- ``inputs.py``      what a plan sees of a request (``ScoreInputs``, ``ImageSpan``)
- ``plans.py``       what it decides (``RequestPlan``, ``CompressionPlan``, ``SelfCheckResult``)
- ``serial.py``      plans to and from plain dicts
- ``context.py``     ``PlanContext``: one request's signals, computed once per plan
- ``signals.py``, ``heads.py``  the signals' tensor helpers; KV head clustering and merging
- ``policy/ranks.py``       ``HeadShards``: head averages across tensor-parallel ranks
- ``catalog.py``     the named parts and methods; ``registry.py`` method name -> parts
- ``compressor.py``  the template (score -> budget -> select -> reduce -> check), once
- ``executor.py``, ``quantize.py``  a plan -> compressed K/V; int8/int4 after it
- ``shrink.py``      re-compression of a compressed span to a smaller budget
- ``scorers/``, ``budgets/``, ``reducers/``, ``checks/``  the parts (``base.py`` is each contract)
- ``kernels/``       Triton kernels and their torch references
"""

from sglang_unicache.policy.compressor import Method
from sglang_unicache.policy.config import PRESETS, UniCacheConfig
from sglang_unicache.policy.registry import build_method, known, known_methods

__all__ = ["PRESETS", "Method", "UniCacheConfig", "build_method", "known", "known_methods"]
