"""Quality through the real serving path: accuracy vs keep ratio for every method.

Starts the SGLang server on the CPU with the plugin for each (method, keep ratio), sends the
synthetic visual-QA test split through ``/v1/chat/completions`` at temperature 0, and scores exact
answers. Two settings (DESIGN.md §6):

- ``reuse`` (the headline): per image, question 1 warms the cache and compresses the image;
  questions 2..N are scored while they reuse the cached compressed span (the script checks the
  server's reuse counter).
- ``long``: first requests whose answers take several tokens, scored on the whole answer, so
  compression during decoding shows.

Images use the checkpoint's grid (``grid`` in ``<model>/training_args.json``, else 16; ``--grid``
overrides). ``--task`` picks the question set (default: the checkpoint's ``task``, else ``vqa``,
the bundled task): ``grid`` is the second task (``vqa_data``: positional and background
questions; each question of an image is about a different row, so the later questions of the
reuse setting look at other regions than the one that compressed the image; its long setting
asks "Which colours are in row R?").

``--transformers-check N`` first answers the first N scored items of each setting with the same
checkpoint through plain transformers (:mod:`benchmarks.quality.hf_reference`) and
stores them as method ``transformers`` (keep ratio 1.0), to compare with the server's ``full``.
Every setting's score also lists ``correct`` per item, in item order, so the two can be compared
on the same items (``benchmarks/quality/report.py`` does).

    python -m benchmarks.quality.eval_serving --model runs/tiny-vqa-qwen2-vl \\
        --methods full,random,knorm,snapkv,unicache --ratios 0.1 --images 40 --out runs/q.json \\
        --transformers-check 40
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from benchmarks.quality.vqa_data import (
    DEFAULT_QTYPES,
    GRID_LONG_ANSWER_QTYPES,
    GRID_QTYPES,
    LONG_ANSWER_QTYPES,
    TASKS,
    make_split,
)
from tests.support.client import answer, chat, flush_cache, internal_state
from tests.support.images import data_url
from tests.support.server import start_server

# Every default question type, long answers included (scored on the whole answer).
REUSE_QTYPES = DEFAULT_QTYPES
GRID_REUSE_QTYPES = GRID_QTYPES  # the grid task: every type, one row per question
MAX_TOKENS = 16  # enough for the longest answer (six colours) and <|im_end|>


def png_of(image) -> bytes:
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def ask(server, item, max_tokens: int) -> str:
    body = {"model": "default", "temperature": 0, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url(png_of(item.image))}},
                {"type": "text", "text": item.question}]}]}
    return answer(chat(server, body)).strip()


def score(rows: list[dict]) -> dict:
    by_type = defaultdict(list)
    for row in rows:
        by_type[row["qtype"]].append(row["correct"])
    overall = [r["correct"] for r in rows]
    return {"accuracy": sum(overall) / max(len(overall), 1), "n": len(overall),
            "by_type": {k: sum(v) / len(v) for k, v in sorted(by_type.items())},
            "correct": [int(c) for c in overall]}


def checkpoint_grid(model: str) -> int:
    """``grid`` the checkpoint was trained with (``training_args.json``), else 16."""
    path = Path(model) / "training_args.json"
    if path.is_file():
        grid = json.loads(path.read_text()).get("grid")
        if grid:
            return int(grid)
    return 16


def checkpoint_task(model: str) -> str:
    """``task`` the checkpoint was trained on (``training_args.json``), else ``vqa``."""
    path = Path(model) / "training_args.json"
    if path.is_file():
        return json.loads(path.read_text()).get("task") or "vqa"
    return "vqa"


def reuse_items(images: int, questions: int, seed: int, grid: int, task: str = "vqa") -> list:
    qtypes = GRID_REUSE_QTYPES if task == "grid" else REUSE_QTYPES
    return make_split("test", images, questions, seed=seed, grid=grid, qtypes=qtypes, task=task)


def long_items(images: int, seed: int, grid: int, task: str = "vqa") -> list:
    qtypes = GRID_LONG_ANSWER_QTYPES if task == "grid" else LONG_ANSWER_QTYPES[::2]
    return make_split("test", images, 1, seed=seed + 1, grid=grid, qtypes=qtypes, task=task)


def last_check(state: dict) -> dict:
    """The most recent self-check record in a server's ``unicache`` state (``recent_checks``),
    or {}."""
    return (state.get("recent_checks") or [{}])[-1]


def last_rid(server) -> str | None:
    """The request id of the server's most recent self-check record."""
    return last_check(internal_state(server).get("unicache", {})).get("rid")


