"""First answer tokens of later questions with recall, against stock SGLang on the same items.

For each image of the reuse setting (``eval_serving.reuse_items``), question 1 warms the cache
(and, with the plugin, compresses the image and keeps its host copy); each later question is
asked for one token. With recall the later question is prefilled over the image's full KV
loaded back from host memory, so with exact copies its first token is stock's; with int8 copies
this measures how often it still is. Prints one JSON line per server and writes them to
``--out``.

    python -m benchmarks.quality.recall_agreement --model assets/checkpoints/tiny-grid-qwen2-vl \\
        --images 16 --questions 4 --out runs/recall-agreement-grid.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.quality.eval_serving import ask, checkpoint_grid, checkpoint_task, reuse_items
from tests.support.client import flush_cache, internal_state
from tests.support.server import start_server

SERVERS = {
    "stock": ["--enable-cache-report"],
    "unicache keep 0.1, exact host copies": ["--unicache", "--unicache-host-copies", "exact",
                                             "--enable-cache-report"],
    "--unicache (int8 host copies, as shipped)": ["--unicache", "--enable-cache-report"],
}


def first_tokens(server, model: str, images: int, questions: int, seed: int = 0) -> list[str]:
    """The one-token answers of every later question, in item order (the cache flushed between
    images, question 1 asked in full first)."""
    groups: dict[str, list] = {}
    for item in reuse_items(images, questions, seed, checkpoint_grid(model),
                            checkpoint_task(model)):
        groups.setdefault(item.image_id, []).append(item)
    tokens = []
    for group in groups.values():
        flush_cache(server)
        ask(server, group[0], 16)
        tokens += [ask(server, item, 1) for item in group[1:]]
    return tokens


def agreement(model: str, servers: dict[str, list[str]], images: int, questions: int,
              log_dir: Path) -> list[dict]:
    """Per server: its first tokens' agreement with the first server's (stock), and the recalls
    the plugin counted."""
    rows, reference = [], None
    for i, (name, flags) in enumerate(servers.items()):
        server = start_server(Path(model), flags, log_dir / f"recall-agreement-{i}.log")
        try:
            tokens = first_tokens(server, model, images, questions)
            state = internal_state(server).get("unicache", {})
        finally:
            server.stop()
        reference = reference or tokens
        same = sum(a == b for a, b in zip(tokens, reference, strict=True))
        rows.append({"server": name, "later_questions": len(tokens), "same_first_token": same,
                     "agreement": round(same / len(tokens), 4),
                     "spans_recalled": state.get("spans_recalled", 0),
                     "images_prefilled": state.get("images_prefilled", 0)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--questions", type=int, default=4, help="per image")
    parser.add_argument("--out", default="runs/recall-agreement.json")
    args = parser.parse_args()
    rows = agreement(args.model, SERVERS, args.images, args.questions, Path("runs"))
    for row in rows:
        print(json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
