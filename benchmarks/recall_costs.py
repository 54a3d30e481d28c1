"""What a recall costs, against stock SGLang in the same run (``perf.py --parts recall``).

A reuse request is a later question about an image an earlier request asked about. Each row
serves the same sequence: for each image, a first question (warms the cache), a filler request
about another image, then the measured later question (streamed, 16 output tokens). Rows:

- stock, image resident: the later question's prefix is on the device;
- the same with SGLang's image preprocessing cache, which ``--unicache`` turns on: the repeated
  image skips the image processor, as the plugin's rows do;
- stock + HiCache, image loaded back: a pool that holds one image, so the filler moves the first
  image to HiCache's host tier and the later question loads its full span back;
- the plugin with host copies (self-check off, and the defaults as shipped): the later question
  loads the image's host copy, is prefilled over all of it, and compresses its own view;
- the plugin with host copies off: the later question decodes on the shared compressed span.

Per row: median TTFT and time per output token of the later questions, what usage reports
cached, and the bytes a reuse moves host to device (the plugin's ``recall_bytes`` per recall;
for HiCache the span's bytes in the pool's dtype). On the CPU platform a load-back is a memory
copy; ``gpu_load_ms`` is those bytes over a PCIe 5.0 x16 link's 64 GB/s, an estimate, not a
measurement.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchmarks.perf_workload import STOCK_CACHED, only_rows, picture, visual_tokens
from tests.support.client import chat, flush_cache, internal_state, stream_chat
from tests.support.images import image_chat
from tests.support.server import start_server

PCIE_BYTES_S = 64e9  # PCIe 5.0 x16, one direction, nominal
OUTPUT_TOKENS = 16


def kv_bytes_per_token(model: Path) -> int:
    """Bytes of one token's bf16 KV over every layer of ``model``."""
    cfg = json.loads((model / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * heads * head_dim * 2


def recall_servers(config_nocheck: Path, config_nocopies: Path, image_px: int,
                   ratio: float = 0.1) -> dict[str, list[str]]:
    tokens = visual_tokens(image_px)
    one_image = str(int(1.6 * (tokens + 64)))
    plugin = ["--unicache", "--unicache-keep-ratio", str(ratio), "--enable-cache-report"]
    return {
        "stock, image resident": ["--enable-cache-report"],
        **STOCK_CACHED,
        "stock + HiCache, image loaded back": [
            "--enable-cache-report", "--enable-hierarchical-cache", "--hicache-ratio", "4",
            "--max-total-tokens", one_image],
        f"unicache keep {ratio}, host copies int8 (self-check off)":
            [*plugin, "--unicache-config", str(config_nocheck)],
        f"--unicache --unicache-keep-ratio {ratio} (defaults as shipped)": plugin,
        f"unicache keep {ratio}, host copies off (self-check off)":
            [*plugin, "--unicache-config", str(config_nocopies)],
    }


def later_questions(server, images: int, image_px: int) -> dict:
    """The warm, filler, later-question sequence on ``images`` images; the later questions'
    medians and what the plugin counted."""
    flush_cache(server)
    ttft, tpot, cached = [], [], []
    before = internal_state(server).get("unicache", {})
    for i in range(images):
        chat(server, image_chat(picture(300 + i, image_px), "what colour is it?", max_tokens=2))
        chat(server, image_chat(picture(900 + i, image_px), "what colour is it?", max_tokens=2))
        out = stream_chat(server, image_chat(picture(300 + i, image_px), "describe the picture",
                                             max_tokens=OUTPUT_TOKENS, ignore_eos=True))
        times = out["times"]
        ttft.append(1000 * times[0])
        tpot.append(1000 * (times[-1] - times[0]) / max(1, len(times) - 1))
        cached.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
    after = internal_state(server).get("unicache", {})

    def delta(key: str) -> int:
        return after.get(key, 0) - before.get(key, 0)

    return {"ttft_ms": round(statistics.median(ttft), 1),
            "tpot_ms": round(statistics.median(tpot), 2),
            "cached_tokens": statistics.median(cached),
            "recalls": delta("spans_recalled"), "recall_bytes": delta("recall_bytes"),
            "images_compressed": delta("images_compressed"),
            "loaded_back": delta("spans_loaded_back")}


def recall_costs(model: Path, config: Path, log_dir: Path, *, images: int = 6,
                 image_px: int = 448, extra: list[str] | None = None,
                 only: str = "") -> list[dict]:
    """The rows of the module docstring, then each row's ratio to stock with the image
    resident. ``extra``: flags added to every server (the bytes columns assume bf16 KV);
    ``only``: stock resident and the servers whose name holds one of these comma-separated
    strings (``perf_workload.only_rows``)."""
    nocheck = config.with_name("policy-recall.json")
    nocheck.write_text(json.dumps({"selfcheck": False}))
    nocopies = config.with_name("policy-no-copies.json")
    nocopies.write_text(json.dumps({"selfcheck": False, "host_copies": "off"}))
    per_token = kv_bytes_per_token(model)
    tokens = visual_tokens(image_px)
    rows = []
    servers = only_rows(list(recall_servers(nocheck, nocopies, image_px).items()), only)
    for i, (name, flags) in enumerate(servers):
        server = start_server(model, [*flags, *(extra or [])], log_dir / f"recall-{i}.log")
        try:
            chat(server, image_chat(picture(65_000, image_px), "what colour is it?",
                                    max_tokens=2))
            row = {"server": name, **later_questions(server, images, image_px)}
        finally:
            server.stop()
        moved = row["recall_bytes"] / row["recalls"] if row["recalls"] else 0
        if "HiCache" in name:
            moved = tokens * per_token if row["loaded_back"] or row["cached_tokens"] else 0
        row["bytes_per_reuse"] = round(moved)
        row["gpu_load_ms"] = round(1000 * moved / PCIE_BYTES_S, 3)
        rows.append(row)
    base = rows[0]
    for row in rows[1:]:
        rows.append({"server": f"{row['server']} / stock resident",
                     "ttft_ms": round(row["ttft_ms"] / base["ttft_ms"], 2),
                     "tpot_ms": round(row["tpot_ms"] / base["tpot_ms"], 2)})
    rows.append({"server": "full bf16 KV of one image", "bytes_per_reuse": tokens * per_token})
    return rows
