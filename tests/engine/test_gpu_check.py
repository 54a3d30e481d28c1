"""The GPU check (``benchmarks/gpu_check.py``) runs end to end in its dry mode on the CPU
platform, so the script a lent GPU will run cannot rot: identity at keep 1.0, compression and
reuse at keep 0.1, the Triton kernels against their references, the decode timing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.server import cpu_env

REPO = Path(__file__).resolve().parents[2]
JOBS = 3


def test_the_gpu_check_passes_dry_on_the_cpu_platform(tmp_path, server_factory):
    server_factory.make_room(JOBS)  # up to JOBS of its servers run side by side
    out = tmp_path / "gpu-check.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--dry", "--jobs",
                           str(JOBS), "--out", str(out)], capture_output=True, text=True,
                          timeout=1200,
                          env=cpu_env(), cwd=REPO)
    assert out.exists(), proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert list(result["backends"]) == ["torch_native"]
    check = result["backends"]["torch_native"]
    assert check["identity"]["ok"], check["identity"]
    assert check["identity"]["stock"] == check["identity"]["unicache"]
    assert check["compression"]["ok"], check["compression"]
    assert check["compression_paged"]["ok"], check["compression_paged"]
    assert result["kernels"]["ok"], result["kernels"]
    assert result["decode"]["ok"], result["decode"]
    assert result["ok"] and proc.returncode == 0, proc.stdout[-2000:]
