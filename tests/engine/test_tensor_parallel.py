"""``--unicache --tp-size 2`` on CPU: the two ranks hold one KV head each and agree on
every plan, so the server answers what ``--tp-size 1`` answers, compresses the same images to the
same sizes, and its ranks never differ (the agreement check, reported by ``check_integrity``).

Runs the bundled trained checkpoint on the demo's multi-turn chats: the shipped defaults, and
AirCache (head-averaged layer budgets) with a self-check threshold that some images fail, so
escalations and fallbacks are agreed too. Every method is covered at the policy level
(``tests/policy/test_tensor_parallel.py``).

A failure is agreed as well. In the shipped-defaults case the first plan raises on one rank only
(an injected OOM after its collectives, ``tests/support/faults``: rank 1 of the two, the only
rank of the single-rank server): both ranks keep that request's full KV, as a single rank that
fails does, and the server goes on answering and compressing the same as one rank."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from benchmarks.tp_agreement import serve as serve_chats
from examples.demo import conversations

CASES = {
    "shipped defaults, the first plan failing on one rank": [],
    "aircache, a self-check that trips": ["--unicache-method", "aircache",
                                          "--unicache-keep-ratio", "0.05"],
}
FAULTS = str(Path(__file__).parent.parent / "support" / "faults")


def fail_on(rank: int) -> dict[str, str]:
    path = os.pathsep.join(p for p in (FAULTS, os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "UNICACHE_TEST_FAIL_RANK": str(rank)}


TRIPPING = "selfcheck_threshold: {threshold}\nescalate_max_keep: 0.2\n"
THRESHOLD = 0.6  # between the bundled images' KL values at keep 0.05 (some pass, some fail)
GRID = 8


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_answer_and_compress_as_one(case: str, server_factory, tmp_path) -> None:
    server_factory.make_room(3)  # the single-rank server and the two-rank one's schedulers
    chats = conversations(4, 2, GRID)
    flags = list(CASES[case])
    faulty = "trips" not in case
    if not faulty:
        config = tmp_path / "tripping.yaml"
        config.write_text(TRIPPING.format(threshold=THRESHOLD))
        flags += ["--unicache-config", str(config)]
    with ThreadPoolExecutor(2) as pool:  # both servers at once: each start is mostly imports
        single = pool.submit(serve_chats, flags, tmp_path / "tp1.log", chats,
                             env=fail_on(0) if faulty else None)
        double = pool.submit(serve_chats, [*flags, "--tp-size", "2"], tmp_path / "tp2.log",
                             chats, env=fail_on(1) if faulty else None)
        (one, stats1), (two, stats2) = single.result(), double.result()
    assert two == one
    for key in ("images_compressed", "escalations", "fallbacks", "compressed_slots_held",
                "spans_reused", "spans_recalled", "recall_history_tokens", "host_copies",
                "errors"):
        assert stats2[key] == stats1[key], key
    assert stats1["spans_recalled"] > 0, "later turns recall their image from its host copy"
    assert stats2["errors"] == (1 if faulty else 0)
    assert stats1["images_compressed"] > 0, "the requests after a failure compress"
    assert stats2["rank_disagreements"] == 0
    assert stats2["integrity"] == []
    if not faulty:
        assert stats1["escalations"] > 0, "the threshold must make some image escalate"
