"""Plan + execute time of every registered method on a 7B-like request.

Shape: 28 layers, 4 KV heads (28 query heads, GQA group 7), head_dim 128, 4 images x 1024 tokens
+ 256 text tokens, observation window 32, keep ratio 0.1. Random K/V, so quality numbers mean
nothing here; only time and bytes do.

    python -m benchmarks.bench_policy --reps 3 --dtype bf16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from sglang_unicache.policy.compressor import execute
from sglang_unicache.policy.config import UniCacheConfig
from sglang_unicache.policy.inputs import ImageSpan, ScoreInputs
from sglang_unicache.policy.registry import build_method, known_methods


def make_request(
    layers: int,
    kv_heads: int,
    group: int,
    head_dim: int,
    images: int,
    image_tokens: int,
    text_tokens: int,
    window: int,
    dtype: torch.dtype,
    device: str,
) -> ScoreInputs:
    g = torch.Generator().manual_seed(0)
    chunk = text_tokens // (images + 1)
    spans, pos = [], chunk
    for _ in range(images):
        spans.append(ImageSpan(pos, pos + image_tokens))
        pos += image_tokens
    t = pos + (text_tokens - chunk)
    k = torch.randn(layers, t, kv_heads, head_dim, generator=g).to(dtype).to(device)
    v = torch.randn(layers, t, kv_heads, head_dim, generator=g).to(dtype).to(device)
    q = torch.randn(layers, window, kv_heads * group, head_dim, generator=g).to(dtype).to(device)
    return ScoreInputs(k, v, spans, obs_queries=q)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--keep-ratio", type=float, default=0.1)
    ap.add_argument("--methods", nargs="*", default=known_methods())
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--image-tokens", type=int, default=1024)
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    inp = make_request(args.layers, 4, 7, 128, 4, args.image_tokens, 256, 32, dtype, args.device)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    print(
        f"# {inp.num_layers} layers, T={inp.num_tokens}, H=4 (G=7), D=128, {args.dtype}, "
        f"{args.device}, keep {args.keep_ratio}, threads {torch.get_num_threads()}, "
        f"median of {args.reps}"
    )
    print(
        f"{'method':<10} {'plan ms':>9} {'execute ms':>11} {'total ms':>9} {'slots/img':>10} "
        f"{'phys/full':>10} {'KL':>7} {'fallback':>8}"
    )
    for name in args.methods:
        method = build_method(UniCacheConfig(method=name, keep_ratio=args.keep_ratio))
        plan_t, exec_t = [], []
        for _ in range(args.reps + 1):  # first run warms up
            sync()
            t0 = time.perf_counter()
            rplan = method.plan(inp)
            sync()
            t1 = time.perf_counter()
            for sp in rplan.spans:
                execute(sp, inp.keys, inp.values)
            sync()
            t2 = time.perf_counter()
            plan_t.append(t1 - t0)
            exec_t.append(t2 - t1)
        p_ms = statistics.median(plan_t[1:]) * 1e3
        e_ms = statistics.median(exec_t[1:]) * 1e3
        sp = rplan.spans[0]
        kl = rplan.selfcheck.kl if rplan.selfcheck else float("nan")
        print(
            f"{name:<10} {p_ms:>9.1f} {e_ms:>11.1f} {p_ms + e_ms:>9.1f} "
            f"{sp.physical_slots:>10d} {sp.bytes.physical / sp.bytes.full:>10.3f} "
            f"{kl:>7.3f} {str(rplan.fallback):>8}"
        )


if __name__ == "__main__":
    main()
