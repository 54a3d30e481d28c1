"""``engine/scale/tensor_parallel.py`` over a real gloo group of two processes: the sums the plans
read are the same on both ranks, and the agreement check tells equal fingerprints from unequal
ones."""

from __future__ import annotations

import multiprocessing as mp
import os
from types import SimpleNamespace

import pytest
import torch

from sglang_unicache.engine.scale.tensor_parallel import PeerFailed, TensorParallel


def _rank(rank: int, init: str, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    group = SimpleNamespace(world_size=2, rank_in_group=rank, cpu_group=dist.group.WORLD)
    tp = TensorParallel.of(SimpleNamespace(attn_tp_group=group))
    shards = tp.shards(local_heads=3)
    x = torch.tensor([1.0, 2.0], dtype=torch.float32) * (rank + 1)
    out.put((rank, {
        "heads": (shards.total_heads, shards.first_head),
        "sum": shards.sum(x).tolist(),
        "max": shards.max(x).tolist(),
        "mean": shards.mean(torch.full((3, 2), float(rank))).tolist(),
        "dtype": str(shards.sum(x).dtype),
        "same": tp.agree([0.0, 0.1, 16.0, 500.0]),
        "different": tp.agree([0.0, 0.1, 16.0 + rank, 500.0]),
    }))
    dist.destroy_process_group()


def two_ranks(target, tmp_path) -> dict:
    """Run ``target(rank, init, out)`` in two spawned processes; their results by rank."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [ctx.Process(target=target, args=(r, init, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    return results


def test_two_gloo_ranks_reduce_alike_and_catch_a_difference(tmp_path) -> None:
    results = two_ranks(_rank, tmp_path)
    assert results[0]["heads"] == (6, 0) and results[1]["heads"] == (6, 3)
    for r in (0, 1):
        assert results[r]["sum"] == [3.0, 6.0]
        assert results[r]["max"] == [2.0, 4.0]
        assert results[r]["mean"] == [0.5, 0.5]  # three heads of 0 and three of 1
        assert results[r]["dtype"] == "torch.float32"  # reduced in float64, returned as given
        assert results[r]["same"] is True
        assert results[r]["different"] is False


STEP_COLLECTIVES = 3
# (rank that raises, or -1 for both; the collective before which it raises: 3 is after the last)
FAILURES = [(1, 0), (1, 1), (0, 2), (1, 3), (-1, 1), (-1, 3)]


def _step(tp: TensorParallel, fails: bool, at: int) -> bool:
    """A compression step of three collectives as the controller runs one: raise where told,
    then settle; the verdict every rank must reach."""
    try:
        for i in range(STEP_COLLECTIVES):
            if fails and i == at:
                raise MemoryError("injected")
            tp.all_reduce(torch.ones(2 + i), "sum")  # a different size per collective
        if fails and at == STEP_COLLECTIVES:
            raise MemoryError("injected")
    except PeerFailed:
        return False
    except MemoryError:
        return tp.settle(failed=True)
    return tp.settle(failed=False)


def _failing_rank(rank: int, init: str, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    group = SimpleNamespace(world_size=2, rank_in_group=rank, cpu_group=dist.group.WORLD)
    tp = TensorParallel.of(SimpleNamespace(attn_tp_group=group))
    verdicts = [_step(tp, who in (rank, -1), at) for who, at in FAILURES]
    clean = _step(tp, False, 0)
    # After every failure the ranks are still in step: a collective pairs with its twin.
    out.put((rank, {"verdicts": verdicts, "clean": clean,
                    "sum": tp.all_reduce(torch.tensor([rank + 1.0]), "sum").item(),
                    "agree": tp.agree([1.0, 2.0])}))
    dist.destroy_process_group()


def test_a_rank_that_fails_mid_step_leaves_both_ranks_in_step(tmp_path) -> None:
    results = two_ranks(_failing_rank, tmp_path)
    for r in (0, 1):
        assert results[r]["verdicts"] == [False] * len(FAILURES)
        assert results[r]["clean"] is True
        assert results[r]["sum"] == 3.0 and results[r]["agree"] is True


def test_one_rank_needs_no_group() -> None:
    tp = TensorParallel.of(SimpleNamespace(attn_tp_group=SimpleNamespace(world_size=1)))
    assert tp.size == 1 and tp.agree([1.0, 2.0])
    assert tp.settle(failed=False) and not tp.settle(failed=True)
    assert not tp.shards(4).sharded


@pytest.fixture(autouse=True)
def _gloo_on_loopback(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
