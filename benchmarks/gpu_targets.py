"""The timing targets this CPU cannot decide, in one command for the day a GPU is lent.

    python -m benchmarks.gpu_targets --out runs/gpu-targets.json            # on a CUDA machine
    python -m benchmarks.gpu_targets --steps overhead,client --out runs/gpu-targets-a.json
    python -m benchmarks.gpu_targets --dry --out runs/gpu-targets-dry.json  # here (a test calls it)

Each step is a benchmark BENCHMARKS.md reports from the CPU platform, run as SGLang serves on a
GPU (the model's own dtype, SGLang's default attention backend and CUDA graphs), stock first and
every plugin server after it in the same run:

- ``overhead`` (issue #34): ``perf.overhead`` on ``WORKLOAD_MODEL`` at 2 x 256 and 4 x 1,024
  image tokens a request, knorm (self-check off) and the defaults as shipped: the compression
  against the prefill, both timed in the scheduler; target <= 5%.
- ``client`` (#34): ``serving_client`` (SGLang's ``sglang.benchmark.serving``) with the pool
  free and the pool bound: pool free >= 0.98x stock's output throughput and <= 1.03x its time
  per output token for the defaults and knorm; pool bound >= 1.5x the throughput and <= 0.5x
  the mean TTFT for the defaults, UniCache and knorm. On this CPU bf16 GEMMs are emulated, so
  the pool-bound rows measure the emulation; a GPU computes bf16 natively.
- ``recall`` (#31): ``recall_costs`` on ``WORKLOAD_MODEL``: a later question about an image
  whose full span is loaded back from its host copy; target TTFT <= 1.2x stock's with the image
  resident. On the CPU a load-back is a memory copy; here it crosses PCIe.
- ``multi-turn`` (#31): the multi-turn chats through SGLang's client in a pool of about 6
  uncompressed prompts, 8 at a time and 16 at a time (the busy chats), on Qwen2-VL-2B's
  language model (``LM_2B_MODEL``, random weights, 448 px): the defaults as shipped >= 2x
  stock's output throughput.

It writes one JSON: each step's rows and seconds, and ``targets``, one verdict per target and
row (``value``, ``limit``, ``met``). A missed target is a finding and exits 0; a step that
raised is recorded with its error and exits 1. ``--dry`` runs every step on the CPU platform with
the tests' tiny model and a few requests (its verdicts mean nothing; it keeps the script from
rotting). On a GPU machine run it with ``SGLANG_PLATFORM`` empty so SGLang picks CUDA (the script
sets it so unless ``--dry``, and gives each server start 900 s: a fresh machine compiles its
kernels on first use). The recall and multi-turn steps add stock with SGLang's image
preprocessing cache, which ``--unicache`` turns on: where images repeat, its row splits what
that cache gives from what the compressed KV gives (the targets stay against stock as a user
runs it). Server starts: overhead 4, client 8, recall 6, multi-turn 6 (and the 2B checkpoint's
build); ``--steps`` splits the run across commands and ``--rows shipped`` runs stock and the
defaults only (overhead 2, client 4, recall 3). The JSON is rewritten after every step, so a
command stopped by its time limit keeps the steps it finished.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from contextlib import nullcontext
from pathlib import Path

STEPS = ("overhead", "client", "recall", "multi-turn")
SHIPPED = "defaults as shipped"
# (issue, step, workload and row name substrings, key, comparison, limit)
TARGETS = [
    *[(34, "overhead", "", name, "overhead_share", "<=", 0.05) for name in ("knorm", SHIPPED)],
    *[(34, "client", "pool free", name, key, op, limit) for name in (SHIPPED, "knorm")
      for key, op, limit in (("tok_s_vs_stock", ">=", 0.98), ("tpot_vs_stock", "<=", 1.03))],
    *[(34, "client", "pool binds", name, key, op, limit)
      for name in (SHIPPED, "unicache keep", "knorm")
      for key, op, limit in (("tok_s_vs_stock", ">=", 1.5), ("ttft_vs_stock", "<=", 0.5))],
    (31, "recall", "", f"{SHIPPED}) / stock resident", "ttft_ms", "<=", 1.2),
    *[(31, "multi-turn", workload, SHIPPED, "tok_s_vs_stock", ">=", 2.0)
      for workload in ("multi-turn", "busy chats")],
]
# The dry run's client workloads: a few short requests on small images.
DRY_CLIENT = {"--num-prompts": "4", "--max-concurrency": "2", "--random-output-len": "8",
              "--sharegpt-output-len": "8", "--image-resolution": "224x224"}


def verdicts(steps: dict[str, dict]) -> list[dict]:
    """One verdict per target and matching row of the steps that ran (``steps[name]["rows"]``;
    a row names itself by ``server`` or ``method`` and its ``workload``)."""
    out = []
    for issue, step, workload, name, key, op, limit in TARGETS:
        for row in steps.get(step, {}).get("rows", []):
            label = row.get("server", row.get("method", ""))
            if workload not in row.get("workload", "") or name not in label or key not in row:
                continue
            value = row[key]
            met = value <= limit if op == "<=" else value >= limit
            out.append({"issue": issue, "step": step, "workload": row.get("workload", ""),
                        "row": label, "key": key, "value": value, "limit": f"{op} {limit}",
                        "met": met})
    return out


def dry_table(table: dict[str, dict]) -> dict[str, dict]:
    """``table``'s client workloads with ``DRY_CLIENT``'s values in place of their own, each
    named for what it runs (its name's first words, which select it, kept)."""
    def shrink(args: list[str]) -> list[str]:
        return [DRY_CLIENT.get(args[i - 1], arg) if i else arg for i, arg in enumerate(args)]

    def label(name: str, args: list[str]) -> str:
        changed = " ".join(f"{arg} {DRY_CLIENT[arg]}" for arg in args if arg in DRY_CLIENT)
        return f"{name.split(':')[0]}, dry: {changed}"

    return {label(name, parts["client"]): {**parts, "client": shrink(parts["client"])}
            for name, parts in table.items()}


class Models:
    """The checkpoints the steps serve, each built once on first use (random weights, no
    download); ``--dry``: the tests' tiny model for every step."""

    def __init__(self, work: Path, dry: bool):
        self.work, self.dry, self.built = work, dry, {}

    def get(self, name: str, image_px: int) -> Path:
        from benchmarks.perf import LM_2B_MODEL, WORKLOAD_MODEL
        from tests.support.tiny_vlm import build_tiny_qwen2_vl

        key = "tiny" if self.dry else f"{name}-{image_px}"
        if key not in self.built:
            shape = {} if self.dry else {**{"workload": WORKLOAD_MODEL, "2b": LM_2B_MODEL}[name],
                                         "image_size": image_px}
            self.built[key] = build_tiny_qwen2_vl(self.work / key, **shape)
        return self.built[key]


def run_step(step: str, models: Models, config: Path, logs: Path, dry: bool,
             client_timeout: float, rows: str = "") -> list[dict]:
    """One step's rows. ``rows`` (``--rows``): stock, the defaults as shipped and only the
    plugin servers whose name holds one of these comma-separated strings; the dry run takes
    "shipped"."""
    from benchmarks.perf import overhead
    from benchmarks.perf_workload import STOCK_CACHED
    from benchmarks.recall_costs import recall_costs
    from benchmarks.serving_client import WORKLOADS, measure

    table = dry_table(WORKLOADS) if dry else WORKLOADS
    rows = "shipped" if dry else f"{rows},shipped" if rows else ""
    if step == "overhead":
        methods = [m for m in ("knorm",) if not rows or any(r in m for r in rows.split(","))]
        out = []
        for px, images in ([(224, 1)] if dry else [(448, 2), (896, 4)]):
            for row in overhead(models.get("workload", px), config, methods, 0.1, logs,
                                requests=1 if dry else 6, images=images, size=px):
                out.append({**row, "workload": f"{images} x {row['image_tokens']} image tokens"})
        return out
    if step == "client":
        return measure(models.get("workload", 448), config, logs,
                       ["pool binds"] if dry else ["pool free", "pool binds"], only=rows,
                       client_timeout=client_timeout, table=table)
    if step == "recall":
        return recall_costs(models.get("workload", 448), config, logs, images=1 if dry else 6,
                            image_px=224 if dry else 448,
                            only=f"{rows},preprocessing" if rows else "")
    if step == "multi-turn":  # the dry run: the busy chats, the same path at twice the load
        return measure(models.get("2b", 448), config, logs,
                       ["busy chats"] if dry else ["multi-turn", "busy chats"],
                       only="shipped,preprocessing", variants=STOCK_CACHED,
                       client_timeout=client_timeout, table=table)
    raise ValueError(f"unknown step {step!r} (steps: {', '.join(STEPS)})")


def write(out: Path, dry: bool, done: dict[str, dict], start: float) -> dict:
    """The JSON of the steps done so far, with their verdicts (rewritten after every step)."""
    result = {"dry": dry, "steps": done, "targets": verdicts(done),
              "seconds": round(time.perf_counter() - start)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true",
                        help="the CPU platform: the tests' tiny model, a few requests")
    parser.add_argument("--steps", default=",".join(STEPS),
                        help=f"comma-separated, of: {', '.join(STEPS)}")
    parser.add_argument("--rows", default="",
                        help="stock and only the plugin servers whose name holds one of these "
                             "comma-separated strings (e.g. shipped; default: every one)")
    parser.add_argument("--client-timeout", type=float, default=1200,
                        help="seconds one client run may take")
    parser.add_argument("--out", default="runs/gpu-targets.json")
    args = parser.parse_args()
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = [s for s in steps if s not in STEPS]
    if not steps:
        parser.error(f"no steps (steps: {', '.join(STEPS)})")
    if unknown:
        parser.error(f"unknown steps {unknown} (steps: {', '.join(STEPS)})")
    if not args.dry:
        os.environ["SGLANG_PLATFORM"] = ""  # SGLang picks CUDA
        os.environ.setdefault("UNICACHE_SERVER_START_TIMEOUT", "900")
    from benchmarks.gpu_check import workspace
    from benchmarks.perf import print_table
    from tests.support.server import forking_servers

    start = time.perf_counter()
    work, logs, config = workspace(args.out)
    models = Models(work, args.dry)
    done: dict[str, dict] = {}
    # The dry run forks its servers from one process that imported SGLang (the tests' harness).
    with forking_servers(logs / "zygote.log") if args.dry else nullcontext():
        for step in steps:
            began = time.perf_counter()
            step_logs = logs / step.replace(" ", "-")  # each step's server and client logs
            step_logs.mkdir(exist_ok=True)
            try:
                done[step] = {"rows": run_step(step, models, config, step_logs, args.dry,
                                               args.client_timeout, args.rows)}
            except Exception:  # recorded: the other steps still run
                done[step] = {"error": traceback.format_exc()[-3000:]}
            done[step]["seconds"] = round(time.perf_counter() - began)
            result = write(Path(args.out), args.dry, done, start)
    print_table(result["targets"])
    failed = [step for step, got in done.items() if "error" in got]
    print(json.dumps({"seconds": result["seconds"], "failed": failed,
                      "missed": sum(not v["met"] for v in result["targets"])}))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
