"""Tensor parallelism in the policy layer: two ranks, each holding half of the KV heads
and their query groups, joined by ``HeadShards``, plan exactly what one rank holding every head
plans. Same keep ratio, escalations, fallback and self-check value, same K per span and layer, and
each rank keeps, for its heads, the tokens the single rank keeps for them.

The ranks run in two threads; their all-reduce stacks both ranks' tensors in rank order, so both
get the same bits, as a real collective gives."""

from __future__ import annotations

import threading

import pytest
import torch

from sglang_unicache.policy.config import UniCacheConfig
from sglang_unicache.policy.inputs import ScoreInputs
from sglang_unicache.policy.ranks import HeadShards
from sglang_unicache.policy.registry import build_method, known_methods

from .conftest import make_inputs

TP = 2
KV_HEADS, GROUP = 4, 2


class ThreadGroup:
    """An all-reduce between ``size`` threads (a stand-in for the attention-TP group)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots: list[torch.Tensor | None] = [None] * size
        self.calls = [0] * size

    def all_reduce(self, rank: int):
        def reduce(x: torch.Tensor, op: str) -> torch.Tensor:
            self.calls[rank] += 1
            self.slots[rank] = x.detach().clone()
            self.barrier.wait()
            stacked = torch.stack(list(self.slots))
            self.barrier.wait()  # every rank has read before the next call overwrites
            return stacked.sum(0) if op == "sum" else stacked.amax(0)

        return reduce


def shard(inp: ScoreInputs, rank: int, size: int) -> ScoreInputs:
    """This rank's KV heads and their query heads (SGLang's column-parallel QKV split)."""
    h = inp.num_kv_heads // size
    kv = slice(rank * h, (rank + 1) * h)
    q = slice(rank * h * GROUP, (rank + 1) * h * GROUP)
    return ScoreInputs(
        keys=[k[:, kv] for k in inp.keys],
        values=[v[:, kv] for v in inp.values],
        spans=inp.spans,
        obs_queries=[x[:, q] for x in inp.obs_queries],
        obs_positions=inp.obs_positions,
        protected=inp.protected,
    )


def plan_on_ranks(cfg: UniCacheConfig, inp: ScoreInputs):
    method = build_method(cfg)
    group = ThreadGroup(TP)
    plans: list = [None] * TP
    errors: list = []

    def run(rank: int) -> None:
        try:
            shards = HeadShards(inp.num_kv_heads, group.all_reduce(rank),
                                rank * inp.num_kv_heads // TP)
            plans[rank] = method.plan(shard(inp, rank, TP), shards)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(TP)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    assert group.calls[0] == group.calls[1], "the ranks' collectives must pair up"
    return plans, group.calls[0]


CONFIGS = {
    "selfcheck off": dict(selfcheck=False),
    # a threshold the random request trips at 10%: escalations, and a fallback past the cap
    "selfcheck tripping": dict(selfcheck=True, selfcheck_threshold=0.05, escalate_max_keep=0.4),
    "selfcheck on": dict(selfcheck=True),
    "compress text": dict(selfcheck=True, compress_text=True),
}


@pytest.mark.parametrize("setting", CONFIGS)
@pytest.mark.parametrize("method", known_methods())
def test_two_ranks_plan_what_one_rank_plans(method: str, setting: str) -> None:
    inp = make_inputs(kv_heads=KV_HEADS, group=GROUP, protected=(6, 70))
    cfg = UniCacheConfig(method=method, keep_ratio=0.1, **CONFIGS[setting])
    whole = build_method(cfg).plan(inp)
    ranks, collectives = plan_on_ranks(cfg, inp)
    h = KV_HEADS // TP
    for rank, part in enumerate(ranks):
        assert part.keep_ratio == whole.keep_ratio
        assert part.escalations == whole.escalations
        assert part.fallback == whole.fallback
        if whole.selfcheck is not None:
            assert part.selfcheck.passed == whole.selfcheck.passed
            assert part.selfcheck.value == pytest.approx(whole.selfcheck.value, rel=1e-4,
                                                         abs=1e-6)
        for mine, full in zip(part.spans, whole.spans, strict=True):
            assert [lp.budget for lp in mine.layers] == [lp.budget for lp in full.layers]
            assert mine.physical_slots == full.physical_slots
            assert torch.equal(mine.protected, full.protected)
            for lm, lf in zip(mine.layers, full.layers, strict=True):
                assert torch.equal(lm.kept, lf.kept[rank * h:(rank + 1) * h])
                assert torch.equal(lm.assign, lf.assign[rank * h:(rank + 1) * h])
    assert ranks[0].selfcheck == ranks[1].selfcheck  # the same bits on both ranks
    if setting == "selfcheck tripping" and method != "full":
        assert whole.escalations > 0 and collectives > 0


def test_head_shards_need_both_halves() -> None:
    with pytest.raises(ValueError, match="total_heads and all_reduce"):
        HeadShards(total_heads=4)
