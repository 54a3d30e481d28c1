"""Config validation, mapping/file loading and presets (seed §8.1, §8.2)."""

from __future__ import annotations

import json

import pytest

from sglang_unicache.policy.config import PRESETS, UniCacheConfig
from sglang_unicache.policy.registry import build_method, known_methods


def test_defaults_are_seed_8_1() -> None:
    c = UniCacheConfig()
    assert (c.w_attention, c.w_cross, c.w_redundancy, c.w_recency) == (0.4, 0.3, 0.2, 0.1)
    assert c.head_merge_threshold == 0.88
    assert (c.shallow_rate, c.deep_rate) == (0.75, 0.45)
    assert (c.visual_rate_cap, c.text_rate_cap) == (0.8, 0.4)
    assert (c.alignment_threshold, c.alignment_discount) == (0.3, 0.5)
    assert (c.merge_threshold, c.evict_low, c.evict_high) == (0.8, 0.5, 0.8)
    # the self-check's statistic is the seed's; its threshold is calibrated (docs/selfcheck.md)
    assert (c.selfcheck_statistic, c.selfcheck_threshold, c.escalate_max_keep) == ("kl", 0.9, 0.4)
    assert c.escalate_factor == 2**0.5  # two rungs per doubling (docs/selfcheck.md)
    assert c.complexity_lambda == 2.0 and (c.dynamic_rate_min, c.dynamic_rate_max) == (0.4, 0.75)
    assert c.aircache_alpha == 0.9 and c.method == "unicache" and c.keep_ratio == 0.1


@pytest.mark.parametrize(
    "field,value",
    [
        ("keep_ratio", 0.0),
        ("keep_ratio", 1.5),
        ("w_attention", -0.1),
        ("aircache_alpha", 2.0),
        ("redundancy_window", 0),
        ("quantization", "int3"),
        ("selfcheck_threshold", 0.0),
        ("selfcheck_statistic", "entropy"),
        ("escalate_max_keep", 0.0),
        ("escalate_factor", 1.0),
        ("view_rungs", -1),
        ("view_max_keep", -0.1),
        ("view_max_keep", 1.5),
        ("escalate_factor", float("inf")),
        ("min_image_tokens", 0),
        ("layer_fill", "zeros"),
        ("pool_kernel", 4),
        ("head_merge_threshold", float("nan")),
        ("budget", "nope"),
        ("observation_window", -1),
    ],
)
def test_bad_value_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        UniCacheConfig(**{field: value})


def test_cross_field_checks() -> None:
    with pytest.raises(ValueError, match="evict_low"):
        UniCacheConfig(evict_low=0.9, evict_high=0.8)
    with pytest.raises(ValueError, match="dynamic_rate_min"):
        UniCacheConfig(dynamic_rate_min=0.7, dynamic_rate_max=0.5)
    with pytest.raises(ValueError, match="view_max_keep"):
        UniCacheConfig(keep_ratio=0.25, view_max_keep=0.15)
    UniCacheConfig(keep_ratio=0.25, view_max_keep=0)  # 0: no bound, whatever the keep ratio


def test_unknown_method_lists_known() -> None:
    with pytest.raises(ValueError, match="one of unicache, aircache, "):
        UniCacheConfig(method="magic")
    with pytest.raises(ValueError, match="known: unicache, aircache"):
        build_method("magic")
    assert known_methods()[0] == "unicache"  # the default first, then the catalog's others
    assert {"aircache", "snapkv", "pyramidkv", "h2o", "knorm", "random", "full"} < set(
        known_methods())


def test_the_flag_and_the_docs_list_every_registered_method() -> None:
    """Derived from the catalog, not kept by hand: a method added in one file shows up in the
    ``--unicache-method`` help and must have its row in docs/policy.md's method table."""
    import re
    from pathlib import Path

    from sglang_unicache.engine.flags import FLAGS
    from sglang_unicache.policy.catalog import METHODS

    help_text = next(f for f in FLAGS if f.option == "--unicache-method").help
    assert all(name in help_text for name in known_methods())
    doc = (Path(__file__).parents[2] / "docs" / "policy.md").read_text()
    table = dict(re.findall(r"^\| `([a-z0-9_]+)` \| (.+?) \|$", doc.split("## Methods")[1],
                            re.M))
    assert table == {name: spec.summary for name, spec in METHODS.items()}


def test_unknown_key() -> None:
    with pytest.raises(ValueError, match="unknown unicache config key 'foo'; known keys: method"):
        UniCacheConfig.from_mapping({"foo": 1})
    with pytest.raises(ValueError, match="unknown unicache config key 'bar'"):
        UniCacheConfig().replace(bar=2)


def test_presets() -> None:
    assert set(PRESETS) == {"default", "long_video", "document_qa", "realtime_chat"}
    lv = UniCacheConfig.preset("long_video")
    assert lv.preset == "long_video" and lv.visual_rate == 0.8
    doc = UniCacheConfig.from_mapping({"preset": "document_qa", "keep_ratio": 0.3})
    assert doc.alignment_discount == 0.4 and doc.text_rate == 0.18 and doc.keep_ratio == 0.3
    rt = UniCacheConfig.preset("realtime_chat")
    assert rt.head_merge and rt.head_merge_threshold == 0.85 and rt.shallow_rate == 0.70
    assert UniCacheConfig().preset == "default"
    with pytest.raises(ValueError, match="preset"):
        UniCacheConfig.from_mapping({"preset": "turbo"})


def test_replace_revalidates() -> None:
    c = UniCacheConfig().replace(keep_ratio=0.5)
    assert c.keep_ratio == 0.5
    with pytest.raises(ValueError, match="keep_ratio"):
        c.replace(keep_ratio=2.0)


def test_from_json_and_yaml(tmp_path) -> None:
    j = tmp_path / "u.json"
    j.write_text(json.dumps({"method": "aircache", "keep_ratio": 0.2}))
    assert UniCacheConfig.from_file(j).method == "aircache"
    y = tmp_path / "u.yaml"
    y.write_text("method: snapkv\nkeep_ratio: 0.05\npreset: long_video\n")
    c = UniCacheConfig.from_file(y)
    assert (c.method, c.keep_ratio, c.visual_rate) == ("snapkv", 0.05, 0.8)
    bad = tmp_path / "bad.yaml"
    bad.write_text("keep_ratio: 3\n")
    with pytest.raises(ValueError, match="keep_ratio"):
        UniCacheConfig.from_file(bad)
    with pytest.raises(ValueError, match="missing.json"):
        UniCacheConfig.from_file(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="broken.json"):
        UniCacheConfig.from_file(broken)
    txt = tmp_path / "u.txt"
    txt.write_text("{}")
    with pytest.raises(ValueError, match="u.txt"):
        UniCacheConfig.from_file(txt)
