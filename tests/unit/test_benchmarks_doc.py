"""BENCHMARKS.md is rendered from the stamped parts in benchmarks/results/ and must be current."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from tools import benchmarks_doc
from tools.benchmarks_doc import PARTS, RESULTS, STAMP_FIELDS, PartError, load, render, validate

DOC = Path(__file__).resolve().parents[2] / "BENCHMARKS.md"


def test_benchmarks_md_is_the_rendering_of_the_part_files():
    assert DOC.read_text() == render(), (
        "BENCHMARKS.md is stale: python -m tools.benchmarks_doc > BENCHMARKS.md")


@pytest.mark.parametrize("name", PARTS)
def test_every_part_is_stamped_and_has_its_command(name):
    part = json.loads((RESULTS / f"{name}.json").read_text())
    for field in STAMP_FIELDS:
        assert isinstance(part["stamp"].get(field), str) and part["stamp"][field].strip(), (
            f"{name}: stamp lacks {field}")
    assert part["command"].strip(), f"{name}: no command"
    validate(part, name)


def test_the_results_folder_holds_exactly_the_listed_parts():
    assert sorted(path.stem for path in RESULTS.glob("*.json")) == sorted(PARTS)
    assert len(set(PARTS)) == len(PARTS)
    assert set(load()) == set(PARTS)


def test_no_unstamped_results_files_are_left_beside_the_parts():
    old = sorted(path.name for path in RESULTS.parent.glob("*.json"))
    assert not old, f"results outside benchmarks/results/ carry no stamp: {old}"


def _a_part() -> dict:
    return json.loads((RESULTS / f"{PARTS[0]}.json").read_text())


@pytest.mark.parametrize("field", STAMP_FIELDS)
def test_a_part_without_a_stamp_field_is_refused(field):
    part = _a_part()
    del part["stamp"][field]
    with pytest.raises(PartError, match=field):
        validate(part, "broken")


@pytest.mark.parametrize("field", ["command", "stamp", "title", "config", "tables", "notes"])
def test_a_part_without_a_command_or_another_field_is_refused(field):
    part = _a_part()
    del part[field]
    with pytest.raises(PartError, match=field):
        validate(part, "broken")
    part = _a_part()
    part[field] = "" if isinstance(part[field], str) else []
    with pytest.raises(PartError):
        validate(part, "broken")


def test_a_table_with_its_own_stamp_needs_every_field_and_rows_fit_the_columns():
    part = _a_part()
    table = part["tables"][0]
    table["stamp"] = copy.deepcopy(part["stamp"])
    validate(part, "fine")
    del table["stamp"]["commit"]
    with pytest.raises(PartError, match="commit"):
        validate(part, "broken")
    part = _a_part()
    part["tables"][0]["rows"][0].append("one cell too many")
    with pytest.raises(PartError, match="cells"):
        validate(part, "broken")
    part = _a_part()
    part["tables"][0]["rows"][0][0] = "a | b"
    with pytest.raises(PartError, match="cell"):
        validate(part, "broken")


def test_an_unlisted_part_file_is_refused(tmp_path):
    for name in PARTS:
        (tmp_path / f"{name}.json").write_text((RESULTS / f"{name}.json").read_text())
    (tmp_path / "results-something.json").write_text(json.dumps(_a_part()))
    with pytest.raises(PartError, match="results-something"):
        render(tmp_path)


def test_wrapped_prose_never_starts_a_line_with_a_markdown_block():
    for n in range(30, 60):  # the line breaks fall on every word of the tail in turn
        lines = benchmarks_doc.wrap("ab " * n + ">= 8x - b + c # d 1. e | f = g", "- ", "  ")
        assert len(lines) > 1
        for line in lines[1:]:
            first = line.split()[0]
            assert first not in {"-", "+", "*", "1.", "="} and first[0] not in ">#|", line
        assert all(len(line) <= 100 for line in lines if not line.endswith((">=", "-", "+",
                                                                            "#", "1.", "|", "=")))


def test_cpu_kind_says_whether_bf16_matmul_is_native(tmp_path) -> None:
    from tools.benchmarks_doc import cpu_kind

    info = tmp_path / "cpuinfo"
    info.write_text("model name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma\n\n"
                    "model name\t: other\nflags\t\t: avx512_bf16\n")
    assert cpu_kind(info) == "AMD EPYC, AVX2, no native bf16 matmul"  # the first CPU's fields
    info.write_text("model name\t: Xeon\nflags\t\t: avx2 avx512f avx512_bf16 amx_bf16\n")
    assert cpu_kind(info) == "Xeon, native bf16 matmul"
    assert cpu_kind(tmp_path / "missing") == "unknown CPU"
