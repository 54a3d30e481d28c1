"""What the self-check buys a request's own answer: each statistic against harm to the tokens a
request decodes on its own compressed view, and the check's policies replayed offline.

With host copies (the default) a later question is prefilled over the whole image, so the check
no longer guards other questions: it guards the request that made the plan, whose answer after
its first token is decoded on the view (``docs/selfcheck.md``, "With host copies"). Inputs, all
``eval_serving.py --settings long`` results on the same items:

- ``--full``: method ``full`` (the reference answers);
- ``--record``: the method at several keep ratios with ``--selfcheck record`` (every statistic of
  each request's own plan, never acted on: the request decodes on that ratio's view);
- ``--shipped`` (optional): the same method with ``--selfcheck on``, to check the replay.

A request is *harmed* at a ratio when the full cache answers it right and its view does not. The
replay of a policy (threshold, ladder of keep ratios) gives each request the first ratio of the
ladder whose statistic passes, the full KV when none does, and that run's answer; a replay of the
shipped policy must agree with ``--shipped`` (the escalated plan is the plan made at that ratio
from the same scores).

    python -m benchmarks.quality.own_view_study --full runs/b-full.json \\
        --record runs/b-record.json --shipped runs/b-shipped.json --tokens 64
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from benchmarks.quality.selfcheck_study import auc, best_threshold, quantiles
from sglang_unicache.policy.config import SELFCHECK_STATISTICS

BOUND = 0.15  # the bound on the entries a request decodes on, as a share of its image


@dataclass(frozen=True)
class Level:
    keep: float
    correct: list[int]
    stats: list[dict]  # per item: the request's own check statistics


def load(path: str) -> list[dict]:
    with open(path) as f:
        return json.load(f)


def levels(record: list[dict]) -> dict[float, Level]:
    out = {}
    for entry in record:
        long = entry.get("long")
        if not long or entry["method"] == "full":
            continue
        stats = [(c or {}).get("stats") or {} for c in long["checks"]]
        out[entry["keep_ratio"]] = Level(entry["keep_ratio"], long["correct"], stats)
    return dict(sorted(out.items()))


def entries(keep: float, tokens: int) -> int:
    """The entries a view at ``keep`` holds of a ``tokens``-token image (``round``, at least 1)."""
    return max(1, round(keep * tokens))


def replay(lv: dict[float, Level], full: list[int], stat: str, threshold: float,
           ladder: tuple[float, ...]) -> list[tuple[float, int]]:
    """Per item (the ratio it decodes on, 1.0 for the full KV; its answer's correctness)."""
    out = []
    for i, ref in enumerate(full):
        got = (1.0, ref)
        for keep in ladder:
            value = lv[keep].stats[i].get(stat)
            if value is None or value <= threshold:
                got = (keep, lv[keep].correct[i])
                break
        out.append(got)
    return out


def summary(rows: list[tuple[float, int]], tokens: int) -> dict:
    n = len(rows)
    return {"accuracy": sum(c for _, c in rows) / n,
            "within_bound": sum(entries(k, tokens) <= BOUND * tokens for k, _ in rows) / n,
            "mean_entries": sum(entries(k, tokens) for k, _ in rows) / n,
            "full_kv": sum(k == 1.0 for k, _ in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", required=True)
    parser.add_argument("--record", required=True)
    parser.add_argument("--shipped")
    parser.add_argument("--tokens", type=int, default=64, help="visual tokens per image")
    parser.add_argument("--statistic", default="kl")
    parser.add_argument("--thresholds", default="0.5,0.7,0.9,1.1,1.3,1.5,2.0")
    parser.add_argument("--ladders", default="0.1;0.1,0.2,0.4;0.1,0.14;0.1,0.14,0.4;"
                                             "0.1,0.14,0.2,0.4")
    parser.add_argument("--shipped-ladder", default="0.1,0.14,0.2,0.28,0.4",
                        help="the ladder --shipped ran (default: sqrt 2 from keep 0.1, as entry "
                             "counts of 64-token images; 0.1,0.2,0.4 for escalate_factor 2); "
                             "rungs not in --record are skipped")
    args = parser.parse_args()
    full = next(e for e in load(args.full) if e["method"] == "full")["long"]["correct"]
    lv = levels(load(args.record))
    n = len(full)
    print(f"n = {n}; full cache {sum(full) / n:.1%}\n")

    print("| keep | entries | accuracy | harmed (full right, view wrong) | "
          f"{args.statistic} p50 | p90 | max |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for keep, level in lv.items():
        harmed = sum(r and not c for r, c in zip(full, level.correct, strict=True))
        vals = [s[args.statistic] for s in level.stats if args.statistic in s]
        p50, p90 = quantiles(vals, [0.5, 0.9]) if vals else (float("nan"),) * 2
        print(f"| {keep} | {entries(keep, args.tokens)} | {sum(level.correct) / n:.1%} | "
              f"{harmed} | {p50:.3f} | {p90:.3f} | {max(vals, default=float('nan')):.3f} |")

    print("\n| keep | statistic | AUC (harm) | best threshold (J) | J |")
    print("| --- | --- | --- | --- | --- |")
    for keep, level in lv.items():
        labels = [bool(r and not c) for r, c in zip(full, level.correct, strict=True)]
        for stat in SELFCHECK_STATISTICS:
            idx = [i for i, s in enumerate(level.stats) if stat in s]
            if not idx:
                continue
            scores = [level.stats[i][stat] for i in idx]
            lab = [labels[i] for i in idx]
            if not any(lab) or all(lab):
                print(f"| {keep} | {stat} | - ({sum(lab)} harmed of {len(lab)}) | - | - |")
                continue
            t, j, _, _ = best_threshold(scores, lab)
            print(f"| {keep} | {stat} | {auc(scores, lab):.3f} | {t:.3f} | {j:.3f} |")

    print(f"\nReplayed policies ({args.statistic}; a request at the last rung that fails keeps "
          "its full KV)\n")
    print(f"| threshold | ladder | accuracy | requests within {BOUND}x | mean entries | full KV |")
    print("| --- | --- | --- | --- | --- | --- |")
    ladders = [tuple(float(x) for x in lad.split(",")) for lad in args.ladders.split(";")]
    for lad in ladders:
        if any(k not in lv for k in lad):
            continue
        for t in [float(x) for x in args.thresholds.split(",")] + [float("inf")]:
            s = summary(replay(lv, full, args.statistic, t, lad), args.tokens)
            print(f"| {t} | {' -> '.join(map(str, lad))} | {s['accuracy']:.1%} | "
                  f"{s['within_bound']:.1%} | {s['mean_entries']:.1f} | {s['full_kv']} |")

    if args.shipped:
        shipped = next(e for e in load(args.shipped) if "long" in e)
        ladder = tuple(k for k in (float(x) for x in args.shipped_ladder.split(",")) if k in lv)
        rows = replay(lv, full, args.statistic, shipped.get("config", {}).get(
            "selfcheck_threshold", 0.9), ladder)
        same = sum(c == s for (_, c), s in zip(rows, shipped["long"]["correct"], strict=True))
        settled = [1.0 if not c or not c["passed"] else c["keep_ratio"]
                   for c in shipped["long"]["checks"]]
        same_keep = sum(entries(k, args.tokens) == entries(s, args.tokens)  # 0.14 ~ 0.1414
                        for (k, _), s in zip(rows, settled, strict=True))
        print(f"\nReplay of the shipped policy ({' -> '.join(map(str, ladder))}) against "
              f"--shipped: the same answer on {same} of "
              f"{n}, the same settled entries on {same_keep} of {n}; shipped accuracy "
              f"{sum(shipped['long']['correct']) / n:.1%}, replayed "
              f"{summary(rows, args.tokens)['accuracy']:.1%}")


if __name__ == "__main__":
    main()
