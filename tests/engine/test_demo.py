"""The README's main job runs end to end on the bundled trained model and reports what compression
saved and how many answers were right."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.support.server import cpu_env

REPO = Path(__file__).resolve().parents[2]


def test_demo_reports_savings_and_reuse(tmp_path, server_factory):
    server_factory.make_room(2)  # the demo's servers
    proc = subprocess.run(
        [sys.executable, "-m", "examples.demo", "--images", "2", "--turns", "2",
         "--log-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env=cpu_env(), cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    slots = re.search(r"visual KV slots per cached image: (\d+) with --unicache vs (\d+) without",
                      out)
    assert slots, out[-2000:]
    assert int(slots.group(1)) < int(slots.group(2))
    reused = re.search(r"later turns served from the cache: (\d+) .*: (\d+) prefilled over the "
                       r"full image from its host copy", out)
    assert reused and int(reused.group(1)) >= 2, out[-2000:]
    assert int(reused.group(2)) >= 2, out[-2000:]  # host copies are on by default
    assert "effective config (with --unicache): method unicache, keep_ratio 0.1, self-check kl" \
        in out, out[-2000:]
    # the shipped defaults, self-check on: both images compressed
    assert "images compressed: 2 of 2" in out, out[-2000:]
    correct = re.search(r"answers correct: (\d+)/(\d+) with --unicache .* vs (\d+)/(\d+) without",
                        out)
    assert correct and int(correct.group(2)) == 4, out[-2000:]  # 2 images x 2 turns, both runs
    # the per-image progress lines add up to the totals (they once counted the previous image)
    for label, total in (("with --unicache", correct.group(1)),
                         ("without compression", correct.group(3))):
        progress = re.findall(rf"{re.escape(label)}: image \d+ of \d+ done \((\d+)/\d+ right\)",
                              out)
        assert len(progress) == 2 and sum(map(int, progress)) == int(total), out[-2000:]
