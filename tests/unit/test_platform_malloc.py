"""The CPU platform's allocator settings (``platform/cpu/malloc.py``): a tensor freed and
allocated again reuses its pages instead of faulting them in afresh."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

PROBE = """
import json, resource, sys, torch
from sglang_unicache.platform.cpu import malloc
installed = malloc.install() if sys.argv[1] == "1" else None
k, v = torch.randn(4160, 2, 128), torch.randn(4160, 2, 128)  # one layer's prompt K/V
x = torch.cat([k, v], -1)
x = torch.cat([k, v], -1)  # the first touches are paid either way
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):  # unit_kv's concatenation, layer after layer: 8.5 MB each
    x = torch.cat([k, v], -1)
print(json.dumps({"installed": installed,
                  "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def _probe(install: bool, env: dict | None = None) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, "1" if install else "0"], check=True,
                         capture_output=True, text=True, env={**os.environ, **(env or {})})
    return json.loads(out.stdout)


# glibc's static defaults (128 KiB): set explicitly, they also switch off the dynamic threshold
# that glibc raises after freeing a large block, which makes the untuned fault count depend on
# the allocation history (4,100 to 14,000 faults in the same probe).
GLIBC_DEFAULTS = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def test_freed_tensors_reuse_their_pages():
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("the thresholds are glibc's")
    plain, tuned = _probe(False, GLIBC_DEFAULTS), _probe(True)
    assert tuned["installed"] is True
    pages = 4160 * 2 * 256 * 4 // 4096  # one tensor's pages
    assert plain["faults"] > 4 * pages  # a fresh mapping each time: faulted in afresh
    assert tuned["faults"] < 2 * pages  # reused (a block at a new address at most once)


def test_a_users_malloc_settings_win():
    assert _probe(True, {"MALLOC_TRIM_THRESHOLD_": "131072"})["installed"] is False
