"""Tables, plots and the target checks from ``eval_serving.py`` results.

Reads one or several result files (lists of ``{method, keep_ratio, reuse: {accuracy, n, by_type},
long: {...}}`` entries; later files override earlier ones per method, keep ratio and setting) and
writes, per setting (``reuse``, ``long``):

- a markdown table, methods x keep ratios, accuracy in %, with the number of scored items;
- a per-question-type table at keep 0.1 (with ``full`` and ``transformers`` for reference);
- the target checks (met / not met, with the numbers);
- a PNG plot, accuracy vs keep ratio (log x), one line per method, ``full`` dashed and the
  transformers reference (``--transformers-check``) dotted.

Missing settings, methods or ratios show as ``-`` and their checks as ``n/a``.

    python -m benchmarks.quality.report runs/quality.json --markdown runs/quality.md \\
        --plot-dir docs/img
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

RATIOS = (0.01, 0.05, 0.1, 0.25, 0.5)
SETTINGS = ("reuse", "long")
METHOD_ORDER = ("full", "transformers", "random", "knorm", "h2o", "snapkv", "pyramidkv",
                "aircache", "unicache")
REFERENCE = ("full", "transformers")  # not compression methods: drawn as horizontal lines
SETTING_TITLES = {
    "reuse": "Reuse setting (questions 2..N reuse the cached compressed image)",
    "long": "Long-answer setting (first request, multi-token answers)",
}
# Target tolerances: the default method within this many points of full at 10% keep.
FULL_TOLERANCE = {"reuse": 1.0, "long": 2.0}


def load(paths: list[str]) -> dict[tuple[str, float], dict]:
    """``(method, keep_ratio) -> entry``, merged over ``paths`` (later settings win)."""
    merged: dict[tuple[str, float], dict] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        if isinstance(data, dict):
            data = [data]
        for entry in data:
            key = (entry["method"], round(float(entry.get("keep_ratio", 1.0)), 6))
            merged.setdefault(key, {"method": key[0], "keep_ratio": key[1]})
            merged[key].update({k: v for k, v in entry.items() if v is not None})
    return merged


def method_order(methods) -> list[str]:
    known = [m for m in METHOD_ORDER if m in methods]
    return known + sorted(m for m in methods if m not in METHOD_ORDER)


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def fmt_ratio(r: float) -> str:
    return f"{100 * r:g}%"


class Setting:
    """The results of one setting: ``acc[(method, ratio)]``, ``n``, ``by_type``."""

    def __init__(self, name: str, results: dict[tuple[str, float], dict]):
        self.name = name
        self.scores = {k: e[name] for k, e in results.items() if isinstance(e.get(name), dict)}
        self.methods = method_order({m for m, _ in self.scores})
        extra = sorted({r for m, r in self.scores if m not in REFERENCE and r not in RATIOS})
        self.ratios = sorted(set(RATIOS) | set(extra))

    def __bool__(self) -> bool:
        return bool(self.scores)

    def acc(self, method: str, ratio: float | None = None) -> float | None:
        if method in REFERENCE:
            hits = [s for (m, _), s in self.scores.items() if m == method]
            return hits[0]["accuracy"] if hits else None
        s = self.scores.get((method, round(ratio, 6)))
        return None if s is None else s["accuracy"]

    def score(self, method: str, ratio: float | None = None) -> dict | None:
        if method in REFERENCE:
            hits = [s for (m, _), s in self.scores.items() if m == method]
            return hits[0] if hits else None
        return self.scores.get((method, round(ratio, 6)))

    # ------------------------------------------------------------------ tables

    def table(self) -> str:
        head = ["method", *(fmt_ratio(r) for r in self.ratios), "100%", "n"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for m in self.methods:
            if m in REFERENCE:
                cells = ["-"] * len(self.ratios) + [pct(self.acc(m))]
                ns = {self.score(m)["n"]}
            else:
                cells = [pct(self.acc(m, r)) for r in self.ratios] + ["-"]
                ns = {s["n"] for (mm, _), s in self.scores.items() if mm == m}
            label = f"{m} (HF)" if m == "transformers" else m
            n = "/".join(str(x) for x in sorted(ns))
            lines.append("| " + " | ".join([label, *cells, n]) + " |")
        return "\n".join(lines)

    def type_table(self, ratio: float = 0.1) -> str | None:
        rows = []
        for m in self.methods:
            s = self.score(m, ratio)
            if s is not None:
                rows.append((m if m not in REFERENCE else f"{m} (100%)", s))
        if all(label.endswith("(100%)") for label, _ in rows):
            return None  # no compression method at this ratio
        qtypes = sorted({q for _, s in rows for q in s.get("by_type", {})})
        head = ["method", *qtypes, "overall"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for label, s in rows:
            bt = s.get("by_type", {})
            lines.append("| " + " | ".join([label, *(pct(bt.get(q)) for q in qtypes),
                                            pct(s["accuracy"])]) + " |")
        return "\n".join(lines)

    # ------------------------------------------------------------------ checks

    def checks(self, default: str, margin: float) -> list[str]:
        out = []
        full = self.acc("full")
        tol = FULL_TOLERANCE.get(self.name, 1.0)

        def na(what: str, *need: tuple[str, float | None]) -> str | None:
            missing = [f"{m}@{fmt_ratio(r) if r else '100%'}" for m, r in need
                       if self.acc(m, r) is None]
            return f"- {what}: n/a (missing {', '.join(missing)})" if missing else None

        what = f"{default} at 10% keep within {tol:g} point(s) of full"
        line = na(what, ("full", None), (default, 0.1))
        if line is None:
            d = self.acc(default, 0.1)
            gap = 100 * (d - full)
            line = (f"- {what}: **{'met' if gap >= -tol else 'not met'}** "
                    f"({pct(d)}% vs {pct(full)}%, {gap:+.1f} points)")
        out.append(line)

        what = f"random at 10% keep clearly worse (>= {margin:g} points below full)"
        line = na(what, ("full", None), ("random", 0.1))
        if line is None:
            r = self.acc("random", 0.1)
            below_full = 100 * (full - r)
            rel = ""
            if self.acc(default, 0.1) is not None:
                rel = f", {100 * (r - self.acc(default, 0.1)):+.1f} points vs {default}"
            line = (f"- {what}: **{'met' if below_full >= margin else 'not met'}** "
                    f"({pct(r)}%, {below_full:.1f} points below full{rel})")
        out.append(line)

        what = "best of unicache/aircache at 1% keep >= snapkv + 5 points"
        have = [m for m in ("unicache", "aircache") if self.acc(m, 0.01) is not None]
        if self.acc("snapkv", 0.01) is None or not have:
            need = [("snapkv", 0.01)] + ([] if have else [("unicache", 0.01), ("aircache", 0.01)])
            out.append(na(what, *need))
        else:
            best = max(have, key=lambda m: self.acc(m, 0.01))
            b, s = self.acc(best, 0.01), self.acc("snapkv", 0.01)
            gap = 100 * (b - s)
            out.append(f"- {what}: **{'met' if gap >= 5 else 'not met'}** ({best} {pct(b)}% vs "
                       f"snapkv {pct(s)}%, {gap:+.1f} points)")

        ref = self.score("transformers")
        srv = self.score("full")
        if ref is not None and srv is not None:
            same = ""
            ref_c, srv_c = ref.get("correct"), srv.get("correct")
            if ref_c is not None and srv_c is not None and len(srv_c) >= len(ref_c):
                head = srv_c[:len(ref_c)]
                agree = sum(a == b for a, b in zip(ref_c, head, strict=True))
                same = (f"; server full on the same {len(ref_c)} items "
                        f"{pct(sum(head) / max(len(head), 1))}%, per-item agreement "
                        f"{agree}/{len(ref_c)}")
            out.append(f"- reference: transformers (no SGLang) {pct(ref['accuracy'])}% on "
                       f"{ref['n']} items vs server full {pct(srv['accuracy'])}% on "
                       f"{srv['n']}{same}")
        return out

    # ------------------------------------------------------------------ plot

    def plot(self, path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8.5, 4.5))
        used = []
        for m in self.methods:
            if m in REFERENCE:
                continue
            pts = sorted((r, 100 * s["accuracy"]) for (mm, r), s in self.scores.items()
                         if mm == m)
            if not pts:
                continue
            xs, ys = zip(*pts, strict=True)
            lw = 2.4 if m == "unicache" else 1.4
            ax.plot(xs, ys, marker="o", linewidth=lw, label=m)
            used += xs
        styles = {"full": ("--", "black", "full (100%)"),
                  "transformers": (":", "grey", "full, transformers reference")}
        for m, (ls, colour, label) in styles.items():
            a = self.acc(m)
            if a is not None:
                ax.axhline(100 * a, linestyle=ls, color=colour, linewidth=1.4, label=label)
        ticks = sorted(set(self.ratios) | set(used))
        lo, hi = min(ticks), max(ticks)
        ax.set_xscale("log")
        ax.set_xlim(lo / 1.5, hi * 1.5)
        ax.set_xticks(ticks)
        ax.set_xticklabels([fmt_ratio(t) for t in ticks])
        ax.minorticks_off()
        ax.set_ylim(0, 100)
        ax.set_xlabel("image KV keep ratio (log scale)")
        ax.set_ylabel("exact-match accuracy (%)")
        ax.set_title(SETTING_TITLES.get(self.name, self.name), fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        plt.close(fig)


def report(results: dict, default: str, margin: float) -> tuple[str, list[Setting]]:
    parts, settings = [], []
    for name in SETTINGS:
        s = Setting(name, results)
        if not s:
            parts.append(f"## {SETTING_TITLES[name]}\n\nno results for this setting.\n")
            continue
        settings.append(s)
        parts.append(f"## {SETTING_TITLES[name]}\n\nAccuracy (%) by keep ratio:\n\n{s.table()}\n")
        types = s.type_table(0.1)
        parts.append("Per question type at 10% keep (%):\n\n"
                     + (types if types else "no results at 10% keep.") + "\n")
        parts.append("Targets:\n\n" + "\n".join(s.checks(default, margin)) + "\n")
    return "\n".join(parts), settings


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", help="eval_serving.py JSON file(s), merged in order")
    p.add_argument("--markdown", help="also write the markdown report to this file")
    p.add_argument("--plot-dir", default="docs/img", help="where quality-<setting>.png go")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--default-method", default="unicache")
    p.add_argument("--clear-margin", type=float, default=5.0,
                   help="points below full that count as 'clearly worse' for random")
    args = p.parse_args(argv)

    results = load(args.results)
    text, settings = report(results, args.default_method, args.clear_margin)
    title = "# Quality vs keep ratio\n\nFrom " + ", ".join(f"`{r}`" for r in args.results) + "\n"
    text = f"{title}\n{text}"
    if not args.no_plots:
        plots = []
        for s in settings:
            path = Path(args.plot_dir) / f"quality-{s.name}.png"
            s.plot(path)
            link = os.path.relpath(path, Path(args.markdown).parent) if args.markdown else path
            plots.append(f"![{s.name}]({link})")
        if plots:
            text += "\n" + "\n".join(plots) + "\n"
    print(text)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
