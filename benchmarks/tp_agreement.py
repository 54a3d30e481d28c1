"""Every method at ``--tp-size 2`` against ``--tp-size 1`` on the bundled trained model.

    python -m benchmarks.tp_agreement [--methods all] [--images 4] [--turns 2] [--out PATH]

For each method, self-check on (the shipped threshold) and off, it serves the demo's multi-turn
chats once per TP size and compares the answers token for token, the images compressed,
escalated and kept in full, the slots held and the spans reused; at TP = 2 it also reads the
ranks' agreement check (``rank_disagreements``, the integrity list). Two server starts per row;
all methods, both settings: 40 starts, about half an hour on 2 cores. The suite runs two rows
(``tests/engine/test_tensor_parallel.py``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from examples.demo import BUNDLED, conversations, run
from sglang_unicache.policy.registry import known_methods
from tests.support.client import flush_cache, internal_state
from tests.support.server import start_server

KEYS = ("images_compressed", "escalations", "fallbacks", "compressed_slots_held", "spans_reused")


def serve(flags: list[str], log: Path, chats, env: dict[str, str] | None = None
          ) -> tuple[list[str], dict]:
    server = start_server(BUNDLED, ["--unicache", *flags, "--enable-cache-report"], log,
                          env=env)
    try:
        flush_cache(server)
        rows = run(server.url, chats, "tp")
        return [r["answer"] for r in rows], internal_state(server)["unicache"]
    finally:
        server.stop()


def compare(method: str, selfcheck: bool, chats, logs: Path) -> dict:
    flags = ["--unicache-method", method]
    if not selfcheck:
        config = logs / "nocheck.yaml"
        config.write_text("selfcheck: false\n")
        flags += ["--unicache-config", str(config)]
    name = f"{method}-{'check' if selfcheck else 'nocheck'}"
    one, s1 = serve(flags, logs / f"{name}-tp1.log", chats)
    two, s2 = serve([*flags, "--tp-size", "2"], logs / f"{name}-tp2.log", chats)
    return {"method": method, "selfcheck": selfcheck, "answers": len(one),
            "answers_equal": sum(a == b for a, b in zip(one, two, strict=True)),
            "tp1": {k: s1[k] for k in KEYS}, "tp2": {k: s2[k] for k in KEYS},
            "rank_disagreements": s2["rank_disagreements"], "integrity": s2["integrity"]}


def command(args) -> str:
    return (f"python -m benchmarks.tp_agreement --methods {args.methods} --selfcheck "
            f"{args.selfcheck} --images {args.images} --turns {args.turns}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="all", help="comma-separated, or all")
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--selfcheck", default="on,off", help="on, off or on,off")
    parser.add_argument("--out", type=Path, default=Path("runs/tp-agreement.json"))
    args = parser.parse_args()
    methods = known_methods() if args.methods == "all" else args.methods.split(",")
    chats = conversations(args.images, args.turns, 8)
    logs = Path(tempfile.mkdtemp(prefix="tp-agreement-"))
    rows = []
    settings = [s == "on" for s in args.selfcheck.split(",")]
    for method in methods:
        for selfcheck in settings:
            row = compare(method, selfcheck, chats, logs)
            rows.append(row)
            same = row["tp1"] == row["tp2"]
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"command": command(args), "rows": rows}, indent=1))
            print(f"{method:14} selfcheck {'on ' if selfcheck else 'off'} answers "
                  f"{row['answers_equal']}/{row['answers']} equal, stats "
                  f"{'equal' if same else 'DIFFER'} {row['tp2']}, disagreements "
                  f"{row['rank_disagreements']}", flush=True)


if __name__ == "__main__":
    main()
