"""Is the model's counting sensitive to dropped background?

Plain transformers, no SGLang. For each test image the prompt prefix (chat template up to the last
image token) is prefilled once with full attention, as the server does before it compresses;
then a set of background (empty-cell) visual tokens is removed from every layer's KV cache, and
each question is prefilled and greedily decoded on what is left, at the positions it would have
with the whole image (the server's M-RoPE delta keeps them the same). Dropped tokens are gone
from the softmax, so the attention mass they held moves onto what is kept: the failure mode
seen on a held-out model (over-counting when background is evicted).

Conditions (the dropped set is drawn once per image and condition, seeded, and shared by all its
questions, like one compressed span):

- ``full``: nothing dropped (checked against ``generate`` on the first ``--verify`` items);
- ``bg F``: a fraction F of the image's empty cells, anywhere;
- ``bg-out F``: F of the empty cells outside the question's region (``VQAItem.region``, grid
  task only): background the question does not ask about;
- ``bg-in F``: F of the empty cells inside the question's region (grid task only).

Prints accuracy per question type (rows) and condition (columns), and for counting questions the
mean signed error (answer - truth: > 0 is over-counting); writes everything as JSON.

    python -m benchmarks.quality.background_sensitivity \\
        --model assets/checkpoints/tiny-grid-qwen2-vl --images 50 \\
        --out runs/background-sensitivity-grid.json
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.quality.vqa_data import NUMBERS, VQAItem, default_qtypes, make_split

COUNT_QTYPES = ("count_row", "empty_row", "count_all", "count_colour")


def checkpoint_args(model: str) -> dict:
    path = Path(model) / "training_args.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def number_of(word: str) -> int | None:
    word = word.strip()
    if word in NUMBERS:
        return NUMBERS.index(word)
    return int(word) if word.isdigit() else None


class Runner:
    """Prefill an image prefix once, then answer questions on a KV cache with cells removed."""

    def __init__(self, model_dir: str):
        from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

        self.processor = AutoProcessor.from_pretrained(model_dir)
        self.model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir,
                                                                     dtype=torch.float32)
        self.model.eval()
        self.tok = self.processor.tokenizer
        self.image_token = self.model.config.image_token_id
        self.eos = self.tok.convert_tokens_to_ids("<|im_end|>")

    def inputs(self, item: VQAItem) -> dict:
        messages = [{"role": "user", "content": [{"type": "image"},
                                                 {"type": "text", "text": item.question}]}]
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=False)
        return self.processor(text=[text], images=[item.image], return_tensors="pt")

    @torch.no_grad()
    def prefix(self, item: VQAItem) -> dict:
        """The full-attention KV of the prompt up to the last image token (shared by every
        question about ``item.image``: the question comes after it)."""
        inp = self.inputs(item)
        ids = inp["input_ids"]
        image_pos = (ids[0] == self.image_token).nonzero().flatten()
        end = int(image_pos[-1]) + 1
        out = self.model(input_ids=ids[:, :end], pixel_values=inp["pixel_values"],
                         image_grid_thw=inp["image_grid_thw"],
                         mm_token_type_ids=inp["mm_token_type_ids"][:, :end],
                         position_ids=self.positions(inp)[:, :, :end], use_cache=True)
        return {"cache": out.past_key_values, "end": end, "image_pos": image_pos.tolist(),
                "prefix_ids": ids[0, :end].tolist()}

    def positions(self, inp: dict) -> torch.Tensor:
        pos, _ = self.model.model.get_rope_index(
            inp["input_ids"], mm_token_type_ids=inp["mm_token_type_ids"],
            image_grid_thw=inp["image_grid_thw"],
            attention_mask=torch.ones_like(inp["input_ids"]))
        return pos

    @torch.no_grad()
    def answer(self, item: VQAItem, prefix: dict, drop_cells: set[int],
               max_new_tokens: int) -> str:
        """Greedy answer with the image tokens of ``drop_cells`` (row-major cell indices) gone
        from the KV cache of every layer."""
        inp = self.inputs(item)
        ids, end = inp["input_ids"], prefix["end"]
        if ids[0, :end].tolist() != prefix["prefix_ids"]:
            raise ValueError("the question changed the prompt prefix")
        pos = self.positions(inp)
        cache = copy.deepcopy(prefix["cache"])
        if drop_cells:
            gone = {prefix["image_pos"][c] for c in drop_cells}
            keep = torch.tensor([i for i in range(end) if i not in gone])
            for layer in cache.layers:
                layer.keys = layer.keys[:, :, keep]
                layer.values = layer.values[:, :, keep]
        new_ids = ids[:, end:]
        new_pos = pos[:, :, end:]
        out_ids: list[int] = []
        for _ in range(max_new_tokens):
            out = self.model(input_ids=new_ids, position_ids=new_pos, past_key_values=cache,
                             use_cache=True)
            cache = out.past_key_values
            nxt = int(out.logits[0, -1].argmax())
            if nxt == self.eos:
                break
            out_ids.append(nxt)
            new_ids = torch.tensor([[nxt]])
            new_pos = new_pos[:, :, -1:] + 1
        return self.tok.decode(out_ids, skip_special_tokens=True).strip()


def empty_cells(item: VQAItem) -> list[int]:
    g = item.scene.grid
    full = {o.row * g + o.col for o in item.scene.objects}
    return [k for k in range(g * g) if k not in full]


def drop_set(item: VQAItem, kind: str, fraction: float, seed: int) -> set[int]:
    """Cells to drop for one (image, condition); ``bg-in``/``bg-out`` depend on the question's
    region, ``bg`` is one set per image."""
    empty = empty_cells(item)
    region = set(item.region)
    if kind == "bg-out":
        pool = [k for k in empty if k not in region]
    elif kind == "bg-in":
        pool = [k for k in empty if k in region]
    else:
        pool = empty
    rng = random.Random(f"{item.image_id}/{kind}/{fraction}/{seed}"
                        + (f"/{item.question_index}" if kind != "bg" else ""))
    return set(rng.sample(pool, round(fraction * len(pool))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="assets/checkpoints/tiny-grid-qwen2-vl")
    p.add_argument("--task", default=None, help="default: the checkpoint's training task")
    p.add_argument("--grid", type=int, default=None, help="default: the checkpoint's grid")
    p.add_argument("--images", type=int, default=50)
    p.add_argument("--questions", type=int, default=5, help="per image")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fractions", default="0.25,0.5,1.0",
                   help="shares of the empty cells dropped (anywhere)")
    p.add_argument("--region-fractions", default="0.5,1.0",
                   help="shares dropped outside / inside the question's region (grid task)")
    p.add_argument("--verify", type=int, default=5,
                   help="check the full-cache path against generate() on this many items")
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="runs/background-sensitivity.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    trained = checkpoint_args(args.model)
    task = args.task or trained.get("task", "vqa")
    grid = args.grid or int(trained.get("grid", 16))
    items = make_split("test", args.images, args.questions, seed=args.seed, grid=grid,
                       qtypes=default_qtypes(task), task=task)
    conditions = [("full", 0.0)] + [("bg", float(f)) for f in args.fractions.split(",") if f]
    if task == "grid":
        for kind in ("bg-out", "bg-in"):
            conditions += [(kind, float(f)) for f in args.region_fractions.split(",") if f]
    names = ["full" if k == "full" else f"{k} {f:g}" for k, f in conditions]

    start = time.perf_counter()
    runner = Runner(args.model)
    if args.verify:
        from benchmarks.quality.hf_reference import hf_answers

        ref = hf_answers(args.model, items[:args.verify], max_new_tokens=args.max_new_tokens)
    rows = []
    by_image: dict[str, list[VQAItem]] = {}
    for it in items:
        by_image.setdefault(it.image_id, []).append(it)
    for group in by_image.values():
        prefix = runner.prefix(group[0])
        for it in group:
            row = {"image": it.image_id, "qtype": it.qtype, "question": it.question,
                   "answer": it.answer, "got": {}, "dropped": {}}
            for (kind, frac), name in zip(conditions, names, strict=True):
                cells = set() if kind == "full" else drop_set(it, kind, frac, args.seed)
                row["got"][name] = runner.answer(it, prefix, cells, args.max_new_tokens)
                row["dropped"][name] = len(cells)
            rows.append(row)
    if args.verify:
        mismatch = [(r["question"], r["got"]["full"], a)
                    for r, a in zip(rows, ref, strict=False) if r["got"]["full"] != a]
        if mismatch:
            print(f"warning: the full-cache path differs from generate(): {mismatch}",
                  file=sys.stderr)

    table: dict[str, dict[str, dict]] = defaultdict(dict)
    qtypes = sorted({r["qtype"] for r in rows}) + ["overall"]
    for name in names:
        for q in qtypes:
            sel = [r for r in rows if q in ("overall", r["qtype"])]
            # A condition with nothing to drop for an item (e.g. no empty cell in its region)
            # leaves that item out of the condition's column.
            if name != "full":
                sel = [r for r in sel if r["dropped"][name] > 0]
            cell = {"n": len(sel),
                    "accuracy": sum(r["got"][name] == r["answer"] for r in sel) / max(1, len(sel)),
                    "full_accuracy": sum(r["got"]["full"] == r["answer"] for r in sel)
                    / max(1, len(sel))}
            if q in COUNT_QTYPES:
                errs = [number_of(r["got"][name]) - number_of(r["answer"]) for r in sel
                        if number_of(r["got"][name]) is not None]
                cell["mean_signed_error"] = sum(errs) / max(1, len(errs))
                cell["over_share"] = sum(e > 0 for e in errs) / max(1, len(errs))
            table[name][q] = cell

    print(f"model {args.model}, task {task}, grid {grid}, {len(by_image)} images, "
          f"{len(rows)} questions ({time.perf_counter() - start:.0f} s)")
    print("accuracy % (n) per condition; counts: mean signed error (answer - truth)")
    print("| qtype | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for q in qtypes:
        cells = []
        for name in names:
            c = table[name][q]
            if not c["n"]:
                cells.append("-")
                continue
            text = f"{100 * c['accuracy']:.1f} ({c['n']})"
            if "mean_signed_error" in c:
                text += f" {c['mean_signed_error']:+.2f}"
            cells.append(text)
        print(f"| {q} | " + " | ".join(cells) + " |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "model": args.model, "task": task, "grid": grid, "images": len(by_image),
        "questions": len(rows), "seed": args.seed, "conditions": names,
        "table": table, "items": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
