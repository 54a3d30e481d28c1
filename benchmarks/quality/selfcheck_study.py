"""What the self-check predicts: every statistic against harm to later answers.

Input: an ``eval_serving.py --selfcheck record --settings reuse`` result that holds method
``full`` and compressing methods. For each compressed image (one warming question, then 4 later
questions that reuse its compressed span) the warming request's self-check statistics are joined
with the later answers; an image is *harmed* when a later question that the full cache answered
right is answered wrong. For each statistic this prints the ROC AUC of predicting harm (0.5 is
chance), and for a grid of thresholds the share of images that pass and the accuracy of the later
answers of the images above and below it.

    python -m benchmarks.quality.selfcheck_study runs/selfcheck-study.json --markdown out.md

It also prints Youden's J (true-positive rate - false-positive rate for "harmed") of each
statistic at each threshold, the criterion the default threshold is chosen by.
"""

from __future__ import annotations

import argparse
import json

from sglang_unicache.policy.config import SELFCHECK_STATISTICS, UniCacheConfig


def auc(scores: list[float], labels: list[bool]) -> float:
    """P(score of a harmed image > score of an unharmed one), ties count half."""
    pos = [s for s, y in zip(scores, labels, strict=True) if y]
    neg = [s for s, y in zip(scores, labels, strict=True) if not y]
    if not pos or not neg:
        return float("nan")
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def records(results: list[dict], ratios: set[float] | None) -> list[dict]:
    full = next(e for e in results if e["method"] == "full")
    full_correct = [im["correct"] for im in full["images"]]
    rows = []
    for entry in results:
        if entry["method"] in ("full", "transformers") or "images" not in entry:
            continue
        if ratios and entry["keep_ratio"] not in ratios:
            continue
        for im, ref in zip(entry["images"], full_correct, strict=True):
            if not im["check"]:
                continue
            lost = sum(r and not c for r, c in zip(ref, im["correct"], strict=True))
            rows.append({"task": entry.get("task", "vqa"), "method": entry["method"],
                         "keep_ratio": entry["keep_ratio"],
                         "stats": im["check"]["stats"], "correct": sum(im["correct"]),
                         "asked": len(im["correct"]), "lost": lost, "harmed": lost > 0})
    return rows


def accuracy(group: list[dict]) -> float:
    """Share of the later questions of ``group``'s images answered right (nan for none)."""
    asked = sum(r["asked"] for r in group)
    return sum(r["correct"] for r in group) / asked if asked else float("nan")


def threshold_table(rows: list[dict], stat: str, thresholds: list[float]) -> list[dict]:
    out = []
    for t in thresholds:
        passing = [r for r in rows if r["stats"][stat] <= t]
        failing = [r for r in rows if r["stats"][stat] > t]

        out.append({"threshold": t, "pass_share": len(passing) / len(rows),
                    "acc_pass": accuracy(passing), "acc_fail": accuracy(failing),
                    "harmed_pass": sum(r["harmed"] for r in passing),
                    "harmed_fail": sum(r["harmed"] for r in failing)})
    return out


def best_threshold(scores: list[float], labels: list[bool]) -> tuple[float, float, float, float]:
    """(threshold, J, TPR, FPR) maximising J over the observed values (fail when > threshold)."""
    pos = sum(labels)
    neg = len(labels) - pos
    best = (float("nan"), -1.0, 0.0, 0.0)
    for t in sorted(set(scores)):
        tpr = sum(s > t and y for s, y in zip(scores, labels, strict=True)) / pos
        fpr = sum(s > t and not y for s, y in zip(scores, labels, strict=True)) / neg
        if tpr - fpr > best[1]:
            best = (t, tpr - fpr, tpr, fpr)
    return best


