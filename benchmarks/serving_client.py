"""SGLang's own benchmark client as the referee: ``sglang.benchmark.serving`` against stock and
each plugin config, one after the other in the same run, with the client's numbers side by side.

The client's image dataset (``--dataset-name image``: random images of a fixed resolution, a
random text prompt, fixed output length) through the OpenAI chat endpoint, on a random-weight
Qwen2-VL (hidden 512, 8 layers; 448 px = 256 visual tokens an image). Two workloads: the pool
free (SGLang's own pool size) and the pool bound (``--max-total-tokens`` holding about five
requests' image KV). Each row adds what the plugin did (``/server_info``): images compressed,
escalations, fallbacks, recalls. The client's images are random noise, so every image is new:
nothing is reused, and the rows measure the plugin's cost on the way to memory savings. The
third workload is the reuse case through the same client: the multi-turn image chats of
``perf.py --parts workload`` (48 conversations of 3 turns over 24 images drawn with Zipf
popularity, 8 at a time, 16 output tokens a turn, a pool of about 6 uncompressed prompts) written
as a trace for the client's ``agentic-trace`` dataset (``image_trace``): the client replays each
conversation turn by turn and sends the server's own answers back as the history, so later turns
and other conversations about the same image reuse its span. At 8 at a time the client, not
the pool, caps the plugin's batch (stock's pool runs about 6 of them); ``--workloads "busy chats"``
sends the same chats 16 at a time, where stock's pool evicts images that other chats still ask
about and prefills them again, and the plugin's pool binds too (a recalled question's prefill
needs its image's whole span in the pool beside the running chats).
``--profile`` samples each scheduler with py-spy during the client's run and adds its phase shares
(``scheduler_phases.py``) to the row (the sampling slows the server: time it without).
``--server-args`` adds flags to every server, stock included: ``--dtype float32`` computes in
fp32 where the CPU has no native bf16 matrix multiply (AVX2 only: bf16 GEMMs run about 7x slower
than fp32 there, and the servers are then bound by that emulation, not by their KV).
``--rounds N`` runs the whole sequence of servers N times, stock first in each round, and adds a
summary: each plugin server's median ratio to the same round's stock and the range over the rounds
(one run's pool-free ratios move by up to 0.4 on a shared 2-core machine, more than the targets'
margins). ``--rows`` runs stock and only the plugin servers named (a large model's run is
long); ``--client-timeout`` bounds each client run. ``--stock-cache`` adds stock with SGLang's image
preprocessing cache, which ``--unicache`` turns on: where images repeat, the split between
what that cache gives and what the compressed KV gives.

    python -m benchmarks.serving_client --out runs/serving-client.json
    python -m benchmarks.serving_client --server-args="--dtype float32" --out runs/sc-fp32.json
    python -m benchmarks.serving_client --profile --workloads "pool free" --out runs/sc-prof.json
    python -m benchmarks.serving_client --rounds 5 --workloads "pool free" --out runs/sc-5.json
    python -m benchmarks.serving_client --workloads multi-turn --out runs/sc-multi-turn.json
    python -m benchmarks.serving_client --workloads "busy chats" --out runs/sc-busy-chats.json
    python -m benchmarks.serving_client --model <checkpoint> --workloads multi-turn \
        --rows shipped --client-timeout 3600 --out runs/sc-mt-large.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import scheduler_phases
from benchmarks.perf import (
    SHIPPED,
    WORKLOAD_MODEL,
    flags_for,
    print_table,
    shipped_variants,
)
from benchmarks.perf_workload import (
    QUESTIONS,
    STOCK_CACHED,
    only_rows,
    picture,
    popular_images,
    workload_pool,
)
from tests.support.client import flush_cache, internal_state
from tests.support.images import image_chat
from tests.support.server import cpu_env, start_server
from tests.support.tiny_vlm import build_tiny_qwen2_vl

IMAGE = ["--dataset-name", "image", "--image-count", "2", "--image-resolution", "448x448",
         "--random-input-len", "32", "--random-range-ratio", "1.0"]
TRACE = "{trace}"  # stands for the path of ``image_trace``'s file in a workload's client flags
MULTI_TURN_POOL = workload_pool(448)  # about 6 uncompressed prompts of 256 image tokens
WORKLOADS = {
    "pool free: 24 prompts, concurrency 8, 64 out": {
        "client": [*IMAGE, "--num-prompts", "24", "--max-concurrency", "8",
                   "--random-output-len", "64"],
        "server": []},
    "pool binds: 32 prompts, concurrency 16, 128 out, --max-total-tokens 3000": {
        "client": [*IMAGE, "--num-prompts", "32", "--max-concurrency", "16",
                   "--random-output-len", "128"],
        "server": ["--max-total-tokens", "3000"]},
    # The same chats with more of them in flight than stock's pool holds: at concurrency 8 the
    # client, not the pool, caps the plugin's batch (stock runs about 6 at once).
    **{f"{name}: 48 conversations x 3 turns over 24 images, concurrency {concurrency}, 16 out, "
       f"--max-total-tokens {MULTI_TURN_POOL}": {
           "client": ["--dataset-name", "agentic-trace", "--dataset-path", TRACE,
                      "--num-prompts", "48", "--max-concurrency", str(concurrency),
                      "--sharegpt-output-len", "16"],
           "server": ["--max-total-tokens", str(MULTI_TURN_POOL)]}
       for name, concurrency in (("multi-turn", 8), ("busy chats", 16))},
}
PLUGIN_KEYS = ("images_compressed", "escalations", "fallbacks", "spans_recalled")


def image_trace(path: Path, *, images: int = 24, conversations: int = 48, turns: int = 3,
                zipf: float = 1.1, image_px: int = 448, seed: int = 0) -> Path:
    """Write the multi-turn workload's draw (``perf_workload.workload``: the same images, Zipf
    popularity and questions) as SGLang's ``agentic-trace`` file: one conversation a row, its
    first turn the image and a question, each later turn the next question."""
    rows = []
    for i in popular_images(images, conversations, zipf, seed):
        first = image_chat(picture(i, image_px), QUESTIONS[0])["messages"]
        later = [[{"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]}]
                 for t in range(1, turns)]
        rows.append([{"messages": messages} for messages in (first, *later)])
    path.write_text(json.dumps({"conversations": rows}))
    return path


def servers(config: Path, variants: dict[str, list[str]] | None = None,
            only: str = "") -> dict[str, list[str]]:
    """Stock first, then every plugin config (``only``, ``--rows``: those whose name holds one of
    these comma-separated strings)."""
    every = {"stock": ["--enable-cache-report"],
             "`--unicache` (defaults as shipped)": SHIPPED,
             "unicache keep 0.1, self-check off": flags_for("unicache", 0.1, config),
             "knorm keep 0.1, self-check off": flags_for("knorm", 0.1, config),
             **(variants or {})}
    return dict(only_rows(list(every.items()), only))


def run_client(server, model: Path, workload: list[str], out: Path,
               timeout: float = 1200) -> dict:
    """One ``sglang.benchmark.serving`` run against ``server``: its summary line."""
    command = [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang-oai-chat",
               "--host", "127.0.0.1", "--port", str(server.port), "--model", str(model),
               "--tokenizer", str(model), *workload, "--output-file", str(out),
               "--disable-tqdm", "--seed", "1"]
    subprocess.run(command, check=True, env=cpu_env(), capture_output=True, text=True,
                   timeout=timeout)
    return json.loads(out.read_text().strip().splitlines()[-1])


def selected(workloads: list[str], table: dict[str, dict] | None = None) -> dict[str, dict]:
    """The workloads of ``table`` (default ``WORKLOADS``) whose name holds one of
    ``workloads``, in the table's order."""
    return {name: parts for name, parts in (table or WORKLOADS).items()
            if any(w in name for w in workloads)}


