"""Where the scheduler spends ``perf.py --parts workload-large``'s run, by phase (issue 16).

Runs the multi-turn workload (``perf_workload.workload``'s draw: 24 images, Zipf 1.1, 8 clients,
3 turns, 16 output tokens, a pool of 6 uncompressed prompts) on one server, the random hidden-512,
8-layer ``WORKLOAD_MODEL``, under a py-spy sample of its scheduler (``scheduler_phases.py``), and
prints one JSON line: wall time, tokens prefilled, output tokens per second and the phase shares.

    python -m benchmarks.workload_phases stock          # or knorm, shipped; --conversations N
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import json
import random
import time
from pathlib import Path

from benchmarks import scheduler_phases
from benchmarks.perf import SHIPPED_ROW, WORKLOAD_MODEL, flags_for
from benchmarks.perf_workload import IMAGE_TOKENS, conversation, logged, picture, warmed
from tests.support.tiny_vlm import build_tiny_qwen2_vl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("server", choices=("stock", "knorm", "shipped"))
    parser.add_argument("--conversations", type=int, default=48)
    parser.add_argument("--work", default="runs/workload-phases")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    if not (model / "config.json").exists():
        build_tiny_qwen2_vl(model, **WORKLOAD_MODEL)
    config = work / "policy.json"
    config.write_text(json.dumps({"selfcheck": False}))
    flags = {"stock": flags_for(None, 0.1, config), "knorm": flags_for("knorm", 0.1, config),
             "shipped": next(iter(SHIPPED_ROW.values()))}[args.server]
    rng = random.Random(0)  # the same draw as perf_workload.workload
    picks = rng.choices(range(24), weights=[1 / (i + 1) ** 1.1 for i in range(24)],
                        k=args.conversations)
    pool = ["--max-total-tokens", str(6 * (IMAGE_TOKENS + 64))]
    with warmed(model, flags + pool, work / f"{args.server}.log") as server:
        offset = len(server.log())
        sampler = scheduler_phases.record(server, work / f"{args.server}.pyspy")
        start = time.perf_counter()
        try:
            with futures.ThreadPoolExecutor(max_workers=8) as clients:
                convs = clients.map(lambda i: conversation(server, picture(i), 3, 16), picks)
                outs = [out for conv in convs for out in conv]
        finally:
            scheduler_phases.stop(sampler)
        wall = time.perf_counter() - start
        prefilled = sum(logged(server, offset, r"Prefill batch.*?#new-token: (\d+)"))
    print(json.dumps({
        "server": args.server, "wall_s": round(wall, 1), "tokens_prefilled": prefilled,
        "prompt_tokens": sum(o["usage"]["prompt_tokens"] for o in outs),
        "output_tok_s": round(sum(o["usage"]["completion_tokens"] for o in outs) / wall, 1),
        "phases": scheduler_phases.phases(work / f"{args.server}.pyspy")}))


if __name__ == "__main__":
    main()
