"""Render ``BENCHMARKS.md`` from the measured parts in ``benchmarks/results/*.json``.

Each part file holds one measurement as it stands: a title, the stamp of the commit that added
its data (date, SGLang and torch versions, machine), the exact command, the configuration, the
tables of numbers and a few notes. A table measured in another run than its part carries its own
``stamp`` and ``command`` (and may carry a ``config``). Optional: ``figures`` (images shown after
the notes) and ``raw`` (``<commit>:<path>`` of the raw per-request results in git, not rendered).
Superseded runs are not kept here: git has them. A unit test (``tests/unit/test_benchmarks_doc.py``)
fails when the committed file is stale or a part lacks a stamp field or a command. Run from the
repository root:

    python -m tools.benchmarks_doc > BENCHMARKS.md

``python -m tools.benchmarks_doc --stamp`` prints the stamp of the current checkout and machine,
to put into a part file measured there.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"

# The order of the parts in BENCHMARKS.md: what a user gets first, then memory and capacity, the
# workloads and timings, scale-out, the second task and the self-check, the micro-benchmarks.
PARTS = (
    "defaults-as-shipped",
    "recall",
    "quality",
    "quality-transformers",
    "keep-001",
    "memory",
    "capacity",
    "capacity-hicache",
    "hicache-quality",
    "serving-client",
    "workload-large",
    "workload",
    "decode",
    "streaming",
    "overhead",
    "concurrency",
    "workload-dp",
    "tp-agreement",
    "grid-task",
    "grid-task-shipped",
    "selfcheck-study",
    "policy-speed",
    "vision-attention",
    "bookkeeping",
)

STAMP_FIELDS = ("commit", "date", "sglang", "torch", "machine")
PART_FIELDS = ("title", "stamp", "command", "config", "tables", "notes")

HEADER = """\
# Benchmarks

Generated from `benchmarks/results/*.json` by `python -m tools.benchmarks_doc > BENCHMARKS.md`;
do not edit by hand: change a part file and regenerate (`tests/unit/test_benchmarks_doc.py`
fails when this file is stale). Each part's numbers were measured at the commit its stamp names,
a table with a stamp of its own at that one; `git show <commit>` has the code, and a part file's
`raw` names the raw per-request results a run wrote, in git at that commit. The torch version is
that of the project's environment (`make setup`), not recorded by the runs themselves.

