"""The second synthetic task (``task="grid"``): answers true to the scene, questions of
one image on disjoint regions, coordinates in the background, and the default task untouched."""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from benchmarks.quality.vqa_data import (
    CELL,
    COLOURS,
    GRID_LONG_ANSWER_QTYPES,
    GRID_QTYPES,
    NUMBERS,
    QTYPES,
    SHAPES,
    VOCAB_WORDS,
    ask,
    image_items,
    make_split,
)

GRID = 8  # the grid of both trained checkpoints (224 px, 64 visual tokens)
CHECKPOINTS = Path(__file__).resolve().parents[2] / "assets" / "checkpoints"


def _digest(items) -> str:
    h = hashlib.sha256()
    for it in items:
        h.update(repr((it.question, it.answer, it.qtype, it.image_id, it.question_index,
                       it.scene.grid, it.scene.texture_seed,
                       [(o.row, o.col, o.colour, o.shape) for o in it.scene.objects])).encode())
        h.update(it.image.tobytes())
    return h.hexdigest()


def test_default_task_unchanged():
    """Digests computed with vqa_data.py as it was before the grid task was added: the default
    task's items (questions, answers, scenes, pixels) and its vocabulary are byte-identical."""
    assert _digest(make_split("test", 6, 5, seed=0, grid=8)) == \
        "6752525b8f693f16651552c9791d5d461f8075add9da9352052fb46b46d44e3a"
    assert _digest(make_split("validation", 4, 4, seed=3, grid=16, qtypes=QTYPES)) == \
        "188ee9c8d6d22467eb0ffc03672bd26daeeb9486c38a8964ae5f6184bcad709b"
    assert _digest(image_items("train", 0, 100000, grid=8, questions_per_image=6)) == \
        "4821f28cec8b7e8487a9352f87c1cb03bd9961aa952cc9e869d7f268edf1914c"
    # The training script builds its tokenizer from VOCAB_WORDS: unchanged, so the same ids.
    assert hashlib.sha256(" ".join(VOCAB_WORDS).encode()).hexdigest() == \
        "6789ae214618e0a563af8bdbbb07ee7c5e65e8a2e56727fdd205ca84c7b858a0"


@pytest.fixture(scope="module")
def items():
    return make_split("test", 40, questions_per_image=5, seed=0, grid=GRID, task="grid")


def _num(word: str) -> int:
    return NUMBERS.index(word)


def test_answers_consistent_with_scene(items):
    for it in items:
        scene, words = it.scene, it.question.rstrip("?").split()
        row = _num(words[words.index("row") + 1]) - 1
        in_row = [o for o in scene.objects if o.row == row]
        if it.qtype in ("cell_colour", "cell_shape"):
            col = _num(words[words.index("column") + 1]) - 1
            obj = [o for o in scene.objects if (o.row, o.col) == (row, col)]
            assert it.region == (row * GRID + col,)
            if not obj:
                assert it.answer == "none"
            else:
                assert it.answer == (obj[0].colour if it.qtype == "cell_colour" else obj[0].shape)
        else:
            assert it.region == tuple(range(row * GRID, (row + 1) * GRID))
            if it.qtype == "count_row":
                assert it.answer == NUMBERS[len(in_row)]
            elif it.qtype == "empty_row":
                assert it.answer == NUMBERS[GRID - len(in_row)]
            elif it.qtype == "row_colours":
                assert it.answer.split() == (
                    [c for c in COLOURS if any(o.colour == c for o in in_row)] or ["none"])
            else:
                raise AssertionError(it.qtype)
        if it.qtype not in GRID_LONG_ANSWER_QTYPES:
            assert len(it.answer.split()) == 1


