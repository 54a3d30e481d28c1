"""The GPU targets script (``benchmarks/gpu_targets.py``) runs every step end to end in its dry
mode on the CPU platform, so the command a lent GPU will run cannot rot: the compression's share
of the prefill, SGLang's benchmark client against stock, a recall's cost, the multi-turn chats."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.gpu_targets import STEPS
from tests.support.server import cpu_env

REPO = Path(__file__).resolve().parents[2]
SHIPPED = "defaults as shipped"


def test_every_gpu_target_step_runs_dry_on_the_cpu_platform(tmp_path, server_factory):
    server_factory.make_room(1)  # one server at a time
    out = tmp_path / "gpu-targets.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_targets", "--dry", "--out",
                           str(out)], capture_output=True, text=True, timeout=900,
                          env=cpu_env(), cwd=REPO)
    assert out.exists(), proc.stderr[-3000:]
    result = json.loads(out.read_text())
    steps = result["steps"]
    assert list(steps) == list(STEPS)
    assert not [s for s, got in steps.items() if "error" in got], steps
    assert proc.returncode == 0, proc.stdout[-2000:]
    (overhead,) = steps["overhead"]["rows"]
    assert SHIPPED in overhead["method"] and overhead["images_compressed"] == 1
    assert 0 < overhead["compress_ms"] and 0 < overhead["overhead_share"]
    for step in ("client", "multi-turn"):
        stock, shipped, *cached = steps[step]["rows"]
        assert stock["server"] == "stock" and SHIPPED in shipped["server"]
        assert shipped["images_compressed"] > 0 and shipped["tok_s_vs_stock"] > 0
    # where images repeat, stock with the preprocessing cache --unicache turns on has its row
    (cached,) = cached
    assert "preprocessing cache" in cached["server"] and cached["images_compressed"] == 0
    assert cached["tok_s_vs_stock"] > 0
    assert "busy chats" in steps["multi-turn"]["rows"][1]["workload"]
    # each step keeps its own server and client logs (the two client steps number theirs alike)
    logs = out.with_suffix("")
    assert all((logs / step / "serving-client-1.jsonl").exists()
               for step in ("client", "multi-turn"))
    assert steps["multi-turn"]["rows"][1]["spans_recalled"] > 0  # later turns recall images
    recall = {row["server"]: row for row in steps["recall"]["rows"]}
    assert any("preprocessing cache" in name and row["recalls"] == 0
               for name, row in recall.items())
    shipped = next(row for name, row in recall.items() if name.endswith(f"({SHIPPED})"))
    assert shipped["recalls"] == 1 and shipped["bytes_per_reuse"] > 0
    # one verdict per target the dry run's rows name, each its value against its limit
    assert sorted((v["step"], v["key"]) for v in result["targets"]) == [
        ("client", "tok_s_vs_stock"), ("client", "ttft_vs_stock"),
        ("multi-turn", "tok_s_vs_stock"), ("overhead", "overhead_share"), ("recall", "ttft_ms")]
    for v in result["targets"]:
        op, limit = v["limit"].split()
        assert v["met"] == (v["value"] <= float(limit) if op == "<=" else
                            v["value"] >= float(limit))
