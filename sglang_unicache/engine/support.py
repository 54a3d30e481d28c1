"""Setups ``--unicache`` refuses at startup, each with one line that says why.

Compaction rewrites a request's row of ``req_to_token`` and writes the pool token by token
(``[slots, heads, dim]``, any page size) in one dtype, so it needs an ordinary MHA pool in that
layout and no second copy of the KV elsewhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Architectures whose positions survive compaction (positions.py): M-RoPE models keep later
# tokens at their logical positions through the request's M-RoPE delta; 1-D RoPE VLMs (SGLang's
# LLaVA adaptor: Llama/Mistral/Qwen2 text models with a Pixtral tower, as served by 0.5.23)
# through a per-request offset added to the batch's positions.
#
# Qwen3-VL (dense and MoE): its interleaved M-RoPE only changes which rotary lanes read the
# temporal, height and width rows of the same ``[3, L]`` positions; SGLang builds them in its
# Qwen-VL processor with the same ``delta = max position + 1 - prompt length`` and decodes at
# ``delta + seq_len - 1`` for every M-RoPE model, so ``shift_mrope`` keeps them as for Qwen2-VL.
# DeepStack adds the vision tower's intermediate features to the first decoder layers' hidden
# states of the image tokens during their prefill only: they are already inside the KV those
# layers wrote, so a kept entry keeps them, and neither decode nor a prefill that reuses the
# span adds them again (the image tokens are not in its extend).
SUPPORTED_ARCHITECTURES = (
    "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
    "LlavaForConditionalGeneration",
    # InternVL (Qwen2/Qwen3 language model, 1-D RoPE): per-request offset, as for LLaVA.
    "InternVLChatModel",
    # LLaVA-OneVision (Qwen2 language model, 1-D RoPE): per-request offset, as for LLaVA.
    "LlavaQwenForCausalLM",
)
SCALED_KV_DTYPES = ("mxfp8", "nvfp4", "fp4_mx_block16")
# Attention backends SGLang 0.5.23 runs only with pages of its choosing (``arg_groups/
# overrides.py``: it sets the page size after parsing), and why each is refused. TRT-LLM's
# Blackwell kernels read the pool heads-first (HND, ``trtllm_mha_backend.py``).
PAGED_BACKENDS = {
    "trtllm_mha": "its Blackwell kernels read the KV pool heads-first (HND), a layout compaction "
                  "does not write; SGLang picks it by default on Blackwell GPUs",
    "hpc_ops": "its KV layout is not one compaction writes",
}
_HYBRID_LAYER_TYPES = ("sliding_attention", "linear_attention", "mamba", "chunked_attention")


def unsupported_server_args(args: Any) -> str | None:
    """Why the serving flags rule ``--unicache`` out, or None."""
    paged = paged_attention_backend(args)
    if paged:
        return f"--attention-backend {paged} is not supported with --unicache " \
               f"({PAGED_BACKENDS[paged]}): use --attention-backend fa3, flashinfer or " \
               "triton, with any --page-size"
    algorithm = getattr(args, "speculative_algorithm", None)
    if algorithm:
        return f"--speculative-algorithm {algorithm}: speculative decoding is not supported " \
               "with --unicache"
    pp = getattr(args, "pp_size", 1) or 1
    if pp > 1:
        # A stage holds some layers: a plan needs every layer's statistics (self-check on the
        # last layers, layer budgets over all of them), which no stage has.
        return f"--pp-size {pp}: pipeline parallel stages cannot agree on one compression " \
               "plan; --unicache supports --tp-size and --dp-size"
    refused = _unsupported_attention_layout(args)
    if refused:
        return refused
    if getattr(args, "enable_mixed_chunk", False):
        return "--enable-mixed-chunk: mixed prefill/decode batches are not supported with " \
               "--unicache (images in them would never be compressed)"
    if getattr(args, "enable_hierarchical_cache", False):
        refused = _unsupported_hicache(args)
        if refused:
            return refused
    mode = getattr(args, "disaggregation_mode", "null")
    if mode not in (None, "null"):
        return f"--disaggregation-mode {mode}: PD disaggregation is not supported with --unicache"
    dtype = getattr(args, "kv_cache_dtype", "auto")
    if dtype in SCALED_KV_DTYPES:
        return f"--kv-cache-dtype {dtype}: KV dtypes with separate scale buffers are not " \
               f"supported with --unicache (use auto, bf16, fp8_e4m3 or fp8_e5m2)"
    return None


def paged_attention_backend(args: Any) -> str | None:
    """The attention backend (for prefill, decode or both) that SGLang runs only on pages of its
    own choosing, in a layout compaction does not write, or None. The refusal names the backend,
    not the ``--page-size`` SGLang sets for it after parsing (a flag the user never typed)."""
    for name in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
        backend = getattr(args, name, None)
        if backend in PAGED_BACKENDS:
            return backend
    return None


def _unsupported_attention_layout(args: Any) -> str | None:
    """Layouts where the attention hook does not see each request's query rows and every KV
    slot of its layers on this rank, in one forward per prefill.

    - Attention DP (``--attn-dp-size``; the deprecated ``--enable-dp-attention`` becomes it
      during resolution, so both are read): the batch is gathered and split across ranks.
    - Context parallel (``--attn-cp-size``, ``--enable-prefill-cp``) and decode context parallel
      (``--dcp-size``): a request's query rows and KV are split across ranks, so the capture
      indexes rows this rank does not hold.
    - PD multiplexing (``--enable-pdmux``) splits a prefill's layers across forwards, two-batch
      overlap (``--enable-two-batch-overlap``) runs attention through its own backend's
      ``forward``, and a full prefill CUDA graph (``--cuda-graph-backend-prefill full``) replays
      kernels without Python: the capture would miss layers.
    """
    attn_dp = getattr(args, "attn_dp_size", 1) or 1
    if attn_dp > 1 or getattr(args, "enable_dp_attention", False):
        flag = f"--attn-dp-size {attn_dp}" if attn_dp > 1 else "--enable-dp-attention"
        return f"{flag}: data-parallel attention is not supported with --unicache (use " \
               "--dp-size without it)"
    for name, flag in (("attn_cp_size", "--attn-cp-size"), ("dcp_size", "--dcp-size")):
        size = getattr(args, name, 1) or 1
        if size > 1:
            return f"{flag} {size}: context parallel attention splits a request's queries and " \
                   "KV across ranks; not supported with --unicache"
    for name, flag in (("enable_prefill_cp", "--enable-prefill-cp"),
                       ("enable_pdmux", "--enable-pdmux"),
                       ("enable_two_batch_overlap", "--enable-two-batch-overlap")):
        if getattr(args, name, False):
            return f"{flag}: not supported with --unicache (the prefill's attention runs " \
                   "where the plugin cannot read its queries)"
    if getattr(args, "cuda_graph_backend_prefill", None) == "full":
        return "--cuda-graph-backend-prefill full: a prefill replayed from a CUDA graph hides " \
               "its queries from --unicache (use breakable or disabled)"
    return None


def _unsupported_hicache(args: Any) -> str | None:
    """HiCache with compressed spans: the host tier, with the write-through policies and in
    cache mode. A storage backend (L3) would keep spans past the process that holds their
    metadata; write-back and buffer-only mode move KV on paths the plugin does not follow."""
    backend = getattr(args, "hicache_storage_backend", None)
    if backend:
        return f"--hicache-storage-backend {backend}: HiCache storage backends are not " \
               "supported with --unicache (the host tier is)"
    policy = getattr(args, "hicache_write_policy", "write_through")
    if policy == "write_back":
        return "--hicache-write-policy write_back: not supported with --unicache (use " \
               "write_through or write_through_selective)"
    mode = getattr(args, "hicache_host_memory_mode", "cache")
    if mode not in (None, "cache"):
        return f"--hicache-host-memory-mode {mode}: only cache mode is supported with --unicache"
    return None


def unsupported_host_quantization(args: Any, config: Any) -> str | None:
    """``host_quantization`` needs HiCache, this project's CPU platform (whose host copy
    quantizes) and a pool it can read as floats."""
    mode = getattr(config, "host_quantization", "off")
    if mode == "off":
        return None
    if not getattr(args, "enable_hierarchical_cache", False):
        return f"host_quantization {mode}: needs --enable-hierarchical-cache (it quantizes " \
               "HiCache's host copies)"
    from sglang_unicache.platform.cpu import is_current

    if not is_current():
        return f"host_quantization {mode}: only the unicache_cpu platform's HiCache copies " \
               "quantize (on a GPU they are sgl-kernel ops)"
    dtype = getattr(args, "kv_cache_dtype", "auto")
    if dtype not in (None, "auto", "bf16", "bfloat16", "float16", "half", "float32"):
        return f"host_quantization {mode}: not with --kv-cache-dtype {dtype} (the host copy " \
               "quantizes floating-point KV)"
    return None


def language_model_fields(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The config's fields with the language model's: VLM checkpoints keep them in
    ``text_config`` (InternVL in ``llm_config``), older ones at the top level."""
    return {**(hf_config.get("llm_config") or {}), **(hf_config.get("text_config") or {}),
            **hf_config}


