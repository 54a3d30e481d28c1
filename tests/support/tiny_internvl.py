"""A deterministic tiny random InternVL checkpoint (1-D RoPE Qwen2 language model), built offline
in seconds.

The layout is OpenGVLab's ``internvl_chat`` format (InternVL2.5/3-1B: an InternViT tower, a pixel
shuffle and an MLP projector ``mlp1`` in front of a ``Qwen2ForCausalLM``). SGLang 0.5.23 serves
it with its native ``InternVLChatModel`` (sglang/srt/models/internvl.py) and reads the config
with its own ``InternVLChatConfig`` (sglang/srt/configs/internvl.py): SGLang registers that class
with ``AutoConfig`` for ``model_type`` ``internvl_chat`` and re-parses the config through it, so
the checkpoint needs no ``auto_map``, no remote Python files and no ``--trust-remote-code``.

SGLang's InternVL processor (sglang/srt/multimodal/processors/internvl.py) tiles every image into
448 px tiles (the size is fixed there, whatever the config says) and, for a square image, keeps
one tile and no thumbnail. A tile takes ``(448 / patch_size)^2 * downsample_ratio^2`` tokens:
patch 28 and ratio 0.5 give 64 ``<IMG_CONTEXT>`` tokens between ``<img>`` and ``</img>``. With
``model_type`` ``internvl_chat`` SGLang formats chats with its ``internvl-2-5`` conversation
template (its system message included), not with the tokenizer's chat template.

    python -m tests.support.tiny_internvl OUT_DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tests.support.tiny_vlm import IMAGE_TOKEN_CHAT_TEMPLATE, chatml_tokenizer

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<img>",
    "</img>",
    "<IMG_CONTEXT>",
    "<|video_pad|>",
    "<image>",
]

TILE = 448  # SGLang's InternVL processor cuts images into tiles of this side

def build_tokenizer(vocab_size: int = 640):
    """A byte-level BPE tokenizer with InternVL's image tokens (deterministic)."""
    return chatml_tokenizer(SPECIAL_TOKENS, IMAGE_TOKEN_CHAT_TEMPLATE, vocab_size)


def build_config(tokenizer, *, patch_size: int = 28, hidden: int = 64, layers: int = 2,
                 heads: int = 4, kv_heads: int = 2, vision_dim: int = 32, vision_layers: int = 1,
                 vision_heads: int = 2) -> dict:
    """config.json of an ``internvl_chat`` checkpoint with a Qwen2 language model."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    llm = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": len(tokenizer),
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "torch_dtype": "bfloat16",
    }
    vision = {
        "architectures": ["InternVisionModel"],
        "model_type": "intern_vit_6b",
        "hidden_size": vision_dim,
        "intermediate_size": 2 * vision_dim,
        "num_hidden_layers": vision_layers,
        "num_attention_heads": vision_heads,
        "num_channels": 3,
        "image_size": TILE,
        "patch_size": patch_size,
        "qkv_bias": True,
        "qk_normalization": False,
        "norm_type": "layer_norm",
        "hidden_act": "gelu",
        "layer_norm_eps": 1e-6,
        "dropout": 0.0,
        "drop_path_rate": 0.0,
        "attention_dropout": 0.0,
        "initializer_factor": 1.0,
        "use_flash_attn": False,
        "torch_dtype": "bfloat16",
    }
    return {
        "architectures": ["InternVLChatModel"],
        "model_type": "internvl_chat",
        "llm_config": llm,
        "vision_config": vision,
        "downsample_ratio": 0.5,
        "force_image_size": TILE,
        "select_layer": -1,
        "ps_version": "v2",
        "template": "internvl2_5",
        "dynamic_image_size": True,
        "use_thumbnail": True,
        "min_dynamic_patch": 1,
        "max_dynamic_patch": 1,
        "pad2square": False,
        "use_backbone_lora": 0,
        "use_llm_lora": 0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "eos_token_id": eos,
    }


def _shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor ``InternVLChatModel.load_weights`` expects, by its checkpoint name."""
    llm, vit = config["llm_config"], config["vision_config"]
    h, inter, vocab = llm["hidden_size"], llm["intermediate_size"], llm["vocab_size"]
    head_dim = h // llm["num_attention_heads"]
    kv = llm["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "language_model.model.embed_tokens.weight": (vocab, h),
        "language_model.model.norm.weight": (h,),
        "language_model.lm_head.weight": (vocab, h),
    }
    for i in range(llm["num_hidden_layers"]):
        p = f"language_model.model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.q_proj.bias": (h,),
            p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })
    d, patch = vit["hidden_size"], vit["patch_size"]
    positions = (vit["image_size"] // patch) ** 2 + 1
    shapes.update({
        "vision_model.embeddings.class_embedding": (1, 1, d),
        "vision_model.embeddings.position_embedding": (1, positions, d),
        "vision_model.embeddings.patch_embedding.weight": (d, 3, patch, patch),
        "vision_model.embeddings.patch_embedding.bias": (d,),
    })
    for i in range(vit["num_hidden_layers"]):
        p = f"vision_model.encoder.layers.{i}."
        shapes.update({
            p + "attn.qkv.weight": (3 * d, d), p + "attn.qkv.bias": (3 * d,),
            p + "attn.proj.weight": (d, d), p + "attn.proj.bias": (d,),
            p + "mlp.fc1.weight": (2 * d, d), p + "mlp.fc1.bias": (2 * d,),
            p + "mlp.fc2.weight": (d, 2 * d), p + "mlp.fc2.bias": (d,),
            p + "norm1.weight": (d,), p + "norm1.bias": (d,),
            p + "norm2.weight": (d,), p + "norm2.bias": (d,),
            p + "ls1": (d,), p + "ls2": (d,),
        })
    shuffled = d * int(1 / config["downsample_ratio"]) ** 2
    shapes.update({
        "mlp1.0.weight": (shuffled,), "mlp1.0.bias": (shuffled,),
        "mlp1.1.weight": (h, shuffled), "mlp1.1.bias": (h,),
        "mlp1.3.weight": (h, h), "mlp1.3.bias": (h,),
    })
    return shapes


def random_weights(config: dict, *, seed: int = 0):
    """Random bf16 weights (norm scales near 1, the rest small) from a fixed seed."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in _shapes(config).items():
        norm_scale = name.endswith(("norm.weight", "layernorm.weight", "norm1.weight",
                                    "norm2.weight", "mlp1.0.weight"))
        if norm_scale:
            tensor = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith(("ls1", "ls2")):
            tensor = 0.5 + 0.1 * torch.randn(shape, generator=gen)
        else:
            std = 0.5 if "embed" in name else 0.2 if name.endswith("bias") else 0.1
            tensor = std * torch.randn(shape, generator=gen)
        weights[name] = tensor.to(torch.bfloat16).contiguous()
    return weights


def build_tiny_internvl(out_dir: str | Path, *, seed: int = 0, hidden: int = 64,
                        layers: int = 2) -> Path:
    """Write a complete checkpoint (weights, config, tokenizer) to ``out_dir``: a square image
    takes 64 ``<IMG_CONTEXT>`` tokens."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(out)
    config = build_config(tokenizer, hidden=hidden, layers=layers)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    eos = config["eos_token_id"]
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id":
         tokenizer.convert_tokens_to_ids("<|endoftext|>")}, indent=2))
    save_file(random_weights(config, seed=seed), out / "model.safetensors",
              metadata={"format": "pt"})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(build_tiny_internvl(args.out_dir, seed=args.seed))


if __name__ == "__main__":
    main()
