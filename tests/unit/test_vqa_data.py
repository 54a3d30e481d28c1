"""The synthetic visual-QA generator: deterministic, disjoint splits, answers true to the scene."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from benchmarks.quality.vqa_data import (
    CELL,
    COLOURS,
    DEFAULT_QTYPES,
    LONG_ANSWER_QTYPES,
    MULTI_OBJECT_QTYPES,
    NUMBERS,
    QTYPES,
    SHAPES,
    VOCAB_WORDS,
    ask,
    image_items,
    make_split,
)

GRID = 8  # small images keep the tests fast; the production grid is 16 (448 px)


@pytest.fixture(scope="module")
def items():
    return make_split("test", 40, questions_per_image=5, seed=0, grid=GRID, qtypes=QTYPES)


def _scene_key(item):
    return tuple(item.scene.objects), item.scene.texture_seed


def test_same_seed_same_items():
    a = make_split("validation", 6, questions_per_image=3, seed=7, grid=GRID)
    b = make_split("validation", 6, questions_per_image=3, seed=7, grid=GRID)
    assert [(i.question, i.answer, i.qtype, i.image_id, i.question_index) for i in a] == \
           [(i.question, i.answer, i.qtype, i.image_id, i.question_index) for i in b]
    for x, y in zip(a, b, strict=True):
        assert x.image.tobytes() == y.image.tobytes()
    # A prefix of a split is the same as the smaller split (items are per-image functions).
    c = make_split("validation", 3, questions_per_image=3, seed=7, grid=GRID)
    assert [i.question for i in c] == [i.question for i in a[:len(c)]]
    assert image_items("validation", 7, 2, grid=GRID, questions_per_image=3)[0].image.tobytes() \
        == a[6].image.tobytes()


def test_other_seed_differs():
    a = make_split("train", 5, seed=0, grid=GRID)
    b = make_split("train", 5, seed=1, grid=GRID)
    assert {_scene_key(i) for i in a}.isdisjoint({_scene_key(i) for i in b})


def test_splits_disjoint():
    keys = {}
    for name in ("train", "validation", "test"):
        split = make_split(name, 60, seed=0, grid=GRID)
        keys[name] = {_scene_key(i) for i in split}
        assert len(keys[name]) == 60
        assert {i.image_id.split("-")[0] for i in split} == {name}
    assert keys["train"].isdisjoint(keys["validation"])
    assert keys["train"].isdisjoint(keys["test"])
    assert keys["validation"].isdisjoint(keys["test"])


def test_image_size_matches_merged_tokens():
    for grid in (4, 8, 16):
        item = make_split("test", 1, grid=grid)[0]
        assert item.image.size == (grid * CELL, grid * CELL)
        assert item.image.mode == "RGB"
        colour, shape = item.scene.cell_targets()
        assert colour.shape == shape.shape == (grid * grid,)  # one target per merged token


def test_cells_hold_what_the_scene_says(items):
    """Object cells show their colour; background cells are dark, textured and not identical."""
    for item in items[::5]:
        px = np.asarray(item.image).astype(int)
        cells = px.reshape(GRID, CELL, GRID, CELL, 3).transpose(0, 2, 1, 3, 4)
        colour_ids, _ = item.scene.cell_targets()
        names = list(COLOURS)
        for k, cid in enumerate(colour_ids):
            cell = cells[k // GRID, k % GRID]
            if cid == 0:
                assert cell.max() < 120, "background must stay dark"
                assert cell.std() > 1.0, "background is lightly textured"
            else:
                centre = cell[12:17, 12:17].reshape(-1, 3).mean(0)
                dists = {n: np.abs(centre - np.array(c)).sum() for n, c in COLOURS.items()}
                assert min(dists, key=dists.get) == names[cid - 1]
        bg = [cells[k // GRID, k % GRID].tobytes() for k, c in enumerate(colour_ids) if c == 0]
        assert len(set(bg)) == len(bg), "no two background cells are identical"


def test_answers_consistent_with_scene(items):
    for item in items:
        objs = item.scene.objects
        q, a = item.question, item.answer
        rows = [o.row for o in objs]
        assert rows == sorted(set(rows)), "objects sit on distinct rows, listed top to bottom"
        if item.qtype == "colour_of_shape":
            shape = q.removeprefix("What colour is the ").removesuffix("?")
            matches = [o for o in objs if o.shape == shape]
            assert len(matches) == 1 and matches[0].colour == a
        elif item.qtype == "shape_of_colour":
            colour = q.removeprefix("What shape is the ").removesuffix(" object?")
            matches = [o for o in objs if o.colour == colour]
            assert len(matches) == 1 and matches[0].shape == a
        elif item.qtype == "count_colour":
            colour = q.removeprefix("How many ").removesuffix(" objects are there?")
            assert a == NUMBERS[sum(o.colour == colour for o in objs)]
        elif item.qtype == "count_all":
            assert a == NUMBERS[len(objs)]
        elif item.qtype == "same_colour":
            words = q.split()
            s1, s2 = words[2], words[5]
            o1 = [o for o in objs if o.shape == s1]
            o2 = [o for o in objs if o.shape == s2]
            assert len(o1) == len(o2) == 1 and s1 != s2
            assert a == ("yes" if o1[0].colour == o2[0].colour else "no")
        elif item.qtype == "list_colours":
            assert a.split() == [o.colour for o in objs]
        elif item.qtype == "list_shapes":
            assert a.split() == [o.shape for o in objs]
        elif item.qtype == "colours_present":
            assert a.split() == [c for c in COLOURS if any(o.colour == c for o in objs)]
        else:
            raise AssertionError(item.qtype)
        if item.qtype not in LONG_ANSWER_QTYPES:
            assert len(a.split()) == 1, "short answers are single words"
        assert set((q.lower().rstrip("?.") + " " + a).split()) <= set(VOCAB_WORDS)


def test_question_type_coverage(items):
    counts = Counter(i.qtype for i in items)
    assert set(counts) == set(QTYPES)
    assert {"count_all", "same_colour"} <= set(DEFAULT_QTYPES) & set(MULTI_OBJECT_QTYPES)
    assert set(LONG_ANSWER_QTYPES) & set(DEFAULT_QTYPES)
    long_items = [i for i in items if i.qtype in LONG_ANSWER_QTYPES]
    assert max(len(i.answer.split()) for i in long_items) >= 4
    # Answers of each short type are not all the same (no trivial constant answer).
    for qtype in ("colour_of_shape", "shape_of_colour", "count_colour", "count_all",
                  "same_colour"):
        assert len({i.answer for i in items if i.qtype == qtype}) > 1, qtype


def test_questions_per_image(items):
    by_image: dict[str, list] = {}
    for item in items:
        by_image.setdefault(item.image_id, []).append(item)
    assert len(by_image) == 40
    for group in by_image.values():
        assert [i.question_index for i in group] == list(range(len(group)))
        assert len({i.question for i in group}) == len(group), "distinct questions per image"
        assert all(i.image is group[0].image for i in group)
    assert sum(len(g) == 5 for g in by_image.values()) >= 36


def test_unaskable_returns_none():
    from benchmarks.quality.vqa_data import Scene, SceneObject

    scene = Scene(grid=4, objects=(SceneObject(0, 0, "red", "circle"),
                                   SceneObject(1, 1, "red", "circle")), texture_seed=1)
    rng = random.Random(0)
    assert ask(scene, "colour_of_shape", rng) is None
    assert ask(scene, "shape_of_colour", rng) is None
    assert ask(scene, "same_colour", rng) is None
    assert ask(scene, "count_colour", rng)[1] in NUMBERS
    assert ask(scene, "list_shapes", rng) == (
        "List the shapes of the objects from top to bottom.", "circle circle")
    with pytest.raises(ValueError):
        ask(scene, "nonsense", rng)
    assert SHAPES and COLOURS
