"""An offline ``sglang.Engine`` batch with images, compression on through keyword arguments.

Starts its own engine in this process (no server needed), answers one question per image, and
prints what the plugin did, from the engine's internal state (what ``/server_info`` shows):

    python examples/offline_batch.py --model CHECKPOINT --images a.png b.png
"""

from __future__ import annotations

import argparse

import sglang
from transformers import AutoTokenizer

QUESTION = "What colour is the circle?"


def prompt(model: str, question: str = QUESTION) -> str:
    tokenizer = AutoTokenizer.from_pretrained(model)
    content = [{"type": "image"}, {"type": "text", "text": question}]
    messages = [{"role": "user", "content": content}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def run(engine, model: str, images: list[str], max_new_tokens: int = 8) -> list[dict]:
    text = prompt(model)
    return engine.generate(prompt=[text] * len(images), image_data=list(images),
                           sampling_params={"max_new_tokens": max_new_tokens, "temperature": 0})


def unicache_stats(engine) -> dict:
    """The plugin's counters of the engine's scheduler (``/server_info``'s ``unicache``)."""
    return engine.get_server_info()["internal_states"][0]["unicache"]


def summary(stats: dict) -> str:
    return (f"compressed {stats['images_compressed']} image(s) at keep {stats['keep_ratio']} "
            f"({stats['method']}), {stats['slots_freed']} KV slots freed, "
            f"{stats['compressed_slots_held']} held by compressed images; self-check: "
            f"{stats['escalations']} escalation(s), {stats['fallbacks']} image request(s) kept "
            "full KV")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--images", nargs="+", required=True)
    parser.add_argument("--keep-ratio", type=float, default=0.1)
    args = parser.parse_args()
    engine = sglang.Engine(model_path=args.model, unicache=True,
                           unicache_keep_ratio=args.keep_ratio)
    try:
        for path, out in zip(args.images, run(engine, args.model, args.images), strict=True):
            print(f"{path}: {out['text']!r}")
        print(summary(unicache_stats(engine)))
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
