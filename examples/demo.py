"""The main job: serve the bundled VLM on CPU with ``--unicache`` and run a multi-turn image chat.

    python -m examples.demo [--model PATH] [--images 4] [--turns 3] [--keep-ratio 0.1]

Run it from the repository root (``make demo`` does): it uses the server harness of
``tests/support`` and the visual-QA task of ``benchmarks/quality``, which the wheel does not ship.

It starts the real SGLang server on the ``unicache_cpu`` platform twice on the bundled checkpoint
(a tiny Qwen2-VL trained on the synthetic visual-QA task, ``assets/checkpoints``), side by side:
once without compression (``--unicache-method full``, token-identical to stock SGLang) and once
with ``--unicache``. Each runs the same conversations: one per image, the image in the first turn,
a new question every turn, the whole history re-sent each time (as chat clients do), so turns
2..N reuse the cached image. The compressing server runs the shipped defaults (the self-check and
its escalation included, no config file). It prints the answers, whether they are right, what the
cache held, and how many images were compressed, escalated or kept at full KV, and why.
"""

from __future__ import annotations

import argparse
import io
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from benchmarks.quality.vqa_data import make_split
from tests.support.client import available_slots, flush_cache, internal_state
from tests.support.images import data_url
from tests.support.server import start_server

BUNDLED = Path(__file__).resolve().parents[1] / "assets" / "checkpoints" / "tiny-vqa-qwen2-vl"
QTYPES = ("colour_of_shape", "shape_of_colour", "count_colour", "count_all", "same_colour")


def step(message: str) -> None:
    print(f"[demo] {message}", flush=True)


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def conversations(images: int, turns: int, grid: int) -> list[list]:
    items = make_split("demo", images, turns, seed=0, grid=grid, qtypes=QTYPES)
    chats: dict[str, list] = {}
    for item in items:
        chats.setdefault(item.image_id, []).append(item)
    return list(chats.values())


def run(url: str, chats: list[list], label: str) -> list[dict]:
    rows = []
    for i, chat in enumerate(chats):
        image = {"type": "image_url", "image_url": {"url": data_url(png(chat[0].image))}}
        messages = []
        for turn, item in enumerate(chat):
            content = [image, {"type": "text", "text": item.question}] if turn == 0 \
                else item.question
            messages.append({"role": "user", "content": content})
            out = requests.post(f"{url}/v1/chat/completions", timeout=120, json={
                "model": "default", "messages": messages, "max_tokens": 8, "temperature": 0,
            }).json()
            answer = out["choices"][0]["message"]["content"].strip()
            messages.append({"role": "assistant", "content": answer})
            usage = out["usage"]
            rows.append({"image": i + 1, "turn": turn + 1, "question": item.question,
                         "expected": item.answer, "answer": answer,
                         "correct": answer == item.answer, "prompt": usage["prompt_tokens"],
                         "cached": (usage.get("prompt_tokens_details") or {})
                         .get("cached_tokens", 0)})
        step(f"{label}: image {i + 1} of {len(chats)} done "
             f"({sum(r['correct'] for r in rows if r['image'] == i + 1)}/{len(chat)} right)")
    return rows


def serve(model: Path, flags: list[str], log: Path, chats: list[list], label: str) -> dict:
    step(f"starting SGLang on CPU: {label} ({' '.join(flags)}; log {log})")
    start = time.perf_counter()
    server = start_server(model, flags, log)
    step(f"{label}: server ready in {time.perf_counter() - start:.0f} s")
    try:
        flush_cache(server)
        free = available_slots(server)
        rows = run(server.url, chats, label)
        held = free - available_slots(server)  # what the tree keeps of all conversations
        stats = internal_state(server).get("unicache", {})
    finally:
        server.stop()
    return {"rows": rows, "held": held, "stats": stats}


