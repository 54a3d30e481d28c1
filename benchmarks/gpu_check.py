"""The GPU check: one command for the day a GPU is lent, and its dry run on the CPU platform.

    python -m benchmarks.gpu_check --out runs/gpu-check.json          # on a CUDA machine
    python -m benchmarks.gpu_check --dry --out runs/gpu-check.json    # here (tests call it)

It builds its models (random Qwen2-VL checkpoints, no download) and, per attention backend
(on a GPU: ``fa3``, ``flashinfer`` and ``triton``; dry: ``torch_native``; ``trtllm_mha``, the
default on Blackwell, reads the pool heads-first and ``--unicache`` refuses it,
``engine/support.py``), with SGLang's defaults otherwise (CUDA graphs on where the platform has
them):

1. **identity**: ``--unicache --unicache-keep-ratio 1.0`` answers three image chats token for
   token as stock SGLang does;
2. **compression**: keep 0.1 with the self-check off compresses every image, frees slots, a second
   question about each image is served from the cache (recalled from its host copy or reused, no
   image encoded again; its TTFT and the bytes the recalls loaded are recorded), and
   ``check_integrity`` finds nothing; then the same at ``--page-size 16`` (``compression_paged``:
   each image keeps up to 15 entries more, to end on a page);

then once:

3. **kernels**: each Triton kernel against its torch reference (the window column sums in fp32 and
   bf16, the compaction scatter); dry: interpreted (``TRITON_INTERPRET=1``) on the CPU;
4. **decode**: time per output token of stock and keep 0.1 while a batch decodes together
   (on a GPU 8 requests with 4 x 1,024 image tokens each; dry: 2 requests, 1 x 64).

Steps run one at a time (on a GPU each server takes most of the device's memory); ``--jobs N``
runs up to N side by side where servers can share the machine (the dry run: its test passes 3).
It writes one JSON (every step's numbers and verdict, ``ok`` overall) and exits 1 if a step
failed. On a GPU machine run it with ``SGLANG_PLATFORM`` empty so SGLang picks CUDA (the script
sets it so unless ``--dry``). The plugin warms its kernels at server start
(``policy.kernels.warm_up``), so the first compressing request does not compile them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path

GPU_BACKENDS = ("fa3", "flashinfer", "triton")
PAGE = 16  # the paged leg's --page-size
DRY_BACKENDS = ("torch_native",)
CHATS = [((200, 30, 30), "what colour is it?"), ((30, 200, 30), "describe the picture"),
         ((30, 30, 200), "is there a square?")]

KERNELS = """
import json, torch
from sglang_unicache.policy.kernels.reference import window_colsum, window_lse
from sglang_unicache.policy.kernels.scatter import scatter_rows_reference, scatter_rows_triton
from sglang_unicache.policy.kernels.window_score import window_colsum_triton
device = {device!r}
g = torch.Generator().manual_seed(0)
out = {{}}
for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
    q = torch.randn(6, 4, 32, generator=g).to(device, dtype)
    k = torch.randn(300, 2, 32, generator=g).to(device, dtype)
    pos = torch.arange(294, 300, device=device)
    lse = window_lse(q, k, 0.2, pos)
    ref = window_colsum(q.cpu(), k.cpu(), 0.2, pos.cpu(), lse.cpu())
    got = window_colsum_triton(q, k, 0.2, pos, lse).cpu()
    out["window_colsum_" + name] = float((got - ref).abs().max() / ref.abs().max())