def measure(model: Path, config: Path, log_dir: Path, workloads: list[str],
            profile: bool = False, extra: tuple[str, ...] = (), rounds: int = 1,
            variants: dict[str, list[str]] | None = None, only: str = "",
            client_timeout: float = 1200, table: dict[str, dict] | None = None) -> list[dict]:
    """Every selected workload of ``table`` (default ``WORKLOADS``) on stock and each plugin
    server, ``rounds`` times: one row per server and round."""
    rows = []
    trace = None
    for workload, parts in selected(workloads, table).items():
        if TRACE in parts["client"]:  # one trace file for every server and round
            trace = trace or image_trace(log_dir / "serving-client.trace.json")
            parts = {**parts, "client": [str(trace) if arg == TRACE else arg
                                         for arg in parts["client"]]}
        for r in range(rounds):
            for row in _round(model, config, log_dir, workload, parts, profile, extra,
                              len(rows), variants, only, client_timeout):
                rows.append({**row, "round": r + 1} if rounds > 1 else row)
    return rows


RATIOS = ("tok_s_vs_stock", "tpot_vs_stock", "ttft_vs_stock")


def summary(rows: list[dict]) -> list[dict]:
    """Per workload and plugin server: the median of each ratio to its round's stock, and its
    range over the rounds ("median (min-max)")."""
    out = []
    for workload in dict.fromkeys(row["workload"] for row in rows):
        mine = [row for row in rows if row["workload"] == workload and "tok_s_vs_stock" in row]
        for name in dict.fromkeys(row["server"] for row in mine):
            runs = [row for row in mine if row["server"] == name]
            entry = {"workload": workload, "server": name, "rounds": len(runs)}
            for key in RATIOS:
                values = sorted(row[key] for row in runs)
                entry[key] = (f"{statistics.median(values):.2f}x "
                              f"({values[0]:.2f}-{values[-1]:.2f})")
            out.append(entry)
    return out


