"""Data-parallel routing by image: an image stays on one replica, tenants apart, and a
hot image cannot pile every request onto one replica."""

from __future__ import annotations

from sglang_unicache.engine.scale.routing import ImageAffinity


def test_every_question_about_an_image_goes_where_the_image_went() -> None:
    affinity = ImageAffinity(ranks=2)
    images = [(None, None, digest) for digest in range(6)]
    first = {key: affinity.pick(key, [0, 1]) for key in images}
    assert set(first.values()) == {0, 1}  # spread over both replicas
    for key in images * 3:
        assert affinity.pick(key, [0, 1]) == first[key]


def test_a_hot_image_spills_to_the_least_loaded_replica_and_stays_there() -> None:
    affinity = ImageAffinity(ranks=2, slack=4, window=16)
    hot = (None, None, 7)
    ranks = [affinity.pick(hot, [0, 1]) for _ in range(12)]
    home = ranks[0]
    assert ranks[:5] == [home] * 5 and ranks[5] != home  # 5 ahead of the other: it moves
    assert max(ranks.count(0), ranks.count(1)) - min(ranks.count(0), ranks.count(1)) <= 5


def test_an_inactive_replica_never_gets_a_request() -> None:
    affinity = ImageAffinity(ranks=3)
    key = (None, None, 11)
    home = affinity.pick(key, [0, 1, 2])
    others = [r for r in (0, 1, 2) if r != home]
    assert affinity.pick(key, others) in others


def test_tenants_are_keys_of_their_own() -> None:
    affinity = ImageAffinity(ranks=2)
    a, b = ("tenant-a", None, 5), ("tenant-b", None, 5)
    assert affinity.pick(a, [0, 1]) == affinity.pick(a, [0, 1])
    assert a in affinity.owner and b not in affinity.owner