dst = torch.randn(64, 2, 16, generator=g).to(device, torch.bfloat16)
src = torch.randn(16, 2, 16, generator=g).to(device)
slots = torch.randperm(64, generator=g)[:16].to(device)
want = dst.clone()
scatter_rows_reference(want, slots, src)
got = dst.clone()
scatter_rows_triton(got, slots, src)
out["scatter_rows_equal"] = bool(torch.equal(got.cpu(), want.cpu()))
print(json.dumps(out))
"""
KERNEL_TOLERANCE = {"window_colsum_fp32": 1e-4, "window_colsum_bf16": 3e-2}


def workspace(out: str) -> tuple[Path, Path, Path]:
    """(a new scratch folder, the logs folder beside ``out``, a policy config with the self-check
    off in the scratch folder): what a GPU script's steps share."""
    work = Path(tempfile.mkdtemp())
    logs = Path(out).with_suffix("")
    logs.mkdir(parents=True, exist_ok=True)
    config = work / "nocheck.json"
    config.write_text(json.dumps({"selfcheck": False}))
    return work, logs, config


def backends(dry: bool) -> list[str]:
    return list(DRY_BACKENDS if dry else GPU_BACKENDS)


def answers(server, max_tokens: int = 8) -> list[str]:
    from tests.support.client import answer, chat
    from tests.support.images import image_chat, solid_png

    return [answer(chat(server, image_chat(solid_png(colour), question, max_tokens=max_tokens)))
            for colour, question in CHATS]


def identity(model: Path, backend: str, logs: Path) -> dict:
    from tests.support.server import start_server

    got = {}
    for name, flags in (("stock", []), ("keep 1.0", ["--unicache", "--unicache-keep-ratio",
                                                       "1.0"])):
        server = start_server(model, ["--attention-backend", backend, *flags],
                              logs / f"identity-{backend}-{name.replace(' ', '')}.log")
        try:
            got[name] = answers(server)
        finally:
            server.stop()
    return {"ok": got["stock"] == got["keep 1.0"], "stock": got["stock"],
            "unicache": got["keep 1.0"]}


def compression(model: Path, backend: str, config: Path, logs: Path, image_tokens: int,
                page: int = 1) -> dict:
    from tests.support.client import (
        available_slots,
        chat,
        flush_cache,
        internal_state,
        stream_chat,
    )
    from tests.support.images import image_chat, solid_png
    from tests.support.server import start_server

    flags = ["--attention-backend", backend, "--unicache", "--unicache-keep-ratio", "0.1",
             "--unicache-config", str(config), "--enable-cache-report", "--page-size", str(page)]
    server = start_server(model, flags, logs / f"compression-{backend}-page{page}.log")
    try:
        flush_cache(server)
        free = available_slots(server)
        for colour, question in CHATS:
            chat(server, image_chat(solid_png(colour), question, max_tokens=4))
        held = free - available_slots(server)
        first = internal_state(server)["unicache"]
        later = [stream_chat(server, image_chat(solid_png(colour), "and now?", max_tokens=4))
                 for colour, _ in CHATS]
        cached = [out["usage"]["prompt_tokens_details"]["cached_tokens"] for out in later]
        state = internal_state(server)["unicache"]
    finally:
        server.stop()
    served = state["spans_recalled"] + state["spans_reused"]
    row = {"images_compressed": first["images_compressed"], "slots_held": held,
           "compressed_slots_held": first["compressed_slots_held"],
           "later_questions_served_from_cache": served,
           "images_encoded": state["images_prefilled"], "cached_tokens": cached,
           "later_ttft_ms": [round(1000 * out["times"][0], 1) for out in later],
           "recall_bytes": state["recall_bytes"], "spans_recalled": state["spans_recalled"],
           "integrity": state["integrity"]}
    # Paged, an image keeps up to a page less one more than its budget (its end on a page).
    kept_at_most = (0.15 * image_tokens + page - 1) * len(CHATS)
    row["ok"] = (first["images_compressed"] == len(CHATS)
                 and first["compressed_slots_held"] <= kept_at_most
                 and served == len(CHATS) and state["images_prefilled"] == len(CHATS)
                 and all(c >= image_tokens for c in cached) and not state["integrity"])
    return row