def test_questions_of_an_image_look_at_different_cells(items):
    by_image: dict[str, list] = {}
    for it in items:
        by_image.setdefault(it.image_id, []).append(it)
    assert len(by_image) == 40
    for group in by_image.values():
        assert len(group) == 5
        assert [i.question_index for i in group] == list(range(5))
        assert all(i.image is group[0].image and i.scene is group[0].scene for i in group)
        regions = [set(i.region) for i in group]
        assert all(regions)
        rows = {next(iter(r)) // GRID for r in regions}
        assert len(rows) == len(group), "one row per question"
        for a in range(len(regions)):
            for b in range(a + 1, len(regions)):
                assert regions[a].isdisjoint(regions[b])


def test_coverage_and_balance(items):
    counts = Counter(i.qtype for i in items)
    assert set(counts) == set(GRID_QTYPES)
    for qtype in GRID_QTYPES:
        answers = Counter(i.answer for i in items if i.qtype == qtype)
        assert len(answers) > 2, qtype
        assert answers.most_common(1)[0][1] <= 0.6 * sum(answers.values()), qtype
    cells = [i for i in items if i.qtype in ("cell_colour", "cell_shape")]
    assert any(i.answer == "none" for i in cells) and any(i.answer != "none" for i in cells)
    objs = [o for g in {id(i.scene): i.scene for i in items}.values() for o in g.objects]
    assert 0.2 < sum(o.small for o in objs) / len(objs) < 0.5, "small objects are common"


def test_pixels_encode_coordinates_and_objects(items):
    names = list(COLOURS)
    for it in items[::25]:
        scene = it.scene
        step = scene.coord_step
        px = np.asarray(it.image).astype(int)
        assert px.shape == (GRID * CELL, GRID * CELL, 3)
        cells = px.reshape(GRID, CELL, GRID, CELL, 3).transpose(0, 2, 1, 3, 4)
        colour_ids, shape_ids = scene.cell_targets()
        for k, cid in enumerate(colour_ids):
            r, c = divmod(k, GRID)
            cell = cells[r, c]
            if cid == 0:
                mean = cell.reshape(-1, 3).mean(0)
                assert abs((mean[0] - mean[1]) - step * r) < step / 2, "red encodes the row"
                assert abs((mean[2] - mean[1]) - step * c) < step / 2, "blue encodes the column"
                assert cell.max() < 140
            else:
                assert shape_ids[k] > 0
                centre = cell[13:16, 13:16].reshape(-1, 3).mean(0)
                dists = {n: np.abs(centre - np.array(v)).sum() for n, v in COLOURS.items()}
                assert min(dists, key=dists.get) == names[cid - 1]
        bg = [cells[k // GRID, k % GRID].tobytes() for k, c in enumerate(colour_ids) if c == 0]
        assert len(set(bg)) == len(bg)


def test_deterministic_and_independent_of_the_default_task():
    a = make_split("validation", 3, 4, seed=1, grid=GRID, task="grid")
    b = make_split("validation", 3, 4, seed=1, grid=GRID, task="grid")
    assert _digest(a) == _digest(b)
    assert [i.region for i in a] == [i.region for i in b]
    default = make_split("validation", 3, 4, seed=1, grid=GRID)
    assert {i.image_id for i in a}.isdisjoint({i.image_id for i in default})
    assert all(i.scene.coords for i in a) and not any(i.scene.coords for i in default)
    # A grid image asks at most one question per row.
    assert len(image_items("test", 0, 0, grid=4, questions_per_image=9, task="grid")) == 4


def test_ask_and_errors():
    scene = make_split("test", 1, 1, grid=GRID, task="grid")[0].scene
    rng = random.Random(0)
    for qtype in GRID_QTYPES:
        question, answer = ask(scene, qtype, rng)
        assert question.endswith("?") and answer
    with pytest.raises(ValueError):
        make_split("test", 1, 1, grid=GRID, task="grid", qtypes=("count_all",))
    with pytest.raises(ValueError):
        make_split("test", 1, 1, grid=GRID, qtypes=("count_row",))
    with pytest.raises(ValueError):
        make_split("test", 1, 1, grid=GRID, task="nonsense")
    assert SHAPES


def test_grid_words_are_single_tokens_of_the_bundled_tokenizer(items):
    """Answers and the row / column numbers are one token each in the word-level tokenizer the
    checkpoints share (no vocabulary change was needed)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(CHECKPOINTS / "tiny-vqa-qwen2-vl")
    words = {w for i in items for w in i.answer.split()} | set(NUMBERS[1:GRID + 1])
    words |= {"row", "column", "none", "objects", "object"}
    for w in sorted(words):
        assert len(tok.tokenize(" " + w)) == 1, w
    for it in items[:10]:
        assert len(tok(it.answer + "<|im_end|>", add_special_tokens=False)["input_ids"]) == \
            len(it.answer.split()) + 1


def test_grid_checkpoint_matches_the_bundled_architecture():
    grid_dir = CHECKPOINTS / "tiny-grid-qwen2-vl"
    if not grid_dir.is_dir():
        pytest.skip("grid checkpoint not built")
    a = json.loads((CHECKPOINTS / "tiny-vqa-qwen2-vl" / "config.json").read_text())
    b = json.loads((grid_dir / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "vocab_size", "intermediate_size"):
        assert a[key] == b[key], key
    assert a["vision_config"]["embed_dim"] == b["vision_config"]["embed_dim"]
    args = json.loads((grid_dir / "training_args.json").read_text())
    assert args["task"] == "grid" and args["grid"] == GRID
    for name in ("model.safetensors", "tokenizer.json", "training_log.jsonl",
                 "processor_config.json", "chat_template.jinja"):
        assert (grid_dir / name).is_file(), name
    assert (grid_dir / "tokenizer.json").read_text() == \
        (CHECKPOINTS / "tiny-vqa-qwen2-vl" / "tokenizer.json").read_text()
