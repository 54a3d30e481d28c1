"""The main job: serve a VLM on CPU with ``--unicache`` and run a multi-turn image workload.

    python -m sglang_unicache.demo [--model PATH] [--images 4] [--turns 3]

Without ``--model`` it builds the bundled tiny Qwen2-VL checkpoint. It starts the real SGLang
server on the ``unicache_cpu`` platform, runs one conversation per image (each turn re-sends the
whole history, as chat clients do), and prints what the prefix cache served.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import requests

from sglang_unicache.testing.client import internal_state
from sglang_unicache.testing.images import data_url, solid_png
from sglang_unicache.testing.server import start_server

COLOURS = [
    (220, 40, 40),
    (40, 180, 60),
    (40, 80, 220),
    (230, 200, 40),
    (160, 60, 200),
    (240, 140, 30),
    (30, 200, 200),
    (120, 120, 120),
]
QUESTIONS = [
    "What colour is the picture?",
    "Is there a shape in it?",
    "Describe it briefly.",
    "What is at the top left?",
    "How many objects are there?",
]

IMAGE_TOKENS = 64  # a 224 px image: (224 / 28) ** 2 merged visual tokens


def step(message: str) -> None:
    print(f"[demo] {message}", flush=True)


def run_conversations(url: str, n_images: int, turns: int) -> list[dict]:
    rows = []
    for i in range(n_images):
        image = {"type": "image_url", "image_url": {"url": data_url(solid_png(COLOURS[i % 8]))}}
        messages = []
        for turn in range(turns):
            question = QUESTIONS[turn % len(QUESTIONS)]
            content = [image, {"type": "text", "text": question}] if turn == 0 else question
            messages.append({"role": "user", "content": content})
            start = time.perf_counter()
            out = requests.post(
                f"{url}/v1/chat/completions",
                timeout=120,
                json={
                    "model": "default",
                    "messages": messages,
                    "max_tokens": 8,
                    "temperature": 0,
                },
            ).json()
            elapsed = time.perf_counter() - start
            answer = out["choices"][0]["message"]["content"]
            messages.append({"role": "assistant", "content": answer})
            usage = out["usage"]
            details = usage.get("prompt_tokens_details") or {}
            rows.append(
                {
                    "image": i,
                    "turn": turn + 1,
                    "prompt": usage["prompt_tokens"],
                    "image_tokens": details.get("image_tokens", 0),
                    "cached": details.get("cached_tokens", 0),
                    "seconds": elapsed,
                }
            )
            step(
                f"image {i + 1}/{n_images} turn {turn + 1}/{turns}: "
                f"{usage['prompt_tokens']} prompt tokens, {rows[-1]['cached']} from cache"
            )
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"\n{'image':>5} {'turn':>4} {'prompt':>6} {'image KV':>9} {'cached':>6} {'s':>6}")
    for r in rows:
        print(
            f"{r['image']:>5} {r['turn']:>4} {r['prompt']:>6} {r['image_tokens']:>9} "
            f"{r['cached']:>6} {r['seconds']:>6.2f}"
        )
    prompt = sum(r["prompt"] for r in rows)
    cached = sum(r["cached"] for r in rows)
    print(
        f"\n{len(rows)} requests, {prompt} prompt tokens, {cached} served from the prefix cache "
        f"({100 * cached / max(prompt, 1):.0f}%), {sum(r['seconds'] for r in rows):.1f} s"
    )


def print_savings(stats: dict, n_images: int, image_tokens: int) -> None:
    compressed = stats["images_compressed"]
    kept = image_tokens - stats["slots_freed"] // compressed if compressed else image_tokens
    print(f"\nvisual KV slots per cached image: {kept} with --unicache vs {image_tokens} without "
          f"({kept / image_tokens:.2f}x; {n_images} images: {n_images * kept} vs "
          f"{n_images * image_tokens} slots)")
    print(f"images compressed: {compressed}, slots freed: {stats['slots_freed']}, "
          f"compressed spans reused by later turns: {stats['spans_reused']} "
          f"(no vision encoder, no image prefill), fallbacks to full KV: {stats['fallbacks']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory (default: build the tiny one)")
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--keep-ratio", default="0.1")
    parser.add_argument("--log", default="runs/demo-server.log")
    parser.add_argument("server_args", nargs="*", help="extra flags for the server, after --")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp())
    model = args.model
    if model is None:
        from sglang_unicache.testing.tiny_vlm import build_tiny_qwen2_vl

        step("building the tiny Qwen2-VL checkpoint (random weights: answers are gibberish)")
        model = build_tiny_qwen2_vl(work / "tiny-qwen2-vl")
    # A random model's attention trips the KL self-check at any real compression, which would
    # keep every image at full size; the demo shows the compression path itself.
    config = work / "demo-policy.yaml"
    config.write_text("selfcheck: false\n")
    flags = ["--unicache", "--unicache-keep-ratio", args.keep_ratio, "--unicache-config",
             str(config), "--enable-cache-report", *args.server_args]
    step(f"starting the SGLang server on CPU with {' '.join(flags)} (log: {args.log})")
    start = time.perf_counter()
    server = start_server(model, flags, args.log)
    step(f"server ready in {time.perf_counter() - start:.0f} s")
    try:
        rows = run_conversations(server.url, args.images, args.turns)
        stats = internal_state(server)["unicache"]
    finally:
        server.stop()
    print_table(rows)
    print_savings(stats, args.images, IMAGE_TOKENS)


if __name__ == "__main__":
    main()