def kernels(dry: bool) -> dict:
    env = {**os.environ, **({"TRITON_INTERPRET": "1"} if dry else {})}
    script = KERNELS.format(device="cpu" if dry else "cuda")
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=600)
    if res.returncode != 0:
        return {"ok": False, "error": res.stderr[-2000:]}
    errors = json.loads(res.stdout.strip().splitlines()[-1])
    ok = errors["scatter_rows_equal"] and all(errors[k] <= tol
                                              for k, tol in KERNEL_TOLERANCE.items())
    return {"ok": ok, **errors}


def decode(dry: bool, work: Path, config: Path, logs: Path) -> dict:
    from benchmarks.perf import DECODE_MODEL, flags_for
    from benchmarks.perf_workload import decode as decode_part
    from tests.support.tiny_vlm import build_tiny_qwen2_vl

    shape = ({"image_size": 224} if dry else DECODE_MODEL)
    model = build_tiny_qwen2_vl(work / "decode-model", **shape)
    servers = {"stock": flags_for(None, 0.1, config),
               "unicache keep 0.1": flags_for("unicache", 0.1, config)}
    kw = ({"batch": 2, "images": 1, "image_px": 224, "max_tokens": 24} if dry
          else {"batch": 8, "images": 4, "image_px": 896, "max_tokens": 160})
    rows = decode_part(model, servers, logs, **kw)
    ratio = rows[-1]["decode_ms_per_token"]
    return {"ok": rows[1].get("images_compressed", 0) > 0, "rows": rows,
            "decode_vs_stock": ratio}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true",
                        help="the CPU platform: torch_native, small shapes, kernels interpreted")
    parser.add_argument("--backends", default="", help="comma-separated (default: all there)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="steps run side by side (default 1; only where servers share the "
                             "machine, e.g. --dry)")
    parser.add_argument("--out", default="runs/gpu-check.json")
    args = parser.parse_args()
    if not args.dry:
        os.environ["SGLANG_PLATFORM"] = ""  # SGLang picks CUDA
    from tests.support.server import forking_servers
    from tests.support.tiny_vlm import build_tiny_qwen2_vl

    start = time.perf_counter()
    work, logs, config = workspace(args.out)
    model = build_tiny_qwen2_vl(work / "model")  # 224 px: 64 visual tokens an image
    names = args.backends.split(",") if args.backends else backends(args.dry)
    # The longest steps first (decode and identity start two servers each), so side by side they
    # finish together.
    jobs = {(None, "decode"): lambda: decode(args.dry, work, config, logs)}
    for backend in names:
        jobs[backend, "identity"] = lambda b=backend: identity(model, b, logs)
        jobs[backend, "compression"] = lambda b=backend: compression(model, b, config, logs,
                                                                     image_tokens=64)
        jobs[backend, "compression_paged"] = lambda b=backend: compression(
            model, b, config, logs, image_tokens=64, page=PAGE)
    jobs[None, "kernels"] = lambda: kernels(args.dry)
    # The dry run forks its servers from one process that imported SGLang (the tests' harness).
    with (forking_servers(logs / "zygote.log") if args.dry else nullcontext()), \
            ThreadPoolExecutor(max(1, args.jobs)) as pool:
        done = {key: pool.submit(fn) for key, fn in jobs.items()}
    result: dict = {"dry": args.dry, "backends": {b: {} for b in names}}
    for (backend, step), future in done.items():
        (result if backend is None else result["backends"][backend])[step] = future.result()
    steps = [s for b in result["backends"].values() for s in b.values()]
    steps += [result["kernels"], result["decode"]]
    result["ok"] = all(step["ok"] for step in steps)
    result["seconds"] = round(time.perf_counter() - start)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({"ok": result["ok"], "seconds": result["seconds"],
                      "failed": [name for name, s in (
                          [(f"{b}:{k}", v) for b, d in result["backends"].items()
                           for k, v in d.items()]
                          + [("kernels", result["kernels"]), ("decode", result["decode"])])
                          if not s["ok"]]}))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
