"""A deterministic tiny random LLaVA-OneVision checkpoint (1-D RoPE Qwen2 language model), built
offline in seconds.

The layout is lmms-lab's (``llava-onevision-qwen2-*``): a LLaVA-NeXT style config whose top level
is the Qwen2 language model's (``architectures: LlavaQwenForCausalLM``, ``model_type: llava``),
with ``mm_*`` fields naming the vision tower, the projector and the image layout, and weights
``model.*``/``lm_head.*`` for the language model, ``model.mm_projector.{0,2}`` for the two-layer
GELU projector and ``model.image_newline``. SGLang 0.5.23 serves it with its native
``LlavaQwenForCausalLM`` (sglang/srt/models/llava.py), which loads the vision tower itself, with
transformers' ``SiglipVisionModel.from_pretrained(mm_vision_tower)`` in float16, when the path
contains ``siglip``: this builder writes that tower as a separate SigLIP checkpoint next to the
model and names it by its absolute path. (SGLang forces the model to float16 as well,
``get_hf_text_config``: the tower's features go straight into the projector.)

SGLang's LLaVA image processor (sglang/srt/multimodal/processors/llava.py) uses the checkpoint's
``image_aspect_ratio``. With ``anyres_max_9`` and one grid pinpoint ``[S, S]`` (``S`` the tower's
``image_size``) a single image becomes a base view and one ``S`` px tile: ``n * n`` base tokens
and ``n * (n + 1)`` tile tokens (each row ends with ``image_newline``, ``spatial_unpad``), with
``n = S / patch``: 112 px, patch 14 give 64 + 72 = 136 tokens. Several images in one request
(``modalities: multi-images`` on their ``image_url`` parts) are padded to squares instead and take
``n * n`` tokens each. The ``<image>`` token of the prompt is expanded by the model's
``pad_input_ids``. The chat format is SGLang's ``chatml-llava`` conversation template, which it
picks from the model path (``llava-onevision-qwen2``): keep that in the directory name.

    python -m tests.support.tiny_llava_onevision OUT_DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tests.support.tiny_vlm import IMAGE_TOKEN_CHAT_TEMPLATE, chatml_tokenizer

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>"]

IMAGE_SIZE = 112  # the SigLIP tower's input side, and the one anyres grid pinpoint
PATCH_SIZE = 14
SIDE = IMAGE_SIZE // PATCH_SIZE
IMAGE_TOKENS = SIDE * SIDE + SIDE * (SIDE + 1)  # one image: base view + one tile with newlines
PADDED_IMAGE_TOKENS = SIDE * SIDE  # each image of a multi-image request
TOWER_DIR = "siglip-tower"  # SGLang picks SigLIP when "siglip" is in mm_vision_tower

def build_tokenizer(vocab_size: int = 640):
    """A byte-level BPE tokenizer with the ChatML tokens and ``<image>`` (deterministic)."""
    return chatml_tokenizer(SPECIAL_TOKENS, IMAGE_TOKEN_CHAT_TEMPLATE, vocab_size)


def tower_config(*, vision_dim: int = 32, vision_layers: int = 2, vision_heads: int = 2):
    from transformers import SiglipVisionConfig

    return SiglipVisionConfig(
        hidden_size=vision_dim,
        intermediate_size=2 * vision_dim,
        num_hidden_layers=vision_layers,
        num_attention_heads=vision_heads,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        hidden_act="gelu_pytorch_tanh",
        layer_norm_eps=1e-6,
    )


def build_config(tokenizer, tower_path: Path, *, hidden: int = 64, layers: int = 2,
                 heads: int = 4, kv_heads: int = 2, vision_dim: int = 32) -> dict:
    """config.json of an lmms-lab LLaVA-OneVision checkpoint (Qwen2 fields at the top level)."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return {
        "architectures": ["LlavaQwenForCausalLM"],
        "model_type": "llava",
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
        "torch_dtype": "float16",
        "image_token_index": tokenizer.convert_tokens_to_ids("<image>"),
        "mm_vision_tower": str(tower_path),
        "mm_hidden_size": vision_dim,
        "mm_projector_type": "mlp2x_gelu",
        "mm_vision_select_layer": -2,
        "mm_vision_select_feature": "patch",
        "mm_patch_merge_type": "spatial_unpad",
        "image_aspect_ratio": "anyres_max_9",
        "image_grid_pinpoints": [[IMAGE_SIZE, IMAGE_SIZE]],
        "projector_hidden_act": "gelu",
        "multimodal_projector_bias": True,
    }


def _shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor ``LlavaQwenForCausalLM.load_weights`` reads from the model's checkpoint."""
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = config["num_key_value_heads"] * (h // config["num_attention_heads"])
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (vocab, h),
        "model.image_newline": (h,),
        "model.mm_projector.0.weight": (h, config["mm_hidden_size"]),
        "model.mm_projector.0.bias": (h,),
        "model.mm_projector.2.weight": (h, h),
        "model.mm_projector.2.bias": (h,),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.q_proj.bias": (h,),
            p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })
    return shapes


def random_weights(config: dict, *, seed: int = 0):
    """Random float16 weights (norm scales near 1, the rest small) from a fixed seed."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in _shapes(config).items():
        if name.endswith("norm.weight"):
            tensor = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            std = 0.5 if "embed" in name or "newline" in name else \
                0.2 if name.endswith("bias") else 0.1
            tensor = std * torch.randn(shape, generator=gen)
        weights[name] = tensor.to(torch.float16).contiguous()
    return weights


def _save_tower(out: Path, *, seed: int) -> Path:
    """A random SigLIP vision tower (transformers' own initialisation, fixed seed)."""
    import torch
    from transformers import SiglipVisionModel

    torch.manual_seed(seed)
    tower = SiglipVisionModel(tower_config()).to(torch.float16).eval()
    path = out / TOWER_DIR
    tower.save_pretrained(path)
    return path


def _save_processor(tokenizer, out: Path) -> None:
    """A LLaVA processor with SigLIP's image processor (``IMAGE_SIZE`` squares)."""
    from transformers import LlavaProcessor, SiglipImageProcessor

    image_processor = SiglipImageProcessor(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer,
                   patch_size=PATCH_SIZE, vision_feature_select_strategy="full",
                   image_token="<image>",
                   chat_template=IMAGE_TOKEN_CHAT_TEMPLATE).save_pretrained(out)


def build_tiny_llava_onevision(out_dir: str | Path, *, seed: int = 0, hidden: int = 64,
                               layers: int = 2) -> Path:
    """Write a complete checkpoint (weights, config, tokenizer, processor, SigLIP tower) to
    ``out_dir``; keep ``llava-onevision-qwen2`` in its name (SGLang's chat template choice)."""
    from safetensors.torch import save_file

    out = Path(out_dir).absolute()
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tower = _save_tower(out, seed=seed + 1)
    config = build_config(tokenizer, tower, hidden=hidden, layers=layers)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    eos = config["eos_token_id"]
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id":
         tokenizer.convert_tokens_to_ids("<|endoftext|>")}, indent=2))
    tokenizer.save_pretrained(out)
    _save_processor(tokenizer, out)
    save_file(random_weights(config, seed=seed), out / "model.safetensors",
              metadata={"format": "pt"})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(build_tiny_llava_onevision(args.out_dir, seed=args.seed))


if __name__ == "__main__":
    main()
