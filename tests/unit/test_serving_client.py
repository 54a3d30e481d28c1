"""The client benchmark's summary over rounds: each plugin server's median ratio to its own
round's stock and the range, so one noisy run does not decide a target; the multi-turn workload's
trace is one SGLang's client loads and replays as conversations (at concurrency 8 and, on
request, 16); ``--rows`` keeps stock first."""

import pytest

from benchmarks.perf_workload import QUESTIONS, popular_images
from benchmarks.serving_client import (
    TRACE,
    client_row,
    image_trace,
    ratios,
    selected,
    servers,
    summary,
)


def _row(workload, server, r, tok, tpot, ttft):
    row = {"workload": workload, "server": server, "round": r}
    if server != "stock":
        row.update(tok_s_vs_stock=tok, tpot_vs_stock=tpot, ttft_vs_stock=ttft)
    return row


def test_the_summary_is_the_median_and_range_of_each_rounds_ratio():
    rows = []
    for r, (tok, tpot) in enumerate([(1.02, 1.05), (1.21, 0.79), (0.99, 1.01)], 1):
        rows += [_row("pool free", "stock", r, 0, 0, 0),
                 _row("pool free", "shipped", r, tok, tpot, 0.9),
                 _row("pool free", "knorm", r, tok + 0.2, tpot - 0.2, 0.8)]
    rows.append(_row("pool binds", "stock", 1, 0, 0, 0))
    rows.append(_row("pool binds", "shipped", 1, 1.6, 1.3, 0.4))
    got = summary(rows)
    assert [(e["workload"], e["server"], e["rounds"]) for e in got] == [
        ("pool free", "shipped", 3), ("pool free", "knorm", 3), ("pool binds", "shipped", 1)]
    assert got[0]["tok_s_vs_stock"] == "1.02x (0.99-1.21)"
    assert got[0]["tpot_vs_stock"] == "1.01x (0.79-1.05)"
    assert got[1]["tpot_vs_stock"] == "0.81x (0.59-0.85)"
    assert got[2]["ttft_vs_stock"] == "0.40x (0.40-0.40)"


def test_the_multi_turn_trace_is_one_sglang_replays_turn_by_turn(tmp_path):
    datasets = pytest.importorskip("sglang.benchmark.datasets.agentic_trace")
    serving = pytest.importorskip("sglang.benchmark.serving")
    path = image_trace(tmp_path / "trace.json", conversations=6, turns=3)
    rows = datasets.AgenticTraceDataset(dataset_path=str(path), num_requests=6,
                                        fixed_output_len=16, offset=0,
                                        max_turns=None).load(tokenizer=None)
    assert len(rows) == 6 and all(len(row.prompt) == 3 for row in rows)
    # what the client tests before it replays rows round by round, the answers fed back
    assert serving._normalize_round_messages(rows[0].prompt[0]) is not None
    first = rows[0].prompt[0][0]["content"]
    assert first[0]["type"] == "image_url" and first[1]["text"] == QUESTIONS[0]
    assert [r.prompt[1][0]["content"] for r in rows] == [QUESTIONS[1]] * 6
    # the workload's draw: conversations about the same image send the same image
    urls = [row.prompt[0][0]["content"][0]["image_url"]["url"] for row in rows]
    picks = popular_images(24, 6, 1.1, 0)
    assert [urls.index(u) for u in urls] == [picks.index(p) for p in picks]


def test_rows_run_stock_first_and_only_the_named_plugin_servers(tmp_path):
    config = tmp_path / "policy.json"
    every = list(servers(config))
    assert every[0] == "stock" and len(every) == 4
    assert list(servers(config, only="shipped")) == ["stock", "`--unicache` (defaults as shipped)"]
    assert list(servers(config, only="knorm,shipped")) == [
        "stock", "`--unicache` (defaults as shipped)", "knorm keep 0.1, self-check off"]
    assert list(servers(config, only="nothing like it")) == ["stock"]


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_busy_chats_are_the_multi_turn_chats_at_twice_the_concurrency_and_run_on_request():
    default = selected("pool free,pool binds,multi-turn".split(","))
    assert not any("busy" in name for name in default)  # the default run is unchanged
    (chats, parts), = selected(["multi-turn"]).items()
    (busy, busy_parts), = selected(["busy chats"]).items()
    assert TRACE in busy_parts["client"] and busy_parts["server"] == parts["server"]
    assert _flag(busy_parts["client"], "--num-prompts") == _flag(parts["client"], "--num-prompts")
    assert int(_flag(busy_parts["client"], "--max-concurrency")) == 2 * int(
        _flag(parts["client"], "--max-concurrency"))


def test_ratios_to_stock_come_from_the_clients_numbers_not_the_tables_rounding():
    stock = {"output_throughput": 2.0287, "mean_tpot_ms": 1205.64, "mean_ttft_ms": 102674.0}
    plugin = {"output_throughput": 3.8609, "mean_tpot_ms": 2505.05, "mean_ttft_ms": 24501.5}
    row = client_row("busy chats", "shipped", plugin, {"images_compressed": 147})
    assert row["output_tok_s"] == 3.86 and row["images_compressed"] == 147
    got = ratios(plugin, stock)
    assert got == {"tok_s_vs_stock": 1.9, "tpot_vs_stock": 2.08, "ttft_vs_stock": 0.24}
    assert round(round(3.8609, 1) / round(2.0287, 1), 2) == 1.95  # what one decimal would say
