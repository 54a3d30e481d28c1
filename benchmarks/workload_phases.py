"""Where the scheduler spends ``perf.py --parts workload-large``'s run, by phase.

Runs the multi-turn workload (``perf_workload.workload``'s draw: 24 images, Zipf 1.1, 8 clients,
3 turns, 16 output tokens, a pool of 6 uncompressed prompts) on one server, the random hidden-512,
8-layer ``WORKLOAD_MODEL``, under a py-spy sample of its scheduler (``scheduler_phases.py``), and
prints one JSON line: wall time, tokens prefilled, output tokens per second and the phase shares.

    python -m benchmarks.workload_phases stock   # or knorm, unicache, unicache-no-copies, shipped

``unicache`` is the default method with the self-check off (host copies on, as shipped);
``unicache-no-copies`` the same with ``host_copies: off``. ``--server-args`` adds flags to the
server (``--dtype float32``: compute at native speed on a CPU without a bf16 matrix multiply).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks import scheduler_phases
from benchmarks.perf import SHIPPED_ROW, WORKLOAD_MODEL, flags_for
from benchmarks.perf_workload import converse, logged, popular_images, warmed, workload_pool
from tests.support.tiny_vlm import build_tiny_qwen2_vl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("server", choices=("stock", "knorm", "unicache", "unicache-no-copies",
                                           "shipped"))
    parser.add_argument("--conversations", type=int, default=48)
    parser.add_argument("--image-px", type=int, default=448,
                        help="image side in px (448: 256 visual tokens, 896: 1,024)")
    parser.add_argument("--server-args", default="",
                        help="flags added to the server (e.g. --dtype float32)")
    parser.add_argument("--work", default="runs/workload-phases")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = work / f"model-{args.image_px}"
    if not (model / "config.json").exists():
        build_tiny_qwen2_vl(model, **{**WORKLOAD_MODEL, "image_size": args.image_px})
    config = work / "policy.json"
    config.write_text(json.dumps({"selfcheck": False}))
    no_copies = work / "policy-no-copies.json"
    no_copies.write_text(json.dumps({"selfcheck": False, "host_copies": "off"}))
    flags = {"stock": flags_for(None, 0.1, config), "knorm": flags_for("knorm", 0.1, config),
             "unicache": flags_for("unicache", 0.1, config),
             "unicache-no-copies": flags_for("unicache", 0.1, no_copies),
             "shipped": next(iter(SHIPPED_ROW.values()))}[args.server]
    picks = popular_images(24, args.conversations, 1.1, 0)  # perf_workload.workload's draw
    pool = ["--max-total-tokens", str(workload_pool(args.image_px)), *args.server_args.split()]
    with warmed(model, flags + pool, work / f"{args.server}-{args.image_px}.log") as server:
        offset = len(server.log())
        sampler = scheduler_phases.record(server, work / f"{args.server}-{args.image_px}.pyspy")
        start = time.perf_counter()
        try:
            outs = converse(server, picks, turns=3, max_tokens=16, concurrency=8,
                            image_px=args.image_px)
        finally:
            scheduler_phases.stop(sampler)
        wall = time.perf_counter() - start
        prefilled = sum(logged(server, offset, r"Prefill batch.*?#new-token: (\d+)"))
    print(json.dumps({
        "server": args.server, "wall_s": round(wall, 1), "tokens_prefilled": prefilled,
        "prompt_tokens": sum(o["usage"]["prompt_tokens"] for o in outs),
        "output_tok_s": round(sum(o["usage"]["completion_tokens"] for o in outs) / wall, 1),
        "phases": scheduler_phases.phases(work / f"{args.server}-{args.image_px}.pyspy")}))


if __name__ == "__main__":
    main()