Every part ran on the CPU platform (`unicache_cpu`) of a shared 2-core machine with no GPU:
absolute times move from run to run, so read the ratios against stock SGLang measured in the same
run. Which CPU a run drew matters more than the load: where it has no native bf16 matrix multiply
(AVX2 only, as the stamps from `cpu_kind` say), a bf16 server's GEMMs run about 7x slower than in
fp32 and every server, stock included, is bound by them. The platform's prefill attention after a
cached prefix computes the new rows only (`platform/cpu/extend_attention.py`, as a GPU kernel
does); a table whose caption does not say so ran SGLang's own `torch_native` extend, which
recomputes the cached prefix's attention: prefix `UNICACHE_CPU_EXTEND_ROWS=0` to its command to
reproduce it. "Defaults as shipped" is `--unicache`
and nothing else (method `unicache`, keep 0.1, the self-check on, each request's view bounded at
0.15x of its image); wherever a part measured them they have their own row. The bound is the
default since commit a609a28: a "defaults as shipped" row stamped before it ran the view's ladder
unbounded (what `view_max_keep: 0` gives now) unless it says otherwise, and "Defaults as shipped"
lists the tables re-run with it. The random-weight models of the performance parts are not the
trained ones: their attention says nothing about quality, and the unbounded ladder's self-check
escalated on them where it does not on the trained model. No GPU numbers yet:
the same scripts run on one with `SGLANG_PLATFORM= make bench` and `SGLANG_PLATFORM= make
quality` (an empty `SGLANG_PLATFORM` lets SGLang pick CUDA), `make gpu-check` checks every
attention backend there in one command (`benchmarks/gpu_check.py`), and `make gpu-targets` runs
the timings this CPU cannot decide (the compression's share of the prefill, SGLang's client with
the pool free and bound, a recall's TTFT, the multi-turn chats on the 2B language model) against
stock in one command with a verdict per target (`benchmarks/gpu_targets.py`); the dry runs of
both are tested here.
"""


class PartError(ValueError):
    """A part file that cannot be rendered: a field missing, empty or malformed."""


def _check_stamp(stamp, where: str) -> None:
    if not isinstance(stamp, dict):
        raise PartError(f"{where}: stamp must be an object with {', '.join(STAMP_FIELDS)}")
    for field in STAMP_FIELDS:
        if not isinstance(stamp.get(field), str) or not stamp[field].strip():
            raise PartError(f"{where}: stamp lacks {field!r}")
    if not re.fullmatch(r"[0-9a-f]{7,40}", stamp["commit"]):
        raise PartError(f"{where}: stamp commit {stamp['commit']!r} is not a commit hash")
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", stamp["date"]):
        raise PartError(f"{where}: stamp date {stamp['date']!r} is not YYYY-MM-DD")


def _check_cell(cell, where: str) -> None:
    if not isinstance(cell, str) or "|" in cell or "\n" in cell:
        raise PartError(f"{where}: a cell must be one line of text without '|': {cell!r}")


def validate(part: dict, name: str) -> None:
    """Raise ``PartError`` unless ``part`` has every field the rendering needs."""
    for field in PART_FIELDS:
        if field not in part:
            raise PartError(f"{name}: lacks {field!r}")
    _check_stamp(part["stamp"], name)
    for field in ("title", "command", "config"):
        if not isinstance(part[field], str) or not part[field].strip():
            raise PartError(f"{name}: {field!r} must be non-empty text")
    if not isinstance(part["notes"], list) or not part["notes"] or not all(
            isinstance(note, str) and note.strip() for note in part["notes"]):
        raise PartError(f"{name}: 'notes' must be a list of non-empty sentences")
    if not isinstance(part["tables"], list) or not part["tables"]:
        raise PartError(f"{name}: 'tables' must be a non-empty list")
    for i, table in enumerate(part["tables"]):
        where = f"{name}, table {i + 1}"
        for field in ("caption", "columns", "rows"):
            if field not in table:
                raise PartError(f"{where}: lacks {field!r}")
        if "stamp" in table:
            _check_stamp(table["stamp"], where)
        for field in ("command", "config"):
            if field in table and (not isinstance(table[field], str)
                                   or not table[field].strip()):
                raise PartError(f"{where}: {field!r} must be non-empty text")
        if not table["columns"] or not table["rows"]:
            raise PartError(f"{where}: needs columns and rows")
        for cell in table["columns"]:
            _check_cell(cell, where)
        for row in table["rows"]:
            if len(row) != len(table["columns"]):
                raise PartError(f"{where}: row {row!r} has {len(row)} cells, "
                                f"not {len(table['columns'])}")
            for cell in row:
                _check_cell(cell, where)


def load(results: Path = RESULTS) -> dict[str, dict]:
    """Every part of ``PARTS``, validated; a file in ``results`` that is not listed is an error."""
    found = {path.stem for path in results.glob("*.json")}
    if found - set(PARTS):
        raise PartError(f"not in tools.benchmarks_doc.PARTS: {sorted(found - set(PARTS))}")
    if set(PARTS) - found:
        raise PartError(f"missing from {results}: {sorted(set(PARTS) - found)}")
    parts = {}
    for name in PARTS:
        part = json.loads((results / f"{name}.json").read_text())
        validate(part, name)
        parts[name] = part
    return parts


WIDTH = 100
# A word that would open a list, a quote, a heading or a table if a wrapped line began with it.
BLOCK_START = re.compile(r"[-+*]|>.*|#.*|\|.*|=+|\d+[.)]")


def wrap(text: str, first: str = "", rest: str = "") -> list[str]:
    """``text`` in lines of at most ``WIDTH`` characters where it can be (``first`` and ``rest``
    prefix the first and the other lines), no line starting with a word Markdown would read as
    the start of another block."""
    lines, prefix, words = [], first, []
    for word in text.split():
        line = prefix + " ".join([*words, word])
        if words and len(line) > WIDTH and not BLOCK_START.fullmatch(word):
            lines.append(prefix + " ".join(words))
            prefix, words = rest, []
        words.append(word)
    return lines + [prefix + " ".join(words)]


def stamp_line(stamp: dict) -> list[str]:
    return wrap(f"Measured at commit `{stamp['commit']}` ({stamp['date']}); SGLang "
                f"{stamp['sglang']}, torch {stamp['torch']}; {stamp['machine']}.")


def code(command: str) -> list[str]:
    return ["```bash", command, "```"]


def render_table(table: dict) -> list[str]:
    lines = wrap(f"**{table['caption']}**") + [""]
    if "stamp" in table:
        lines += stamp_line(table["stamp"]) + [""]
    if "command" in table:
        lines += code(table["command"]) + [""]
    if "config" in table:
        lines += wrap(table["config"]) + [""]
    lines.append("| " + " | ".join(table["columns"]) + " |")
    lines.append("|" + " --- |" * len(table["columns"]))
    lines += ["| " + " | ".join(row) + " |" for row in table["rows"]]
    return lines + [""]


def render_part(part: dict) -> list[str]:
    lines = [f"## {part['title']}", ""] + stamp_line(part["stamp"]) + [""]
    lines += code(part["command"]) + [""] + wrap(part["config"]) + [""]
    for table in part["tables"]:
        lines += render_table(table)
    for note in part["notes"]:
        lines += wrap(note, "- ", "  ")
    for path in part.get("figures", ()):
        lines += ["", f"![{Path(path).stem}]({path})"]
    return lines + [""]


def render(results: Path = RESULTS) -> str:
    parts = load(results)
    lines = HEADER.splitlines() + [""]
    for name in PARTS:
        lines += render_part(parts[name])
    return "\n".join(lines).rstrip("\n") + "\n"


def _git(*args: str) -> str:
    return subprocess.check_output(["git", *args], text=True).strip()


def cpu_kind(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model and its widest matrix path, from ``/proc/cpuinfo``: without AVX-512 BF16
    or AMX, torch's bf16 matrix multiplies run several times slower than fp32 (about 7x on an
    AVX2-only EPYC), so a bf16 server's speed depends on which CPU the run drew."""
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return "unknown CPU"
    first = {}  # the first CPU's fields
    for line in lines:
        name, _, value = line.partition(":")
        first.setdefault(name.strip(), value.strip())
    model = first.get("model name", "unknown CPU")
    flags = set(first.get("flags", "").split())
    if flags & {"amx_bf16", "avx512_bf16"}:
        return f"{model}, native bf16 matmul"
    widest = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{model}, {widest}, no native bf16 matmul"


def current_stamp() -> dict:
    """The stamp of a run made now, on this checkout and machine."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    accelerator, torch_version = "no GPU (unicache_cpu platform)", metadata.version("torch")
    try:
        import torch

        torch_version = torch.__version__  # with its local tag (+cu130), as the stamps have it
        if torch.cuda.is_available():
            accelerator = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return {"commit": _git("rev-parse", "--short=7", "HEAD"),
            "date": _git("log", "-1", "--format=%ad", "--date=short"),
            "sglang": metadata.version("sglang"), "torch": torch_version,
            "machine": f"{os.cpu_count()}-core {platform.machine()} CPU ({cpu_kind()}), "
                       f"{memory:.0f} GB, {accelerator}"}


if __name__ == "__main__":
    if sys.argv[1:] == ["--stamp"]:
        print(json.dumps(current_stamp(), indent=1))
    else:
        print(render(), end="")
