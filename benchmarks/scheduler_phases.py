"""Where a server's scheduler spends its time, by phase, from a py-spy sample.

``record(server, seconds)`` starts ``py-spy record`` on the server's scheduler process (the child
named ``sglang::scheduler``) in raw (collapsed-stack) form; ``phases(path)`` reads the file and
splits the samples by the first phase found walking each stack from its root. A phase is named by
the functions that mark it:

- vision encoder: the image tower's forward (``get_image_feature``);
- prefill forward / decode forward: the model's forward by mode, the encoder excepted;
- batch set-up: the rest of ``run_batch`` (positions, batch tensors);
- compression: the plugin's policy and compaction (``on_checkpoint``);
- multimodal inputs: hashing and unpacking the processor output (``_get_multimodal_inputs``);
- scheduling: building the next batch, prefix matching included (``get_next_batch_to_run``);
- results: ``process_batch_result`` minus the compression inside it;
- idle: the scheduler waiting for requests;
- other: the rest (request intake, logging, ...).

py-spy samples every thread with ``--idle`` on; only the main thread's samples (under
``run_scheduler_process``: the loop and every forward) are counted, so the shares add up to the
recorded wall time of the scheduler loop.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import psutil

MAIN = "run_scheduler_process"  # the scheduler's main thread: its loop and every forward

# (phase, marker) in priority order: the first marker found anywhere in a stack names its phase.
MARKERS = [
    ("compression", "on_checkpoint"),
    ("vision encoder", "get_image_feature"),
    ("multimodal inputs", "_get_multimodal_inputs"),
    ("decode forward", "_execute_decode"),
    ("prefill forward", "_execute_extend"),
    ("decode forward", "forward_decode"),
    ("prefill forward", "forward_extend"),
    ("scheduling", "get_next_batch_to_run"),
    ("results", "process_batch_result"),
    ("batch set-up", "run_batch"),  # around the forward: positions, batch tensors
    ("idle", "recv_requests"),
    ("idle", "sleep"),
]


def scheduler_pid(server) -> int:
    for child in psutil.Process(server.process.pid).children(recursive=True):
        if "scheduler" in " ".join(child.cmdline()) or "scheduler" in child.name():
            return child.pid
    raise RuntimeError("no sglang::scheduler process under the server")


def record(server, out: Path, seconds: int = 3600) -> subprocess.Popen:
    """Start sampling the scheduler into ``out``; stop it with ``stop(proc)``."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    out.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [py_spy, "record", "-p", str(scheduler_pid(server)), "-f", "raw", "-o", str(out),
         "-d", str(seconds), "--idle", "--nonblocking", "-r", "50"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop(proc: subprocess.Popen) -> None:
    """End the recording (py-spy writes its file on SIGINT)."""
    proc.send_signal(2)
    proc.wait(timeout=120)


def phases(path: Path) -> dict[str, float]:
    """Share of the samples in each phase (summing to 1), from a py-spy raw file."""
    counts: Counter[str] = Counter()
    for line in Path(path).read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        if not any(MAIN in frame for frame in frames):
            continue  # another thread of the process (watchdog, progress bars)
        phase = next((name for name, marker in MARKERS
                      if any(marker in frame for frame in frames)), "other")
        counts[phase] += int(n)
    total = sum(counts.values()) or 1
    return {name: round(n / total, 3) for name, n in counts.most_common()}


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(path, phases(Path(path)))
