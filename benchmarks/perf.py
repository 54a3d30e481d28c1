"""Performance against stock SGLang, side by side, through the real engine.

Each measurement starts stock SGLang and the plugin on the same model, pool and workload in the
same run, and reports ratios. Numbers are read from the allocator (``/server_info``), never
estimated.

1. memory: KV slots (and bytes) one cached image holds in the tree, per keep ratio, vs stock;
   ``memory-paged``: the same by ``--page-size`` (``--page-sizes``).
2. capacity: distinct images still resident in a pool sized for ~8 uncompressed images, after a
   stream of distinct images (``capacity-trained``: the same on the bundled trained model;
   ``capacity-hicache``: with HiCache's host tier, whose resident spans count).
5. overhead: time from prefill end to compressed cache (score capture + policy + compaction) as a
   share of the prefill forward, per method; ``overhead-large`` the same on ``WORKLOAD_MODEL``
   with ``--overhead-images`` images of ``--image-px`` per request (2 x 256 or 4 x 1,024 tokens),
   or on ``LM_2B_MODEL`` with ``--overhead-model 2b``.

3, 4 and 6 (workload, decode, concurrency: the serving workload) are in ``perf_workload.py``;
``workload-large`` runs part 3 on a model where prefill costs (``WORKLOAD_MODEL``); ``recall``
(``recall_costs.py``) times a later question about an image on that model: stock with the image
resident, stock with HiCache loading it back, the plugin recalling its host copy.

    python -m benchmarks.perf --out runs/perf.json          # the default parts (see Makefile)
    python -m benchmarks.perf --parts capacity,capacity-trained  # 22 minutes
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks.perf_workload import concurrency, decode, only_rows, streaming, workload
from benchmarks.recall_costs import recall_costs
from sglang_unicache.policy.quantize import bits_of, host_row_bytes
from sglang_unicache.policy.registry import known_methods
from tests.support.client import (
    available_slots,
    chat,
    flush_cache,
    internal_state,
)
from tests.support.images import data_url, image_chat, solid_png
from tests.support.server import start_server
from tests.support.tiny_vlm import build_tiny_qwen2_vl

IMAGE_SIZE = 448  # 256 visual tokens per image
TRAINED_MODEL = Path(__file__).parents[1] / "assets/checkpoints/tiny-vqa-qwen2-vl"
# The decode part reads 8 x 4,100 tokens of KV per step. On the 2-layer, 64-wide model that is
# 256 bytes a token, so the step is all fixed cost; this one holds 2 KB a token (a 7B model holds
# ~57 KB), enough that reading the KV is a visible share of a CPU decode step. 896 px = 1,024
# visual tokens an image.
DECODE_MODEL = {"hidden": 256, "layers": 4, "image_size": 896, "context": 8192}
# The streaming part: long visual context on a model where prefill costs, hidden 512,
# 8 layers, 1,024 visual tokens an image, 4 images a request.
STREAMING_MODEL = {"hidden": 512, "layers": 8, "image_size": 896, "context": 20480}
# The workload on a model where prefill costs: the multi-turn part's 256-token images
# on the streaming part's width and depth, so a turn's image prefill is seconds on this CPU, far
# more than the request's fixed path (HTTP, template, image processor), as on a real model.
WORKLOAD_MODEL = {"hidden": 512, "layers": 8, "image_size": IMAGE_SIZE, "context": 8192}
# The overhead part's other model: Qwen2-VL-2B's language model (hidden 1,536, 28 layers, 12 query
# heads over 2 KV heads of 128, MLP 8,960; random weights) under the tiny vision tower, so the
# compression is measured against the prefill of a language model of a served size.
LM_2B_MODEL = {"hidden": 1536, "layers": 28, "heads": 12, "intermediate": 8960,
               "context": 8192}


def image(i: int, size: int = IMAGE_SIZE) -> bytes:
    """Picture ``i``: one colour, ``(size / 28) ** 2`` visual tokens; distinct for every ``i``
    below 65,536 (the colours repeat every 256 ``i``, so ``i // 256`` shifts the blue)."""
    return solid_png(((37 * i) % 256, (91 * i) % 256, (53 * i + 7 + i // 256) % 256), size=size)


def head_dim(model: Path) -> int:
    cfg = json.loads((model / "config.json").read_text())
    return cfg["hidden_size"] // cfg["num_attention_heads"]


def slot_bytes(model: Path, element: int = 2) -> int:
    """Bytes of one KV slot (K and V of every layer): ``element`` bytes per value (2: bf16,
    1: ``--kv-cache-dtype fp8_*``)."""
    cfg = json.loads((model / "config.json").read_text())
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim(model) * element


FP8 = ["--kv-cache-dtype", "fp8_e4m3"]


# The README's plain launch: the defaults as a user gets them (self-check and escalation on).
SHIPPED = ["--unicache", "--enable-cache-report"]
SHIPPED_ROW = {"--unicache --unicache-keep-ratio 0.1 (defaults as shipped)":
               [*SHIPPED, "--unicache-keep-ratio", "0.1"]}


def shipped_variants(keys: str, work: Path) -> dict[str, list[str]]:
    """``--shipped-set``: the defaults as shipped with ``keys`` (a JSON object) in a config
    file, as one row named after them; none for an empty string."""
    if not keys:
        return {}
    overrides = json.loads(keys)
    path = work / "shipped-set.json"
    path.write_text(json.dumps(overrides))
    label = ", ".join(f"`{key}: {json.dumps(value)}`" for key, value in overrides.items())
    return {f"defaults as shipped with {label}":
            [*SHIPPED, "--unicache-keep-ratio", "0.1", "--unicache-config", str(path)]}


def flags_for(method: str | None, ratio: float, config: Path) -> list[str]:
    if method is None:
        return ["--enable-cache-report"]
    return ["--unicache", "--unicache-method", method, "--unicache-keep-ratio", str(ratio),
            "--unicache-config", str(config), "--enable-cache-report"]


def ask(server, i: int, size: int = IMAGE_SIZE) -> dict:
    """One question about picture ``i``, one output token (the tree keeps the prompt only)."""
    return chat(server, image_chat(image(i, size), "what colour is it?", max_tokens=1))


def memory_per_image(model: Path, config: Path, ratios: list[float], log_dir: Path) -> list[dict]:
    rows = []
    servers = [("stock", flags_for(None, 1.0, config))]
    servers += [(f"unicache knorm keep {r}", flags_for("knorm", r, config)) for r in ratios]
    servers.append(("--unicache, defaults as shipped", SHIPPED))
    # fp8 pools stack with compression: half the bytes per slot.
    servers.append(("stock, fp8_e4m3 KV", flags_for(None, 1.0, config) + FP8))
    servers.append(("unicache knorm keep 0.1, fp8_e4m3 KV", flags_for("knorm", 0.1, config) + FP8))
    servers.append(("--unicache defaults as shipped, fp8_e4m3 KV", SHIPPED + FP8))
    for name, flags in servers:
        server = start_server(model, flags, log_dir / "mem.log")
        try:
            held = []
            for i in range(3):
                flush_cache(server)
                before = available_slots(server)
                out = ask(server, i)  # the tree keeps the prompt: no output token has KV
                text = out["usage"]["prompt_tokens"] - 256
                held.append(before - available_slots(server) - text)
            stats = internal_state(server).get("unicache") or {}
        finally:
            server.stop()
        rows.append({"server": name, "image_slots": max(held),
                     "images_compressed": stats.get("images_compressed", 0),
                     "escalations": stats.get("escalations", 0),
                     "fallbacks": stats.get("fallbacks", 0)})
    stock = rows[0]["image_slots"]
    for row in rows:
        row["bytes"] = row["image_slots"] * slot_bytes(model, 1 if "fp8" in row["server"] else 2)
        row["ratio_vs_stock"] = round(row["image_slots"] / stock, 3)
        row["bytes_vs_stock_bf16"] = round(row["bytes"] / (stock * slot_bytes(model)), 3)
    return rows


def memory_paged(model: Path, config: Path, page_sizes: list[int], log_dir: Path) -> list[dict]:
    """Memory per cached image by ``--page-size``: stock, key-norm at keep 0.1 (self-check off)
    and the defaults as shipped at each page size. A paged tree holds whole pages (the prompt's
    last partial page is not cached), so rows report the slots the cached prompt holds (read
    from the allocator) and the entries the image keeps (``compressed_slots_held``)."""
    rows = []
    for page in page_sizes:
        paged = ["--page-size", str(page)]
        servers = [("stock", flags_for(None, 1.0, config)),
                   ("unicache knorm keep 0.1", flags_for("knorm", 0.1, config)),
                   ("--unicache, defaults as shipped", SHIPPED)]
        for name, flags in servers:
            server = start_server(model, flags + paged, log_dir / "mem-paged.log")
            try:
                held, kept = [], []
                for i in range(3):
                    flush_cache(server)
                    before = available_slots(server)
                    ask(server, i)
                    held.append(before - available_slots(server))
                    state = internal_state(server).get("unicache") or {}
                    kept.append(state.get("compressed_slots_held") or 256)
                stats = internal_state(server).get("unicache") or {}
            finally:
                server.stop()
            rows.append({"page_size": page, "server": name, "prompt_slots": max(held),
                         "image_entries": max(kept),
                         "images_compressed": stats.get("images_compressed", 0)})
    for row in rows:
        stock = next(r for r in rows if r["page_size"] == row["page_size"]
                     and r["server"] == "stock")
        row["prompt_slots_vs_stock"] = round(row["prompt_slots"] / stock["prompt_slots"], 3)
    return rows


# HiCache's host tier at SGLang's default size in cache mode (twice the device pool).
HICACHE = ["--enable-hierarchical-cache", "--hicache-ratio", "2"]


def capacity_servers(config: Path, ratio: float) -> list[tuple[str, list[str]]]:
    """Stock, the plugin with re-compression off (a full pool evicts whole images) and on (the
    default: every cached image is halved once before any is halved twice), and the defaults as
    shipped."""
    no_recompress = config.with_name("policy-no-recompress.json")
    no_recompress.write_text(json.dumps({**json.loads(config.read_text()), "recompress": False}))
    return [("stock", flags_for(None, ratio, config)),
            (f"unicache keep {ratio}, re-compression off",
             flags_for("knorm", ratio, no_recompress)),
            (f"unicache keep {ratio}", flags_for("knorm", ratio, config)),
            *SHIPPED_ROW.items()]


def hicache_servers(model: Path, config: Path, ratio: float) -> list[tuple[str, list[str]]]:
    """Stock without and with HiCache, then the plugin (bf16, int8 and int4 host copies) and the
    shipped defaults with HiCache (spans resident in host memory count, a hit there loads
    back)."""
    name, shipped = next(iter(SHIPPED_ROW.items()))
    quantized, d = [], head_dim(model)
    for mode in ("int8", "int4"):
        path = config.with_name(f"policy-host-{mode}.json")
        path.write_text(json.dumps({**json.loads(config.read_text()), "host_quantization": mode}))
        # The host tier is sized in slots (--hicache-ratio x the device pool): the same bytes
        # as the bf16 row's hold 2 D / row bytes times the slots.
        host_ratio = float(HICACHE[-1]) * 2 * d / host_row_bytes(d, bits_of(mode))
        quantized.append((f"unicache keep {ratio} + HiCache, {mode} host copies, same host bytes "
                          f"(--hicache-ratio {host_ratio:.2f})",
                          flags_for("knorm", ratio, path) + HICACHE[:-1] + [f"{host_ratio:.3f}"]))
    return [("stock", flags_for(None, ratio, config)),
            ("stock + HiCache", flags_for(None, ratio, config) + HICACHE),
            (f"unicache keep {ratio} + HiCache", flags_for("knorm", ratio, config) + HICACHE),
            *quantized,
            (f"{name} + HiCache", shipped + HICACHE)]


def capacity(model: Path, config: Path, ratio: float, stream: int, log_dir: Path,
             size: int = IMAGE_SIZE, servers: list | None = None) -> list[dict]:
    """Images still reusable (>= 16 prompt tokens cached) after a stream of distinct images, in a
    pool sized for 8 uncompressed images with their text, on each of ``servers`` (default
    ``capacity_servers``); ratios against the first row (stock)."""
    pool = 8 * ((size // 28) ** 2 + 24)
    servers = servers or capacity_servers(config, ratio)
    rows = []
    for name, flags in servers:
        server = start_server(model, flags + ["--max-total-tokens", str(pool)],
                              log_dir / "capacity.log")
        try:
            for i in range(stream):
                ask(server, 100 + i, size)
            stats = internal_state(server).get("unicache") or {}
            shrunk = stats.get("spans_recompressed", 0)
            resident = 0
            for i in reversed(range(stream)):  # newest first: a hit refreshes only itself
                out = ask(server, 100 + i, size)
                if out["usage"]["prompt_tokens_details"]["cached_tokens"] < 16:
                    break
                resident += 1
            after = internal_state(server).get("unicache") or {}
        finally:
            server.stop()
        rows.append({"server": name, "pool_tokens": pool, "images_streamed": stream,
                     "images_resident": resident, "spans_recompressed": shrunk,
                     "spans_on_host_after_stream": stats.get("spans_on_host", 0),
                     # hits served from a host copy (recall) rather than the device pool
                     "recalled": after.get("spans_recalled", 0) - stats.get("spans_recalled", 0),
                     "host_copies_after_stream": stats.get("host_copies", 0)})
    for row in rows[1:]:
        row["ratio_vs_stock"] = round(row["images_resident"] / max(rows[0]["images_resident"], 1),
                                      2)
    return rows


def images_chat(pngs: list[bytes], question: str, **params) -> dict:
    """``image_chat`` with several images before the question."""
    body = image_chat(pngs[0], question, **params)
    content = body["messages"][0]["content"]
    content[1:1] = [{"type": "image_url", "image_url": {"url": data_url(png)}}
                    for png in pngs[1:]]
    return body


# The compression's steps, timed by the scheduler (``Stats``): plan, host copy, apply.
STEPS = ("compress_plan_seconds", "compress_copy_seconds", "compress_apply_seconds")


def overhead(model: Path, config: Path, methods: list[str], ratio: float, log_dir: Path,
             requests: int = 6, images: int = 1, size: int = IMAGE_SIZE,
             extra: list[str] | None = None,
             variants: dict[str, list[str]] | None = None) -> list[dict]:
    rows, extra = [], extra or []
    runs = [(method, flags_for(method, ratio, config) + extra) for method in methods]
    runs.append(("unicache, defaults as shipped", SHIPPED + extra))
    runs += [(name, flags + extra) for name, flags in (variants or {}).items()]
    for method, flags in runs:
        server = start_server(model, flags, log_dir / "overhead.log")
        try:
            before = {}
            for i in range(-1, requests):  # the first request warms the server up, uncounted
                pngs = [image(200 + images * i + j, size) for j in range(images)]
                chat(server, images_chat(pngs, "what colour is it?", max_tokens=2))
                if i < 0:
                    before = internal_state(server)["unicache"]
            after = internal_state(server)["unicache"]
            stats = {key: after[key] - before[key]
                     for key in ("prefill_seconds", "prefill_tokens", "compress_seconds",
                                 *STEPS, "images_compressed", "escalations", "fallbacks")}
        finally:
            server.stop()
        rows.append({"method": method, "keep_ratio": ratio, "images": images,
                     "image_tokens": (size // 28) ** 2,
                     "prefill_tokens": stats["prefill_tokens"] // requests,
                     "prefill_ms": round(1000 * stats["prefill_seconds"] / requests, 1),
                     "compress_ms": round(1000 * stats["compress_seconds"] / requests, 1),
                     "overhead_share": round(stats["compress_seconds"]
                                             / max(stats["prefill_seconds"], 1e-9), 3),
                     **{f"{key[:-len('_seconds')]}_ms": round(1000 * stats[key] / requests, 1)
                        for key in STEPS},
                     **{key: stats[key] for key in ("images_compressed", "escalations",
                                                    "fallbacks")}})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint (default: the tiny Qwen2-VL at 448 px)")
    parser.add_argument("--decode-model",
                        help="checkpoint of the decode part (default: a wider tiny Qwen2-VL, "
                             "see DECODE_MODEL)")
    parser.add_argument("--ratios", default="0.05,0.1,0.25,0.5")
    parser.add_argument("--page-sizes", default="1,16,64", help="memory-paged: --page-size values")
    parser.add_argument("--methods", default="knorm,snapkv,h2o,pyramidkv,aircache,unicache")
    parser.add_argument("--stream", type=int, default=400,
                        help="capacity: distinct images streamed")
    parser.add_argument("--parts", default="memory,capacity,capacity-trained,capacity-hicache,"
                        "overhead,workload,workload-large,recall,decode,concurrency")
    parser.add_argument("--method", default="knorm", help="plugin method of the workload parts")
    parser.add_argument("--images", type=int, default=24, help="workload: distinct images")
    parser.add_argument("--conversations", type=int, default=48, help="workload: conversations")
    parser.add_argument("--turns", type=int, default=3, help="workload: turns per conversation")
    parser.add_argument("--clients", type=int, default=8, help="workload: concurrent clients")
    parser.add_argument("--image-px", type=int, default=IMAGE_SIZE,
                        help="workload-large: image side in px (448: 256 visual tokens, 896: "
                             "1,024); the pool scales with it (perf_workload.workload_pool)")
    parser.add_argument("--overhead-images", type=int, default=2,
                        help="overhead-large: images per request")
    parser.add_argument("--overhead-model", choices=("workload", "2b"), default="workload",
                        help="overhead-large: WORKLOAD_MODEL or LM_2B_MODEL")
    parser.add_argument("--overhead-requests", type=int, default=6,
                        help="overhead parts: requests per server after the warm-up")
    parser.add_argument("--decode-batch", type=int, default=8, help="decode: concurrent requests")
    parser.add_argument("--max-batch", type=int, default=64, help="concurrency: largest b tried")
    parser.add_argument("--workload-model", help="checkpoint of the workload-large part "
                        "(default: a random Qwen2-VL, see WORKLOAD_MODEL)")
    parser.add_argument("--streaming-model", help="checkpoint of the streaming part (default: a "
                        "random Qwen2-VL, see STREAMING_MODEL)")
    parser.add_argument("--streaming-methods", default="all",
                        help="streaming: methods run with the self-check off, besides stock and "
                             "the shipped defaults (comma-separated, or all)")
    parser.add_argument("--rows", default="",
                        help="capacity and recall parts: run stock and only the rows whose "
                             "name holds one of these comma-separated strings")
    parser.add_argument("--server-args", default="",
                        help="workload, overhead-large and recall parts: flags added to every "
                             "server, stock included (e.g. --dtype float32 where the CPU has no "
                             "native bf16 matmul)")
    parser.add_argument("--shipped-set", default="",
                        help="overhead-large, workload-large and streaming: one more row, "
                             "the defaults as shipped with these config keys (JSON, e.g. "
                             "'{\"view_max_keep\": 0.15}')")
    parser.add_argument("--out", default="runs/perf.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp())
    model = Path(args.model) if args.model else build_tiny_qwen2_vl(
        work / "tiny-qwen2-vl", image_size=IMAGE_SIZE)
    config = work / "policy.json"
    config.write_text(json.dumps({"selfcheck": False}))
    log_dir = Path("runs/perf-logs")
    start = time.perf_counter()
    parts = args.parts.split(",")
    extra = args.server_args.split()
    variants = shipped_variants(args.shipped_set, work)
    results = {}
    if "memory" in parts:
        results["memory"] = memory_per_image(model, config,
                                             [float(r) for r in args.ratios.split(",")], log_dir)
    if "memory-paged" in parts:
        results["memory-paged"] = memory_paged(
            model, config, [int(p) for p in args.page_sizes.split(",")], log_dir)
    capacity_rows = only_rows(capacity_servers(config, 0.1), args.rows)
    if "capacity" in parts:
        results["capacity"] = capacity(model, config, 0.1, args.stream, log_dir,
                                       servers=capacity_rows)
    if "capacity-trained" in parts:  # the same on the bundled trained model (64-token images)
        results["capacity-trained"] = capacity(TRAINED_MODEL, config, 0.1, args.stream, log_dir,
                                               size=224, servers=capacity_rows)
    if "capacity-hicache" in parts:  # spans in HiCache's host tier count
        results["capacity-hicache"] = capacity(
            model, config, 0.1, args.stream, log_dir,
            servers=only_rows(hicache_servers(model, config, 0.1), args.rows))
    if "overhead" in parts:
        results["overhead"] = overhead(model, config, args.methods.split(","), 0.1, log_dir,
                                       requests=args.overhead_requests)
    if "overhead-large" in parts:
        shape = WORKLOAD_MODEL if args.overhead_model == "workload" else LM_2B_MODEL
        large = Path(args.workload_model) if args.workload_model else build_tiny_qwen2_vl(
            work / f"tiny-qwen2-vl-{args.overhead_model}-{args.image_px}",
            **{**shape, "image_size": args.image_px})
        results["overhead-large"] = overhead(large, config, args.methods.split(","), 0.1,
                                             log_dir, requests=args.overhead_requests,
                                             images=args.overhead_images,
                                             size=args.image_px, extra=extra,
                                             variants=variants)
    servers = {"stock": flags_for(None, 0.1, config) + extra,
               f"unicache {args.method} keep 0.1": flags_for(args.method, 0.1, config) + extra}
    shipped_row = {name: flags + extra for name, flags in {**SHIPPED_ROW, **variants}.items()}
    if "workload" in parts:
        results["workload"] = workload(model, servers, log_dir, images=args.images,
                                       conversations=args.conversations, turns=args.turns,
                                       concurrency=args.clients)
    if "workload-large" in parts:
        large = Path(args.workload_model) if args.workload_model else build_tiny_qwen2_vl(
            work / f"tiny-qwen2-vl-workload-{args.image_px}",
            **{**WORKLOAD_MODEL, "image_size": args.image_px})
        results["workload-large"] = workload(large, {**servers, **shipped_row}, log_dir,
                                             images=args.images,
                                             conversations=args.conversations,
                                             turns=args.turns, concurrency=args.clients,
                                             image_px=args.image_px)
    if "recall" in parts:
        large = Path(args.workload_model) if args.workload_model else build_tiny_qwen2_vl(
            work / "tiny-qwen2-vl-workload-448", **WORKLOAD_MODEL)
        results["recall"] = recall_costs(large, config, log_dir, extra=extra, only=args.rows)
    if "decode" in parts:
        decode_model = Path(args.decode_model) if args.decode_model else build_tiny_qwen2_vl(
            work / "tiny-qwen2-vl-decode", **DECODE_MODEL)
        results["decode"] = decode(decode_model, {**servers, **SHIPPED_ROW}, log_dir,
                                   batch=args.decode_batch)
    if "dp" in parts:
        # --dp-size 2: the workload with SGLang's round robin, then with image routing
        # (the ratio row), then stock SGLang and the shipped defaults at dp 2.
        round_robin = work / "round-robin.json"
        round_robin.write_text(json.dumps({"selfcheck": False, "dp_routing": False}))
        dp = ["--dp-size", "2"]
        results["dp"] = workload(model, {
            f"unicache {args.method} keep 0.1, dp 2, round robin (dp_routing false)":
                flags_for(args.method, 0.1, round_robin) + dp,
            f"unicache {args.method} keep 0.1, dp 2, image routing (default)":
                flags_for(args.method, 0.1, config) + dp,
            "stock, dp 2": flags_for(None, 0.1, config) + dp,
            "--unicache --unicache-keep-ratio 0.1 (defaults as shipped), dp 2":
                [*SHIPPED, "--unicache-keep-ratio", "0.1", *dp]},
            log_dir, ratio_label="image routing / round robin", images=args.images,
            conversations=args.conversations, turns=args.turns, concurrency=args.clients)
    if "streaming" in parts:
        stream_model = Path(args.streaming_model) if args.streaming_model else \
            build_tiny_qwen2_vl(work / "tiny-qwen2-vl-streaming", **STREAMING_MODEL)
        stream_servers = {"stock": ["--enable-cache-report"],
                          "stock, overlap scheduler off": ["--enable-cache-report",
                                                           "--disable-overlap-schedule"],
                          **SHIPPED_ROW, **variants}
        methods = [m for m in known_methods() if m != "full"] \
            if args.streaming_methods == "all" else args.streaming_methods.split(",")
        stream_servers |= {f"unicache {m} keep 0.1, selfcheck off": flags_for(m, 0.1, config)
                           for m in methods if m}
        results["streaming"] = streaming(stream_model, stream_servers, log_dir)
    if "concurrency" in parts:
        results["concurrency"] = concurrency(model, {**servers, **SHIPPED_ROW}, log_dir,
                                             max_batch=args.max_batch)
    results["seconds"] = round(time.perf_counter() - start)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    for name in parts:
        print(f"\n## {name}")
        print_table(results[name])


def print_table(rows: list[dict]) -> None:
    """``rows`` as a markdown table, one column per key any row has (in first-seen order)."""
    keys = list(dict.fromkeys(k for row in rows for k in row))
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row.get(k, "")) for k in keys) + " |")


if __name__ == "__main__":
    main()