def client_row(workload: str, server: str, result: dict, plugin: dict) -> dict:
    """A server's row: the client's summary rounded for the table, what the plugin did."""
    return {"workload": workload, "server": server,
            "output_tok_s": round(result["output_throughput"], 2),
            "ttft_mean_ms": round(result["mean_ttft_ms"]),
            "tpot_mean_ms": round(result["mean_tpot_ms"], 1), **plugin}


def ratios(result: dict, stock: dict) -> dict:
    """A plugin server's ratios to stock's, from the client's unrounded numbers (a large model
    decodes a few tokens a second, where rounding to the table's precision moves a ratio by
    several percent)."""
    return {"tok_s_vs_stock": round(result["output_throughput"] / stock["output_throughput"], 2),
            "tpot_vs_stock": round(result["mean_tpot_ms"] / stock["mean_tpot_ms"], 2),
            "ttft_vs_stock": round(result["mean_ttft_ms"] / stock["mean_ttft_ms"], 2)}


def _round(model: Path, config: Path, log_dir: Path, workload: str, parts: dict,
           profile: bool, extra: tuple[str, ...], first: int,
           variants: dict[str, list[str]] | None = None, only: str = "",
           client_timeout: float = 1200) -> list[dict]:
    """Every server once on ``workload``, stock first: their rows, ratios to this stock."""
    rows = []
    base = None
    for i, (name, flags) in enumerate(servers(config, variants, only).items()):
        n = first + len(rows)
        server = start_server(model, [*flags, *parts["server"], *extra],
                              log_dir / f"serving-client-{n}.log")
        try:
            flush_cache(server)
            before = internal_state(server).get("unicache", {})
            spy = log_dir / f"serving-client-{n}.pyspy"
            sampler = scheduler_phases.record(server, spy) if profile else None
            try:
                result = run_client(server, model, parts["client"],
                                    log_dir / f"serving-client-{n}.jsonl", client_timeout)
            finally:
                if sampler is not None:
                    scheduler_phases.stop(sampler)
            after = internal_state(server).get("unicache", {})
        finally:
            server.stop()
        row = client_row(workload, name, result,
                         {key: after.get(key, 0) - before.get(key, 0) for key in PLUGIN_KEYS})
        if profile:
            row["phases"] = scheduler_phases.phases(spy)
        if i:
            row.update(ratios(result, base))
        base = base or result
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint (default: a random Qwen2-VL, WORKLOAD_MODEL)")
    parser.add_argument("--workloads", default="pool free,pool binds,multi-turn",
                        help="comma-separated: the workloads whose name holds one of these")
    parser.add_argument("--profile", action="store_true",
                        help="py-spy each scheduler during the client's run (phase shares)")
    parser.add_argument("--server-args", default="",
                        help="flags added to every server, stock included (e.g. --dtype float32)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every server this many times, stock first in each round, "
                             "and add the median ratios")
    parser.add_argument("--shipped-set", default="",
                        help="one more server, the defaults as shipped with these config keys "
                             "(JSON, e.g. '{\"view_max_keep\": 0.15}')")
    parser.add_argument("--stock-cache", action="store_true",
                        help="one more server: stock with SGLang's image preprocessing cache, "
                             "which --unicache turns on (where images repeat: the multi-turn "
                             "workloads)")
    parser.add_argument("--rows", default="",
                        help="run stock and only the plugin servers whose name holds one of "
                             "these comma-separated strings (e.g. shipped)")
    parser.add_argument("--client-timeout", type=float, default=1200,
                        help="seconds one client run may take (a larger model needs more)")
    parser.add_argument("--out", default="runs/serving-client.json")
    args = parser.parse_args()
    extra = tuple(args.server_args.split())
    work = Path(tempfile.mkdtemp())
    model = Path(args.model) if args.model else build_tiny_qwen2_vl(
        work / "tiny-qwen2-vl-serving", **WORKLOAD_MODEL)
    config = work / "policy.json"
    config.write_text(json.dumps({"selfcheck": False}))
    start = time.perf_counter()
    log_dir = Path("runs/perf-logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    rows = measure(model, config, log_dir, args.workloads.split(","), args.profile, extra,
                   args.rounds, {**shipped_variants(args.shipped_set, work),
                                 **(STOCK_CACHED if args.stock_cache else {})}, args.rows,
                   args.client_timeout)
    result = {"rows": rows, "server_args": list(extra), "rounds": args.rounds,
              "seconds": round(time.perf_counter() - start)}
    if args.rounds > 1:
        result["summary"] = summary(rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print_table(rows)
    if args.rounds > 1:
        print_table(result["summary"])


if __name__ == "__main__":
    main()
