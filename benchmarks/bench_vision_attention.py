"""The vision tower's attention on the CPU platform: SGLang's masked batch against one image at a
time (``sglang_unicache/platform/cpu/vision.py``).

Times one ``VisionSdpaAttention`` call over ``k`` images of ``n`` patches each, flattened into one
sequence as Qwen2-VL's tower does: SGLang's own ``forward`` (a block-diagonal ``[1, kn, kn]``
mask) and the platform's ``forward_by_segment``, and checks that the two agree.

    python -m benchmarks.bench_vision_attention     # 896 px images: 4,096 patches, 1-4 images
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from sglang.srt.layers.attention.vision import VisionSdpaAttention

from sglang_unicache.platform.cpu import vision


def timed(forward, module, inputs: dict, reps: int) -> tuple[float, torch.Tensor]:
    """Mean seconds of ``forward(module, **inputs)`` after one untimed call (the first call
    builds and caches SGLang's mask), and its output."""
    out = forward(module, **inputs)
    start = time.perf_counter()
    for _ in range(reps):
        forward(module, **inputs)
    return (time.perf_counter() - start) / reps, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patches", type=int, default=4096, help="patches per image")
    parser.add_argument("--images", default="1,2,4")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    module = VisionSdpaAttention(head_dim=args.head_dim, num_heads=args.heads,
                                 num_kv_heads=args.heads, flatten_batch=True)
    sglang_forward = vision.sglang_forward(VisionSdpaAttention)
    torch.manual_seed(0)
    for count in (int(x) for x in args.images.split(",")):
        s = count * args.patches
        q, key, v = (torch.randn(s, args.heads, args.head_dim, dtype=dtype) for _ in range(3))
        inputs = {"q": q, "k": key, "v": v, "bsz": 1,
                  "cu_seqlens": torch.arange(0, s + 1, args.patches, dtype=torch.int32)}
        masked, expected = timed(sglang_forward, module, inputs, args.reps)
        split, got = timed(vision.forward_by_segment, module, inputs, args.reps)
        diff = (expected.float() - got.float()).abs().max()
        print(json.dumps({"images": count, "patches": s, "dtype": args.dtype,
                          "sglang_masked_s": round(masked, 3), "by_segment_s": round(split, 3),
                          "ratio": round(masked / split, 1),
                          "max_abs_diff": float(diff)}))


if __name__ == "__main__":
    main()
