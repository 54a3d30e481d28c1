"""The prefill attention of a request with a cached prefix on the ``unicache_cpu`` platform: the
new tokens' rows only.

SGLang's ``torch_native`` backend (``TorchNativeAttnBackend._run_sdpa_forward_extend``) runs
each request's extend as one causal SDPA over its *whole* sequence: the query is padded with the
prefix's positions (``per_req_query_redudant``) and the prefix's output rows are thrown away. A
turn of 40 new tokens after a cached 1,100-token image therefore pays the attention of a
1,140-token prefill, while a GPU kernel (FlashInfer, FA3) pays 40 x 1,140. On this CPU a cache
hit then saves the linear layers but not the attention, and a later question recalled over its
image's full KV (``engine/recall.py``) costs as much attention as a cold prefill: in the
multi-turn workload at 1,024-token images, py-spy put 59% of the plugin's prefill samples and
46% of stock's in this function, most of them on prefix rows.

``forward_extend_rows`` computes the ``e`` new rows against the ``p + e`` keys with the causal
mask offset by ``p`` (row ``i`` sees keys ``0 .. p + i``): the same attention, ``e (p + e)``
instead of ``(p + e)^2``: one layer of the workload model (4 heads of 128, 2 KV heads, fp32, one
thread), 40 new tokens after 1,100 cached ones, 27.7 ms in SGLang's code and 2.6 ms here. A
request without a prefix, cross-attention, encoder lengths and sliding windows go to SGLang's own
code. It applies to stock SGLang on this platform as well.

On by default; ``UNICACHE_CPU_EXTEND_ROWS=0`` keeps SGLang's own code (the new rows differ from
SGLang's in the last bits: another SDPA path).
"""

from __future__ import annotations

import os

import torch
from torch.nn.functional import scaled_dot_product_attention

_ORIGINAL = "_unicache_original_extend"
ENV = "UNICACHE_CPU_EXTEND_ROWS"


def enabled() -> bool:
    """True unless ``UNICACHE_CPU_EXTEND_ROWS`` is ``0`` (``false``, ``off``, empty)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("", "0", "false", "off")


def sglang_extend(cls):
    """SGLang's own ``_run_sdpa_forward_extend`` of ``cls``: the one ``install`` kept aside,
    else the class's."""
    original = getattr(cls, _ORIGINAL, None)
    return original if original is not None else cls._run_sdpa_forward_extend


def offset_causal_mask(extend: int, total: int, device) -> torch.Tensor:
    """``[extend, total]`` bool: new row ``i`` (position ``total - extend + i``) sees keys up to
    its own position."""
    prefix = total - extend
    rows = torch.arange(extend, device=device).unsqueeze(1)
    cols = torch.arange(total, device=device).unsqueeze(0)
    return cols <= rows + prefix


def forward_extend_rows(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                        seq_lens, extend_prefix_lens, extend_seq_lens, encoder_lens=None,
                        scaling=None, enable_gqa=False, causal=False, is_cross_attn=False,
                        sliding_window_size=None):
    """``_run_sdpa_forward_extend`` computing only each request's new rows."""
    if (encoder_lens is not None or is_cross_attn or not causal
            or (sliding_window_size is not None and sliding_window_size > -1)
            or not bool((extend_prefix_lens > 0).any())):
        return sglang_extend(type(self))(
            self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
            extend_prefix_lens, extend_seq_lens, encoder_lens, scaling=scaling,
            enable_gqa=enable_gqa, causal=causal, is_cross_attn=is_cross_attn,
            sliding_window_size=sliding_window_size)
    q_all = query.movedim(0, query.dim() - 2)  # [heads, tokens, dim]
    start = 0
    for extend, prefix, total, pool_idx in zip(extend_seq_lens.tolist(),
                                               extend_prefix_lens.tolist(), seq_lens.tolist(),
                                               req_pool_indices.tolist(), strict=True):
        end = start + extend
        tokens = req_to_token[pool_idx, :total]
        key = k_cache[tokens].movedim(0, query.dim() - 2)
        value = v_cache[tokens].movedim(0, query.dim() - 2)
        q = q_all[:, start:end, :]
        if not (q.dtype == key.dtype == value.dtype):
            key, value = key.to(q.dtype), value.to(q.dtype)
        if prefix:
            mask, is_causal = offset_causal_mask(extend, total, q.device), False
        else:
            mask, is_causal = None, True
        out = scaled_dot_product_attention(q.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0),
                                           attn_mask=mask, enable_gqa=enable_gqa, scale=scaling,
                                           is_causal=is_causal)
        output[start:end] = out.squeeze(0).movedim(query.dim() - 2, 0)
        start = end
    return output


def install() -> bool:
    """Route the backend's extend through ``forward_extend_rows`` unless
    ``UNICACHE_CPU_EXTEND_ROWS`` turns it off (idempotent); True when installed."""
    if not enabled():
        return False
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    if getattr(TorchNativeAttnBackend, _ORIGINAL, None) is None:
        setattr(TorchNativeAttnBackend, _ORIGINAL,
                TorchNativeAttnBackend._run_sdpa_forward_extend)
        TorchNativeAttnBackend._run_sdpa_forward_extend = forward_extend_rows
    return True


__all__ = ["ENV", "forward_extend_rows", "install", "offset_causal_mask", "sglang_extend"]
