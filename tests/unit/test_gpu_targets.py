"""The GPU targets script's verdicts: one per target and matching row, each a comparison of the
row's value with the issue's limit; its dry run's client workloads keep their names' first
words (which select them) and replace only the sizes."""

from benchmarks.gpu_targets import DRY_CLIENT, TARGETS, dry_table, verdicts
from benchmarks.perf_workload import STOCK_CACHED
from benchmarks.serving_client import WORKLOADS, selected
from sglang_unicache.engine.startup import MM_PREPROCESS_CACHE_MB

SHIPPED_CLIENT = "`--unicache` (defaults as shipped)"


def test_each_target_judges_the_rows_it_names_by_the_issues_limit():
    steps = {
        "overhead": {"rows": [
            {"method": "knorm", "workload": "2 x 256 image tokens", "overhead_share": 0.041},
            {"method": "unicache, defaults as shipped", "workload": "2 x 256 image tokens",
             "overhead_share": 0.139}]},
        "client": {"rows": [
            {"workload": "pool free: 24 prompts", "server": "stock", "output_tok_s": 70},
            {"workload": "pool free: 24 prompts", "server": SHIPPED_CLIENT,
             "tok_s_vs_stock": 0.98, "tpot_vs_stock": 1.04, "ttft_vs_stock": 0.9},
            {"workload": "pool binds: 32 prompts", "server": SHIPPED_CLIENT,
             "tok_s_vs_stock": 1.61, "tpot_vs_stock": 2.0, "ttft_vs_stock": 0.23}]},
        "multi-turn": {"rows": [
            {"workload": "multi-turn: 48 conversations", "server": SHIPPED_CLIENT,
             "tok_s_vs_stock": 1.27},
            {"workload": "busy chats: 48 conversations", "server": SHIPPED_CLIENT,
             "tok_s_vs_stock": 1.9}]},
        "recall": {"error": "Traceback ..."},
    }
    got = {(v["step"], v["workload"][:9], v["row"][:12], v["key"]): (v["value"], v["met"])
           for v in verdicts(steps)}
    assert got == {
        ("overhead", "2 x 256 i", "knorm", "overhead_share"): (0.041, True),
        ("overhead", "2 x 256 i", "unicache, de", "overhead_share"): (0.139, False),
        ("client", "pool free", SHIPPED_CLIENT[:12], "tok_s_vs_stock"): (0.98, True),
        ("client", "pool free", SHIPPED_CLIENT[:12], "tpot_vs_stock"): (1.04, False),
        ("client", "pool bind", SHIPPED_CLIENT[:12], "tok_s_vs_stock"): (1.61, True),
        ("client", "pool bind", SHIPPED_CLIENT[:12], "ttft_vs_stock"): (0.23, True),
        ("multi-turn", "multi-tur", SHIPPED_CLIENT[:12], "tok_s_vs_stock"): (1.27, False),
        ("multi-turn", "busy chat", SHIPPED_CLIENT[:12], "tok_s_vs_stock"): (1.9, False),
    }
    # stock's row, a step that raised and the targets of rows not run give no verdict
    assert all(v["row"] != "stock" and v["step"] != "recall" for v in verdicts(steps))
    assert {issue for issue, *_ in TARGETS} == {31, 34}


def test_the_dry_client_workloads_are_selected_by_the_same_names_and_only_shrunk():
    dry = dry_table(WORKLOADS)
    for words in ("pool free", "pool binds", "multi-turn", "busy chats"):
        (full_name, full), = selected([words]).items()
        (name, small), = selected([words], dry).items()
        assert name.startswith(words) and name != full_name
        assert small["server"] == full["server"]
        assert len(small["client"]) == len(full["client"])
        for i, (a, b) in enumerate(zip(full["client"], small["client"], strict=True)):
            flag = full["client"][i - 1] if i else ""
            assert b == (DRY_CLIENT[flag] if flag in DRY_CLIENT else a)
    assert "--num-prompts 4" in name and "--max-concurrency 2" in name


def test_stock_with_the_preprocessing_cache_gets_the_size_unicache_turns_on():
    (flags,) = STOCK_CACHED.values()
    assert "--unicache" not in flags
    assert flags[flags.index("--mm-preprocess-cache-size-mb") + 1] == str(MM_PREPROCESS_CACHE_MB)