def unsupported_model(hf_config: dict[str, Any]) -> str | None:
    """Why the checkpoint's config rules ``--unicache`` out, or None."""
    merged = language_model_fields(hf_config)
    if "kv_lora_rank" in merged or "index_topk" in merged:
        return "MLA/DSA models are not supported with --unicache (they use a latent KV pool)"
    hybrid = [t for t in merged.get("layer_types") or [] if t in _HYBRID_LAYER_TYPES]
    if hybrid or merged.get("use_sliding_window") or merged.get("is_hybrid_swa"):
        kind = hybrid[0] if hybrid else "sliding_attention"
        return f"hybrid models ({kind} layers: SWA/SSM pools) are not supported with --unicache"
    archs = hf_config.get("architectures") or []
    if not any(arch in SUPPORTED_ARCHITECTURES for arch in archs):
        known = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        return f"model architecture {'/'.join(archs) or 'unknown'} is not supported with " \
               f"--unicache; supported: {known}"
    return None


def local_hf_config(model_path: str | None) -> dict[str, Any] | None:
    """The checkpoint's config.json when the model is a local directory (no hub access)."""
    if not model_path:
        return None
    path = Path(model_path) / "config.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def unsupported_sharding(args: Any, hf_config: dict[str, Any]) -> str | None:
    """Tensor parallel with fewer KV heads than ranks replicates heads across ranks; their query
    groups then differ by rank, and so would the heads' selections."""
    tp = getattr(args, "tp_size", 1) or 1
    merged = language_model_fields(hf_config)
    kv_heads = merged.get("num_key_value_heads") or merged.get("num_attention_heads")
    if tp > 1 and kv_heads and kv_heads % tp:
        return f"--tp-size {tp} does not divide the model's {kv_heads} KV heads: replicated " \
               "KV heads are not supported with --unicache"
    return None


def unsupported_setup(args: Any, hf_config: dict[str, Any] | None) -> str | None:
    return unsupported_server_args(args) or (
        unsupported_model(hf_config) or unsupported_sharding(args, hf_config)
        if hf_config is not None else None
    )