def report(full: dict, compressed: dict, keep: str, image_tokens: int) -> None:
    print(f"\n{'img':>3} {'turn':>4}  {'question':<45} {'expected':<9} {'full':<9} "
          f"{'unicache':<9}")
    for a, b in zip(full["rows"], compressed["rows"], strict=True):
        mark = lambda r: f"{r['answer'][:8]:<8}{'+' if r['correct'] else '-'}"  # noqa: E731
        print(f"{a['image']:>3} {a['turn']:>4}  {a['question'][:45]:<45} {a['expected'][:9]:<9} "
              f"{mark(a)} {mark(b)}")
    n = len(full["rows"])
    stats = compressed["stats"]
    cfg = stats["config"]
    print(f"\neffective config (with --unicache): method {cfg['method']}, keep_ratio "
          f"{cfg['keep_ratio']}, self-check {cfg['selfcheck_statistic']} <= "
          f"{cfg['selfcheck_threshold']} and content_lost <= "
          f"{cfg['selfcheck_content_threshold']} (on: {cfg['selfcheck']}), escalating up to keep "
          f"{cfg['escalate_max_keep']}, a request's own view up to keep "
          f"{cfg['view_max_keep'] or cfg['escalate_max_keep']}; every key: docs/configuration.md")
    images = len({r["image"] for r in full["rows"]})
    recalled = stats.get("spans_recalled", 0)
    done = stats["images_compressed"] - recalled  # a recalled turn compresses its own view too
    per_image = stats["compressed_slots_held"] / max(done, 1)
    print(f"\nanswers correct: {sum(r['correct'] for r in compressed['rows'])}/{n} with "
          f"--unicache (keep {keep}) vs {sum(r['correct'] for r in full['rows'])}/{n} "
          "without compression")
    print(f"images compressed: {done} of {images}; self-check escalations: "
          f"{stats['escalations']}; fallbacks to full KV: {stats['fallbacks']}")
    for check in stats.get("recent_checks", []):
        if not check["passed"]:
            print(f"  fallback: {check['statistic']} {check['value']:.3f} > "
                  f"{check['threshold']:.3f} even at keep {check['keep_ratio']:.2f}")
    print(f"visual KV slots per cached image: {per_image:.0f} with --unicache vs {image_tokens} "
          f"without ({per_image / image_tokens:.2f}x, escalations included)")
    if stats.get("host_copies"):
        print(f"host memory: {stats['host_copies']} full images, "
              f"{stats['host_copy_bytes'] / stats['host_copies'] / 1024:.1f} KiB each (int8 rows "
              "per token and KV head, for later questions)")
    print(f"KV slots the cache holds after all conversations: {compressed['held']} vs "
          f"{full['held']} ({compressed['held'] / max(full['held'], 1):.2f}x)")
    print(f"later turns served from the cache: {stats['spans_reused'] + recalled} (no vision "
          f"encoder, no image prefill): {recalled} prefilled over the full image from its host "
          f"copy ({stats.get('recall_bytes', 0) / max(recalled, 1) / 1024:.1f} KiB each) and "
          f"decoded on their own compressed view, {stats['spans_reused']} on the shared "
          "compressed span")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=BUNDLED, help="checkpoint directory")
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--keep-ratio", default="0.1")
    parser.add_argument("--method", default="unicache")
    parser.add_argument("--log-dir", type=Path, default=Path("runs"))
    parser.add_argument("server_args", nargs="*", help="extra flags for the server, after --")
    args = parser.parse_args()

    args_file = args.model / "training_args.json"
    grid = json.loads(args_file.read_text())["grid"] if args_file.exists() else 8
    chats = conversations(args.images, args.turns, grid)
    common = ["--enable-cache-report", *args.server_args]
    args.log_dir.mkdir(parents=True, exist_ok=True)
    # Both servers at once: each start is mostly one core's imports.
    with ThreadPoolExecutor(2) as pool:
        full = pool.submit(serve, args.model, ["--unicache", "--unicache-method", "full", *common],
                           args.log_dir / "demo-full.log", chats, "without compression")
        compressed = pool.submit(serve, args.model,
                                 ["--unicache", "--unicache-method", args.method,
                                  "--unicache-keep-ratio", args.keep_ratio, *common],
                                 args.log_dir / "demo-unicache.log", chats, "with --unicache")
        full, compressed = full.result(), compressed.result()
    report(full, compressed, args.keep_ratio, grid * grid)


if __name__ == "__main__":
    main()
