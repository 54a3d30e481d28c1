"""Rows holding compacted / reused compressed spans are read correctly by FlashInfer's layout.

SGLang builds FlashInfer's ragged page table with ``create_flashinfer_kv_indices_triton`` (run
here under ``TRITON_INTERPRET=1``). For a batch whose rows hold compressed image spans, as our
compaction and reuse leave them, the kernel must emit exactly the compacted slot lists, and paged
decode attention over those indices (a torch reference of FlashInfer's page-size-1 decode) must
equal what the torch_native backend computes from the same rows.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import torch
    from sglang.kernels.ops.attention.kv_indices import create_flashinfer_kv_indices_triton
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang_unicache.engine.kvpool import SpanResult, plan_compaction, write_spans

    g = torch.Generator().manual_seed(0)
    slots, kv_heads, q_heads, dim = 400, 2, 4, 16
    k_buf = [torch.randn(slots, kv_heads, dim, generator=g)]
    v_buf = [torch.randn(slots, kv_heads, dim, generator=g)]
    free = torch.randperm(slots - 1, generator=g) + 1  # slot 0 is SGLang's padding slot

    def span_kv(n):
        return ([torch.randn(n, kv_heads, dim, generator=g)],
                [torch.randn(n, kv_heads, dim, generator=g)])

    # Request A: 4 text + 64 image + 13 text tokens, compressed after prefill to 16 entries.
    row_a = free[:81].to(torch.int32)
    keys, values = span_kv(16)
    spans = [SpanResult(4, 68, keys, values)]
    a = plan_compaction(row_a, spans)
    write_spans(a, spans, k_buf, v_buf)
    assert a.row.shape[0] == 81 - 48 and a.freed.numel() == 48
    # Request B reuses A's prefix through the tree (text + the 16 compressed entries + 1 token)
    # and adds its own 9 tokens; request C is text only.
    row_b = torch.cat([a.row[:21], free[81:90].to(torch.int32)])
    row_c = free[90:120].to(torch.int32)
    rows = [a.row, row_b, row_c]
    req_to_token = torch.zeros(8, 128, dtype=torch.int32)
    pool_idx = torch.tensor([5, 2, 7], dtype=torch.int64)
    for i, row in zip(pool_idx.tolist(), rows):
        req_to_token[i, :row.shape[0]] = row
    seq_lens = torch.tensor([r.shape[0] for r in rows], dtype=torch.int32)
    kv_indptr = torch.zeros(4, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(seq_lens, 0)
    kv_indices = torch.empty(int(kv_indptr[-1]), dtype=torch.int32)
    create_flashinfer_kv_indices_triton[(3,)](
        req_to_token, pool_idx, seq_lens, kv_indptr, None, kv_indices, req_to_token.shape[1])
    assert torch.equal(kv_indices, torch.cat(rows)), "FlashInfer indices differ from the rows"

    # Paged decode over the ragged indices, page size 1 (FlashInfer's semantics), GQA.
    query = torch.randn(3, q_heads, dim, generator=g)
    scale = dim ** -0.5
    want = []
    for i in range(3):
        idx = kv_indices[kv_indptr[i]:kv_indptr[i + 1]].long()
        k = k_buf[0][idx].repeat_interleave(q_heads // kv_heads, dim=1)  # [T, Hq, D]
        v = v_buf[0][idx].repeat_interleave(q_heads // kv_heads, dim=1)
        p = torch.softmax(torch.einsum("hd,thd->ht", query[i], k) * scale, dim=-1)
        want.append(torch.einsum("ht,thd->hd", p, v))
    want = torch.stack(want)

    backend = TorchNativeAttnBackend.__new__(TorchNativeAttnBackend)
    got = torch.empty_like(query)
    backend._run_sdpa_forward_decode(query, got, k_buf[0], v_buf[0], req_to_token, pool_idx,
                                     seq_lens.long(), scaling=scale, enable_gqa=True)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    print("ok")
""")


def test_flashinfer_indices_and_decode_match_torch_native_on_compacted_rows():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env,
                         timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]