def check_since(state: dict, rid: str | None) -> dict | None:
    """The most recent self-check record of ``state`` if a request made it after the one with
    id ``rid`` (the request just sent); None when it made none."""
    check = last_check(state)
    return check if check.get("rid") not in (None, rid) else None


def run_reuse_warm_all(server, groups: dict[str, list]) -> tuple[dict, int, list[dict]]:
    """``--reuse-order warm-all``: question 1 of every image first, then the later questions of
    each image, so with a small pool and HiCache most of them reuse a span loaded back from host
    memory (``stats.spans_loaded_back`` counts them)."""
    flush_cache(server)
    for group in groups.values():
        ask(server, group[0], MAX_TOKENS)
    before = internal_state(server).get("unicache", {}).get("spans_reused", 0)
    rows, per_image = [], []
    for group in groups.values():
        correct = []
        for item in group[1:]:
            got = ask(server, item, MAX_TOKENS)
            correct.append(int(got == item.answer))
            rows.append({"qtype": item.qtype, "correct": got == item.answer})
        per_image.append({"image": group[0].image_id, "check": None, "correct": correct})
    reused = internal_state(server).get("unicache", {}).get("spans_reused", 0) - before
    return score(rows), reused, per_image


def run_reuse(server, images: int, questions: int, seed: int,
              grid: int, task: str = "vqa", order: str = "grouped") -> tuple[dict, int, list[dict]]:
    """The reuse score, the spans reused, and per image the warming request's self-check (its
    last ``recent_checks`` entry, or None) with the correctness of the questions that reused it."""
    items = reuse_items(images, questions, seed, grid, task)
    rows, reused, per_image = [], 0, []
    groups: dict[str, list] = {}
    for item in items:
        groups.setdefault(item.image_id, []).append(item)
    if order == "warm-all":
        return run_reuse_warm_all(server, groups)
    for group in groups.values():
        flush_cache(server)
        last = last_rid(server)
        ask(server, group[0], MAX_TOKENS)  # warms the cache: compresses the image
        state = internal_state(server).get("unicache", {})
        check = check_since(state, last)
        before = state.get("spans_reused", 0) + state.get("spans_recalled", 0)
        correct, later_checks = [], []
        for item in group[1:]:
            seen = last_rid(server)
            got = ask(server, item, MAX_TOKENS)
            correct.append(int(got == item.answer))
            rows.append({"qtype": item.qtype, "correct": got == item.answer})
            # a recalled question's own view, if it made one
            later_checks.append(check_since(internal_state(server).get("unicache", {}), seen))
        after = internal_state(server).get("unicache", {})
        reused += after.get("spans_reused", 0) + after.get("spans_recalled", 0) - before
        per_image.append({"image": group[0].image_id, "check": check, "correct": correct,
                          "later_checks": later_checks,
                          "slots": state.get("compressed_slots_held", 0),
                          "slots_at_rest": after.get("compressed_slots_held", 0),
                          "recalled": after.get("spans_recalled", 0)
                          - state.get("spans_recalled", 0)})
    return score(rows), reused, per_image


def held_summary(per_image: list[dict], image_tokens: int) -> dict:
    """Share of images compressed and mean KV slots each holds in the tree after its first
    question (an image kept at full KV holds all its tokens; escalated ones hold their larger
    K), and after all its questions (``at_rest``: with recall each later question adds its own
    compressed view, which carries that chat's history)."""
    slots = [im["slots"] or image_tokens for im in per_image]
    rest = [im.get("slots_at_rest") or image_tokens for im in per_image]
    return {"compressed_share": sum(bool(im["slots"]) for im in per_image) / len(per_image),
            "mean_slots": sum(slots) / len(slots),
            "mean_slots_ratio": sum(slots) / len(slots) / image_tokens,
            "mean_slots_at_rest_ratio": sum(rest) / len(rest) / image_tokens,
            "recalled": sum(im.get("recalled", 0) for im in per_image)}


