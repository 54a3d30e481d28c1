"""Serving-workload parts of the performance benchmark (parts 3, 4 and 6 of ``perf.py``).

Each part runs the same workload on every server of ``servers`` (name -> launch flags; stock
SGLang first, then the plugin) in turn and adds a ``plugin / stock`` row. ``perf.py --parts``
dispatches here.

3. workload: multi-turn image chat over HTTP (Zipf image popularity, whole history resent each
   turn, a thread pool of clients, a small pool): cache hit rate, TTFT, throughput.
4. decode: time per output token of a batch of 8 requests with 4 images of 1,024 visual tokens
   each, while the whole batch decodes together (on ``decode_model``: see ``perf.py``).
6. concurrency: the largest batch of distinct-image requests that decodes together in a fixed
   pool without retraction.

    python -m benchmarks.perf --parts workload,decode,concurrency --out runs/perf-workload.json
"""

from __future__ import annotations

import concurrent.futures as futures
import json
import random
import re
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import requests

from benchmarks import scheduler_phases
from tests.support.client import chat, flush_cache, internal_state, stream_chat
from tests.support.images import data_url, image_chat, solid_png
from tests.support.server import start_server

IMAGE_TOKENS = 256  # a 448 px image on the tiny model
# Stock with SGLang's image preprocessing cache, which ``--unicache`` turns on
# (``engine/startup.py``, ``MM_PREPROCESS_CACHE_MB``) and stock leaves off for Qwen2-VL: where
# images repeat, its row splits what the cache gives (the image processor skipped) from what the
# compressed KV gives.
STOCK_CACHED = {"stock + SGLang's image preprocessing cache (what `--unicache` turns on)":
                ["--enable-cache-report", "--mm-preprocess-cache-size-mb", "256"]}
QUESTIONS = ["what colour is it?", "describe the picture", "how many shapes are there?"]


def only_rows(servers: list, rows: str) -> list:
    """``--rows``: stock (the ratios' base, first) and the servers whose name holds one of the
    comma-separated ``rows``; every server when ``rows`` is empty."""
    if not rows:
        return servers
    return servers[:1] + [row for row in servers[1:]
                          if any(part in row[0] for part in rows.split(","))]


