"""Fault injection for the engine tests: on the process's tensor-parallel rank
``UNICACHE_TEST_FAIL_RANK``, the first compression plan raises ``MemoryError`` once it has made
all its collectives (as an OOM in its last step would): the other ranks' plans succeed.

A server started with this directory first on ``PYTHONPATH`` imports it at interpreter start in
every process it spawns; without the variable it does nothing. (A failure between collectives
is covered over a real gloo group by ``tests/unit/test_tensor_parallel_group.py``.)
"""

from __future__ import annotations

import os

RANK = os.environ.get("UNICACHE_TEST_FAIL_RANK")

if RANK is not None:
    from sglang_unicache.policy.compressor import Method
    from sglang_unicache.policy.ranks import ONE_RANK

    _plan = Method.plan
    _left = [1]

    def _failing_plan(self, inputs, shards=ONE_RANK):
        plan = _plan(self, inputs, shards)
        if shards.first_head // inputs.num_kv_heads == int(RANK) and _left[0]:
            _left[0] = 0
            raise MemoryError("injected by tests/support/faults")
        return plan

    Method.plan = _failing_plan