def quantiles(values: list[float], qs: list[float]) -> list[float]:
    s = sorted(values)
    return [s[min(len(s) - 1, int(q * len(s)))] for q in qs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="eval_serving.py outputs (merged)")
    parser.add_argument("--ratios", default="", help="only these keep ratios (comma list)")
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    ratios = {float(r) for r in args.ratios.split(",")} if args.ratios else None
    # one file per model: each joins its own ``full`` run
    rows = [row for path in args.results for row in records(json.load(open(path)), ratios)]
    statistics = [s for s in SELFCHECK_STATISTICS if all(s in r["stats"] for r in rows)]
    harmed = [r["harmed"] for r in rows]
    lines = [f"{len(rows)} compressed images, {sum(harmed)} harmed "
             f"(a later answer the full cache got right went wrong)", "",
             "| statistic | AUC (all) | " + " | ".join(
                 f"AUC {m}" for m in sorted({r['method'] for r in rows})) + " |",
             "|---|---|" + "---|" * len({r["method"] for r in rows})]
    for stat in statistics:
        per = []
        for m in sorted({r["method"] for r in rows}):
            sub = [r for r in rows if r["method"] == m]
            per.append(auc([r["stats"][stat] for r in sub], [r["harmed"] for r in sub]))
        lines.append(f"| {stat} | {auc([r['stats'][stat] for r in rows], harmed):.3f} | "
                     + " | ".join(f"{a:.3f}" for a in per) + " |")
    lines += ["", "Per method and keep ratio: the seed's KL (median, 90th percentile, max), the "
              "images harmed, and the later-answer accuracy:", "",
              "| task | method | keep | images | KL p50 | KL p90 | KL max | content_lost min | "
              "content_lost max | harmed | accuracy |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for task, method, keep in sorted({(r["task"], r["method"], r["keep_ratio"]) for r in rows}):
        key = (task, method, keep)
        group = [r for r in rows if (r["task"], r["method"], r["keep_ratio"]) == key]
        p50, p90 = quantiles([r["stats"]["kl"] for r in group], [0.5, 0.9])
        top = max(r["stats"]["kl"] for r in group)
        content = [r["stats"].get("content_lost", float("nan")) for r in group]
        lines.append(f"| {task} | {method} | {keep} | {len(group)} | {p50:.2f} | {p90:.2f} | "
                     f"{top:.2f} | {min(content):.3f} | {max(content):.3f} | "
                     f"{sum(r['harmed'] for r in group)} | {accuracy(group):.1%} |")
    shipped = UniCacheConfig()
    kl_max, content_max = shipped.selfcheck_threshold, shipped.selfcheck_content_threshold
    lines += ["", f"The shipped verdict (pass: kl <= {kl_max} and content_lost <= {content_max}) "
              "against harm:", "",
              "| task | images | passing | harmed passing | harmed failing | later-answer accuracy,"
              " passing | failing |", "|---|---|---|---|---|---|---|"]
    for task in sorted({r["task"] for r in rows}):
        group = [r for r in rows if r["task"] == task and "content_lost" in r["stats"]]
        passes = [r["stats"]["kl"] <= kl_max and r["stats"]["content_lost"] <= content_max
                  for r in group]
        ok = [r for r, p in zip(group, passes, strict=True) if p]
        bad = [r for r, p in zip(group, passes, strict=True) if not p]
        lines.append(f"| {task} | {len(group)} | {len(ok)} | {sum(r['harmed'] for r in ok)} | "
                     f"{sum(r['harmed'] for r in bad)} | "
                     + " | ".join(f"{accuracy(g):.1%}" if g else "-" for g in (ok, bad)) + " |")
    lines += ["", "Best threshold of each statistic by Youden's J (harmed = positive):", "",
              "| statistic | threshold | J | true-positive rate | false-positive rate |",
              "|---|---|---|---|---|"]
    for stat in statistics:
        t, j, tpr, fpr = best_threshold([r["stats"][stat] for r in rows], harmed)
        lines.append(f"| {stat} | {t:.3f} | {j:.3f} | {tpr:.3f} | {fpr:.3f} |")
    for stat in statistics:
        values = [r["stats"][stat] for r in rows]
        grid = quantiles(values, [0.5, 0.75, 0.9, 0.95, 0.99])
        lines += ["", f"**{stat}** (thresholds at its 50/75/90/95/99th percentile)", "",
                  "| threshold | images passing | later-answer accuracy, passing | failing | "
                  "harmed passing | harmed failing |", "|---|---|---|---|---|---|"]
        for row in threshold_table(rows, stat, grid):
            lines.append(f"| {row['threshold']:.3f} | {row['pass_share']:.1%} | "
                         f"{row['acc_pass']:.1%} | {row['acc_fail']:.1%} | "
                         f"{row['harmed_pass']} | {row['harmed_fail']} |")
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