def visual_tokens(image_px: int) -> int:
    """Visual tokens of an ``image_px`` square image on the tiny models (28 px a token)."""
    return (image_px // 28) ** 2


def picture(i: int, size: int = 448) -> bytes:
    """Image ``i`` (distinct for i < 65,536): 448 px is 256 visual tokens, 896 px 1,024."""
    return solid_png((i % 256, (i // 256) % 256, (97 * i + 5) % 256), size=size)


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def logged(server, offset: int, pattern: str) -> list[int]:
    """The integers ``pattern`` captures in the server log written after ``offset``."""
    return [int(n) for n in re.findall(pattern, server.log()[offset:])]


@contextmanager
def warmed(model: Path, flags: list[str], log: Path):
    """A started server, warmed up by one image request, its tree empty; stopped on exit."""
    server = start_server(model, flags, log)
    try:
        chat(server, image_chat(picture(65_000), "what colour is it?", max_tokens=2))
        flush_cache(server)
        yield server
    finally:
        server.stop()


def on_each(model: Path, servers: dict[str, list[str]], extra: list[str], log: Path,
            measure, ratio_keys: list[str], ratio_label: str = "plugin / stock") -> list[dict]:
    """``measure(server)`` on each server in turn (``warmed``), then a ``ratio_label`` row for
    ``ratio_keys``: the second server over the first (by default the plugin over stock), and a
    ``<server> / <first>`` row for each further server."""
    rows = []
    for i, (name, flags) in enumerate(servers.items()):
        with warmed(model, flags + extra, f"{log}-{i}.log") as server:
            rows.append({"server": name, **measure(server)})
    first = rows[0]
    labels = [ratio_label, *(f"{row['server']} / {first['server']}" for row in rows[2:])]
    for label, row in zip(labels, rows[1:], strict=True):
        rows.append({"server": label, **{
            k: round(row[k] / first[k], 2) if first[k] else None for k in ratio_keys}})
    return rows


def conversation(server, png: bytes, turns: int, max_tokens: int) -> list[dict]:
    """One user chatting about one image; every turn resends the whole history with the image."""
    body = image_chat(png, QUESTIONS[0], max_tokens=max_tokens, ignore_eos=True)
    outs = []
    for turn in range(turns):
        if turn:
            body["messages"].append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        outs.append(stream_chat(server, body))
        body["messages"].append({"role": "assistant", "content": outs[-1]["content"]})
    return outs


def workload_pool(image_px: int = 448) -> int:
    """About 6 uncompressed prompts of ``image_px`` images: the workload's pool binds."""
    return 6 * (visual_tokens(image_px) + 64)


def popular_images(images: int, conversations: int, zipf: float, seed: int) -> list[int]:
    """The image of each conversation, drawn with Zipf popularity over ``images`` (seeded: a
    longer draw starts with the shorter one)."""
    rng = random.Random(seed)
    return rng.choices(range(images), weights=[1 / (i + 1) ** zipf for i in range(images)],
                       k=conversations)


def converse(server, picks: list[int], turns: int, max_tokens: int,
             concurrency: int, image_px: int = 448) -> list[dict]:
    """Every conversation of ``picks`` on ``concurrency`` clients; each turn's output, in order."""
    with futures.ThreadPoolExecutor(max_workers=concurrency) as clients:
        convs = clients.map(
            lambda i: conversation(server, picture(i, image_px), turns, max_tokens), picks)
        return [out for conv in convs for out in conv]


def workload(model: Path, servers: dict[str, list[str]], log_dir: Path, *,
             ratio_label: str = "plugin / stock", images: int = 24,
             conversations: int = 48, turns: int = 3, concurrency: int = 8, zipf: float = 1.1,
             image_px: int = 448, max_tokens: int = 16, seed: int = 0) -> list[dict]:
    """Part 3 with ``image_px`` images (448: 256 visual tokens, 896: 1,024) in a pool of
    ``workload_pool(image_px)`` tokens."""
    picks = popular_images(images, conversations, zipf, seed)
    pool = workload_pool(image_px)

    def measure(server) -> dict:
        offset, start = len(server.log()), time.perf_counter()
        outs = converse(server, picks, turns, max_tokens, concurrency, image_px)
        wall = time.perf_counter() - start
        usage = [out["usage"] for out in outs]
        prompt = sum(u["prompt_tokens"] for u in usage)
        # Hit rate: the share of prompt tokens the scheduler did not prefill (its log); usage's
        # cached share beside it (the plugin counts a reused image as the tokens the user sent).
        prefilled = sum(logged(server, offset, r"Prefill batch.*?#new-token: (\d+)"))
        cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage)
        ttft = [1000 * out["times"][0] for out in outs]
        states = requests.get(f"{server.url}/server_info", timeout=30).json()["internal_states"]
        plugin = [s.get("unicache", {}) for s in states]
        compressed, escalations = (sum(p.get(key, 0) for p in plugin)
                                   for key in ("images_compressed", "escalations"))
        return {"pool_tokens": pool, "image_tokens": visual_tokens(image_px),
                "requests": len(outs), "prompt_tokens": prompt,
                "hit_rate": round(1 - prefilled / prompt, 3),
                "usage_cached_share": round(cached / prompt, 3),
                "ttft_p50_ms": round(percentile(ttft, 0.5)),
                "ttft_p99_ms": round(percentile(ttft, 0.99)),
                "output_tok_s": round(sum(u["completion_tokens"] for u in usage) / wall, 1),
                "requests_s": round(len(outs) / wall, 2), "images_compressed": compressed,
                "escalations": escalations}

    return on_each(model, servers, ["--max-total-tokens", str(pool)], log_dir / "workload",
                   measure, ["hit_rate", "ttft_p50_ms", "ttft_p99_ms", "output_tok_s",
                             "requests_s"], ratio_label)


def plugin_counts(before: dict, after: dict) -> dict:
    """What the plugin did between two ``/server_info`` reads (empty for stock SGLang): images
    compressed, self-check escalations and fallbacks, and KV slots freed by compaction."""
    keys = ("images_compressed", "escalations", "fallbacks", "slots_freed")
    return {k: after[k] - before.get(k, 0) for k in keys} if after else {}


def multi_image_bodies(batch: int, images: int, image_px: int, max_tokens: int) -> list[dict]:
    """``batch`` chat requests of ``images`` distinct pictures each and ``max_tokens`` outputs."""
    bodies = []
    for r in range(batch):
        body = image_chat(picture(1000 + images * r, image_px), "describe the picture",
                          max_tokens=max_tokens, ignore_eos=True)
        body["messages"][0]["content"][1:1] = [
            {"type": "image_url", "image_url": {"url": data_url(picture(1000 + k, image_px))}}
            for k in range(images * r + 1, images * r + images)]
        bodies.append(body)
    return bodies


def decode(model: Path, servers: dict[str, list[str]], log_dir: Path, *, batch: int = 8,
           images: int = 4, image_px: int = 896, max_tokens: int = 160) -> list[dict]:
    """Time per output token while all ``batch`` requests decode together: counted from the
    moment the last request got its first token (every prefill done) to the end of each
    request, so prefill stalls of requests still arriving stay out of it."""
    image_tokens = visual_tokens(image_px)
    bodies = multi_image_bodies(batch, images, image_px, max_tokens)

    def measure(server) -> dict:
        before = internal_state(server).get("unicache", {})
        with futures.ThreadPoolExecutor(max_workers=batch) as clients:
            outs = list(clients.map(lambda body: stream_chat(server, body, timeout=900), bodies))
        counts = plugin_counts(before, internal_state(server).get("unicache", {}))
        arrivals = [[o["sent"] + t for t in o["times"]] for o in outs]
        together = max(a[0] for a in arrivals)
        windows = [[t for t in a if t >= together] for a in arrivals]
        timed = min(len(w) for w in windows)
        if timed < 8:
            raise RuntimeError(f"the batch decoded together for under 8 tokens; raise max_tokens "
                               f"({max_tokens})")
        per_token = [(w[-1] - w[0]) / (len(w) - 1) for w in windows]
        return {"batch": batch, "visual_tokens": images * image_tokens,
                "prompt_tokens": outs[0]["usage"]["prompt_tokens"],
                "tokens_timed": timed,
                "decode_ms_per_token": round(1000 * sum(per_token) / len(per_token), 1),
                "ttft_p50_ms": round(1000 * percentile([o["times"][0] for o in outs], 0.5)),
                **counts}

    pool = batch * (images * image_tokens + 64 + max_tokens)
    extra = ["--max-total-tokens", str(pool), "--max-running-requests", str(batch)]
    return on_each(model, servers, extra, log_dir / "decode",
                   measure, ["decode_ms_per_token", "ttft_p50_ms"])


def run_batch(server, b: int, max_tokens: int) -> tuple[int, int]:
    """b concurrent distinct-image requests: (retractions, most requests decoding at once).

    Retractions are SGLang's per-request ``num_retractions`` (``return_meta_info``); the running
    batch size is read from the scheduler's ``Decode batch`` log lines (one per step with
    ``--decode-log-interval 1``) written while the batch ran.
    """
    flush_cache(server)
    offset = len(server.log())
    bodies = [image_chat(picture(2000 + 100 * b + i), "describe the picture",
                         max_tokens=max_tokens, ignore_eos=True, return_meta_info=True)
              for i in range(b)]
    with futures.ThreadPoolExecutor(max_workers=b) as clients:
        outs = list(clients.map(lambda body: chat(server, body, timeout=600), bodies))
    retractions = sum(out["choices"][0]["meta_info"]["num_retractions"] for out in outs)
    return retractions, max(logged(server, offset, r"Decode batch.*?#running-req: (\d+)"),
                            default=0)


def concurrency(model: Path, servers: dict[str, list[str]], log_dir: Path, *,
                pool: int = 8 * (IMAGE_TOKENS + 24), max_tokens: int = 64,
                max_batch: int = 64) -> list[dict]:
    # With ignore_eos SGLang reserves every request's whole output at admission, so a batch that
    # does not fit mostly waits in the queue rather than being retracted: both end the ramp.
    def measure(server) -> dict:
        largest, tried, b = 0, [], 2
        while b <= max_batch:
            retractions, running = run_batch(server, b, max_tokens)
            tried.append(f"{b}: {retractions} retracted, {running} together")
            if retractions or running < b:
                break
            largest, b = b, 2 * b
        return {"pool_tokens": pool, "max_tokens": max_tokens, "largest_batch": largest,
                "tried": "; ".join(tried)}

    extra = ["--max-total-tokens", str(pool), "--decode-log-interval", "1"]
    return on_each(model, servers, extra, log_dir / "concurrency", measure,
                   ["largest_batch"])


def streaming(model: Path, servers: dict[str, list[str]], log_dir: Path, *, batch: int = 4,
              images: int = 4, image_px: int = 896, max_tokens: int = 48) -> list[dict]:
    """What a streaming user sees: ``batch`` requests of ``images`` pictures sent at
    once, so later prefills land while earlier requests decode. Per request, the time per output
    token from its first token to its last (``tpot``: mean and worst request), and every gap
    between two tokens (``itl`` p50/p99 over all requests); with the plugin, compression time as
    a share of prefill time (the scheduler's own counters), and where the scheduler spent the
    run by phase (``scheduler_phases.py``, a py-spy sample). ``tpot`` starts at the first token,
    so a stall before it (SGLang's overlap loop streams a prefill's first token only after the
    next batch has run) is out of it and one after it is in: each request's first and last
    token (``first_last_s``, ``last_token_*``: seconds after sending) show where the time went.
    Each server's row carries its ratios to the first server (stock): ``tpot_vs_stock`` and
    ``last_token_vs_stock``."""
    bodies = multi_image_bodies(batch, images, image_px, max_tokens)
    pool = batch * (images * visual_tokens(image_px) + 64 + max_tokens)
    extra = ["--max-total-tokens", str(pool), "--max-running-requests", str(batch)]
    rows = []
    for i, (name, flags) in enumerate(servers.items()):
        with warmed(model, flags + extra, log_dir / f"streaming-{i}.log") as server:
            before = internal_state(server).get("unicache", {})
            sampler = scheduler_phases.record(server, log_dir / f"streaming-{i}.pyspy")
            try:
                with futures.ThreadPoolExecutor(max_workers=batch) as clients:
                    outs = list(clients.map(partial(stream_chat, server, timeout=900), bodies))
            finally:
                scheduler_phases.stop(sampler)
            after = internal_state(server).get("unicache", {})
        tpot = [(o["times"][-1] - o["times"][0]) / (len(o["times"]) - 1) for o in outs]
        gaps = [b - a for o in outs for a, b in zip(o["times"], o["times"][1:], strict=False)]
        last = [o["times"][-1] for o in outs]
        row = {"server": name, "tpot_ms": round(1000 * sum(tpot) / len(tpot), 1),
               "tpot_worst_ms": round(1000 * max(tpot), 1),
               "itl_p50_ms": round(1000 * percentile(gaps, 0.5), 1),
               "itl_p99_ms": round(1000 * percentile(gaps, 0.99), 1),
               "ttft_p50_ms": round(1000 * percentile([o["times"][0] for o in outs], 0.5)),
               "ttft_mean_s": round(sum(o["times"][0] for o in outs) / len(outs), 1),
               "last_token_mean_s": round(sum(last) / len(last), 1),
               "last_token_worst_s": round(max(last), 1),
               # Each request's (first token, last token), seconds after sending, in the order
               # the requests got their first token: where a stall sits, before or after it.
               "first_last_s": sorted([round(o["times"][0], 1), round(o["times"][-1], 1)]
                                      for o in outs)}
        row |= plugin_counts(before, after)
        if after:
            prefill = after["prefill_seconds"] - before.get("prefill_seconds", 0.0)
            compress = after["compress_seconds"] - before.get("compress_seconds", 0.0)
            row["compress_share_of_prefill"] = round(compress / max(prefill, 1e-9), 3)
        row["scheduler_phases"] = scheduler_phases.phases(log_dir / f"streaming-{i}.pyspy")
        rows.append(row)
        print(json.dumps(row), flush=True)  # a long run keeps what it measured if stopped
    for row in rows:
        row["tpot_vs_stock"] = round(row["tpot_ms"] / rows[0]["tpot_ms"], 2)
        row["last_token_vs_stock"] = round(row["last_token_mean_s"]
                                           / rows[0]["last_token_mean_s"], 2)
    return rows