def run_long(server, images: int, seed: int, grid: int, task: str = "vqa") -> dict:
    """The long score; with ``checks``, per item (in item order) the request's own self-check
    record (None when it made none): what ``benchmarks.quality.own_view_study`` reads."""
    items = long_items(images, seed, grid, task)
    rows, checks = [], []
    for item in items:
        flush_cache(server)
        before = last_rid(server)
        rows.append({"qtype": item.qtype, "correct": ask(server, item, MAX_TOKENS) == item.answer})
        checks.append(check_since(internal_state(server).get("unicache", {}), before))
    return {**score(rows), "checks": checks}


def run_transformers(args, settings: list[str], method: str = "full", ratio: float = 1.0,
                     policy: dict | None = None) -> dict:
    """The ``transformers`` entry: the first ``args.transformers_check`` scored items of each
    setting, answered by the checkpoint through transformers with the server's token limits.
    With a method other than ``full``, only the ``long`` setting (each question its own first
    request) and through ``sglang_unicache.adapters.transformers``: entry
    ``transformers-<method>``."""
    from benchmarks.quality.hf_reference import hf_answers
    from sglang_unicache.policy.config import UniCacheConfig

    n = args.transformers_check
    start = time.perf_counter()
    press = None
    if method != "full":
        press = UniCacheConfig.from_mapping({**(policy or {}), "method": method,
                                             "keep_ratio": ratio})
    entry = {"method": "transformers" if press is None else f"transformers-{method}",
             "keep_ratio": ratio, "items_per_setting": n, "task": args.task}
    jobs = []
    if "reuse" in settings and press is None:
        scored = [it for it in reuse_items(args.images, args.questions, args.seed, args.grid,
                                           args.task)
                  if it.question_index >= 1]
        jobs.append(("reuse", scored[:n], MAX_TOKENS))
    if "long" in settings:
        jobs.append(("long", long_items(args.images, args.seed, args.grid, args.task)[:n],
                     MAX_TOKENS))
    for setting, items, max_tokens in jobs:
        answers = hf_answers(args.model, items, max_new_tokens=max_tokens, press=press)
        entry[setting] = score([{"qtype": it.qtype, "correct": got == it.answer}
                                for it, got in zip(items, answers, strict=True)])
    entry["seconds"] = round(time.perf_counter() - start, 1)
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--methods", default="full,random,knorm,h2o,snapkv,pyramidkv,aircache,"
                                             "unicache")
    parser.add_argument("--ratios", default="0.01,0.05,0.1,0.25,0.5")
    parser.add_argument("--settings", default="reuse,long")
    parser.add_argument("--images", type=int, default=40)
    parser.add_argument("--questions", type=int, default=5, help="per image (reuse setting)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--grid", type=int, default=None,
                        help="cells per side of the test images (default: the checkpoint's "
                             "training_args.json grid, else 16)")
    parser.add_argument("--task", choices=TASKS, default=None,
                        help="question set: vqa (the bundled task) or grid (the second "
                             "task); default: the checkpoint's training_args.json task, else vqa")
    parser.add_argument("--transformers-check", type=int, default=0, metavar="N",
                        help="before serving, score the first N scored items of each setting "
                             "with transformers (method 'transformers'); 0 skips it")
    parser.add_argument("--transformers-methods", default="", metavar="M1,M2",
                        help="with --transformers-check: also answer the long setting through "
                             "sglang_unicache.adapters.transformers with each method at each "
                             "ratio (the same policy config as the servers), entries "
                             "'transformers-<method>'")
    parser.add_argument("--selfcheck", choices=("off", "on", "record"), default="off",
                        help="off: score the method itself; on: the shipped self-check (and its "
                             "escalation); record: compute every self-check statistic but never "
                             "act on it (per-image records under 'images', docs/selfcheck.md)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra policy config (YAML values), e.g. query_weight=1.0")
    parser.add_argument("--label", default="",
                        help="suffix of the method names in the results (for --set variants)")
    parser.add_argument("--server-arg", action="append", default=[], metavar="FLAG",
                        help="extra SGLang server flag, e.g. --server-arg=--kv-cache-dtype "
                             "--server-arg=fp8_e4m3 (recorded in the results)")
    parser.add_argument("--reuse-order", choices=("grouped", "warm-all"), default="grouped",
                        help="grouped: each image's questions together, the cache flushed "
                             "between images; warm-all: question 1 of every image first, then "
                             "the rest (with a small pool and HiCache: spans from host memory)")
    parser.add_argument("--out", default="runs/quality.json")
    args = parser.parse_args()
    if args.grid is None:
        args.grid = checkpoint_grid(args.model)
    if args.task is None:
        args.task = checkpoint_task(args.model)
    print(f"test images: grid {args.grid} ({args.grid * 28} px, {args.grid ** 2} visual tokens), "
          f"task {args.task}", flush=True)

    config = Path(tempfile.mkdtemp()) / "policy.json"
    import yaml

    extra = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in args.set)}
    check = {"off": {"selfcheck": False}, "on": {},
             "record": {"selfcheck_threshold": 1e30, "selfcheck_content_threshold": 1.0,
                        "escalate_max_keep": 1e-9, "selfcheck_all_statistics": True}
             }[args.selfcheck]
    config.write_text(json.dumps({**check, **extra}))
    settings = args.settings.split(",")
    results = []

    def save() -> None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))

    if args.transformers_check > 0:
        entry = run_transformers(args, settings)
        results.append(entry)
        print(json.dumps({k: ({s: v for s, v in val.items() if s != "correct"}
                              if isinstance(val, dict) else val) for k, val in entry.items()}),
              flush=True)
        save()
        for method in filter(None, args.transformers_methods.split(",")):
            for ratio in args.ratios.split(","):
                results.append(run_transformers(args, ["long"], method, float(ratio),
                                                {**check, **extra}))
                print(json.dumps({k: v for k, v in results[-1].items() if k != "long"}
                                 | {"long": results[-1]["long"]["accuracy"]}), flush=True)
                save()
    for method in filter(None, args.methods.split(",")):
        ratios = ["1.0"] if method == "full" else args.ratios.split(",")
        for ratio in ratios:
            flags = ["--unicache", "--unicache-method", method, "--unicache-keep-ratio", ratio,
                     "--unicache-config", str(config), "--enable-cache-report",
                     *args.server_arg]
            start = time.perf_counter()
            server = start_server(args.model, flags,
                                  f"runs/quality-{method}{args.label}-{ratio}.log")
            try:
                entry = {"method": method + args.label, "keep_ratio": float(ratio),
                         "config": extra, "selfcheck": args.selfcheck, "task": args.task,
                         "server_args": args.server_arg}
                if "reuse" in settings:
                    entry["reuse"], entry["spans_reused"], entry["images"] = run_reuse(
                        server, args.images, args.questions, args.seed, args.grid, args.task,
                        args.reuse_order)
                    entry["reuse_order"] = args.reuse_order
                    if args.reuse_order == "grouped":
                        entry["held"] = held_summary(entry["images"], args.grid ** 2)
                if "long" in settings:
                    entry["long"] = run_long(server, args.images, args.seed, args.grid,
                                             args.task)
                entry["stats"] = internal_state(server).get("unicache", {})
            finally:
                server.stop()
            entry["seconds"] = round(time.perf_counter() - start, 1)
            results.append(entry)
            print(json.dumps({k: ({s: v for s, v in val.items() if s not in ("correct", "checks")}
                                  if k in ("reuse", "long") else val)
                              for k, val in entry.items() if k not in ("stats", "images")}),
                  flush=True)
            save()


if __name__ == "__main__":
    main()
