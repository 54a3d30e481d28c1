"""The compaction scatter kernel equals its torch reference (Triton interpreted on the CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

from sglang_unicache.policy.kernels.scatter import scatter_rows_reference, write_compressed

SCRIPT = textwrap.dedent("""
    import torch
    from sglang_unicache.policy.kernels.scatter import scatter_rows_reference, scatter_rows_triton
    g = torch.Generator().manual_seed(0)
    for slots_total, k, h, d, dst_dtype in [(37, 5, 3, 7, torch.float32),
                                            (64, 16, 2, 16, torch.bfloat16),
                                            (9, 1, 1, 1, torch.float32),
                                            (300, 33, 4, 40, torch.bfloat16)]:
        dst = torch.randn(slots_total, h, d, generator=g).to(dst_dtype)
        src = torch.randn(k, h, d, generator=g)
        slots = torch.randperm(slots_total, generator=g)[:k]
        want = dst.clone()
        scatter_rows_reference(want, slots, src)
        got = dst.clone()
        scatter_rows_triton(got, slots, src)
        assert torch.equal(got, want), (slots_total, k, h, d, dst_dtype)
    print("ok")
""")


def test_triton_scatter_matches_reference_interpreted():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]


def test_write_compressed_fills_only_the_given_slots():
    k_buf = [torch.zeros(10, 2, 4) for _ in range(3)]
    v_buf = [torch.zeros(10, 2, 4) for _ in range(3)]
    keys = [torch.full((2, 2, 4), float(layer + 1)) for layer in range(3)]
    values = [-k for k in keys]
    write_compressed(k_buf, v_buf, torch.tensor([7, 2]), keys, values)
    for layer in range(3):
        assert torch.all(k_buf[layer][[2, 7]] == layer + 1)
        assert torch.all(v_buf[layer][[2, 7]] == -(layer + 1))
        untouched = [i for i in range(10) if i not in (2, 7)]
        assert torch.all(k_buf[layer][untouched] == 0)


def test_reference_casts_to_pool_dtype():
    dst = torch.zeros(4, 1, 2, dtype=torch.bfloat16)
    scatter_rows_reference(dst, torch.tensor([1]), torch.tensor([[[1.5, -2.25]]]))
    assert dst.dtype == torch.bfloat16 and dst[1].float().tolist() == [[1.5, -2.25]]
