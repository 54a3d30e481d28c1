"""Deterministic synthetic visual-QA items (DESIGN.md §6).

An image is a ``grid`` x ``grid`` board of 28 x 28 px cells, so each cell is exactly one merged
Qwen2-VL visual token (14 px patches, 2 x 2 merge): ``grid=16`` gives a 448 px image and 256
visual tokens, merged token ``k`` is cell ``(k // grid, k % grid)``. Most cells are background
(dark grey, per-cell tint and light texture, no two alike); a few cells hold one coloured shape
each, on distinct rows so "top to bottom" is a strict order. Questions come after the image and are
content-addressed, so each answer lives in one or a few specific visual tokens:

============== ============================================== ===================
qtype          question                                       answer
============== ============================================== ===================
colour_of_shape What colour is the circle?                    red
shape_of_colour What shape is the red object?                 circle
count_colour    How many red objects are there?               two
count_all       How many objects are there?  (multi-object)   four
same_colour     Are the circle and the square the same        yes / no
                colour?  (multi-object)
list_colours    List the colours of the objects from top to   red blue red white
                bottom.  (long answer)
list_shapes     List the shapes of the objects from top to    circle square ...
                bottom.  (long answer, optional)
colours_present Which colours are in the image?  (long        red blue white
                answer; colours in COLOURS order, no position)
============== ============================================== ===================

Answers are unambiguous by construction: a shape (colour) is only asked about when exactly one
object has it. Items are a pure function of ``(split name, seed, index, parameters)``; different
split names draw from independent streams.

    from benchmarks.quality.vqa_data import make_split
    test = make_split("test", n_images=100, questions_per_image=5, seed=0, grid=16)

The second task, ``task="grid"``, asks about places instead of things, so the
questions about one image look at different regions and some of them need the background:

============== ============================================== ===================
qtype          question                                       answer
============== ============================================== ===================
cell_colour     What colour is the object in row three column  red / none (empty)
                five?
cell_shape      What shape is the object in row three column   circle / none
                five?
count_row       How many objects are in row three?            two
empty_row       How many empty cells are in row three?        six
row_colours     Which colours are in row three?  (long        red white / none
                answer; colours in COLOURS order)
============== ============================================== ===================

Its scenes fill each cell independently (density drawn per image, so rows hold zero to all
``grid`` objects), about a third of the objects are small (half size), and the background of
every cell encodes its coordinates: the red channel rises with the row, the blue one with the
column (``coord_step`` per step). That shading is the model's position signal: the tiny model's
M-RoPE gives rows and columns only its lowest rotary frequencies (head_dim 32: under 0.04 rad per
row), too little to single out a row, and its 3-layer vision tower has no absolute positions.
Rows and columns are numbered from one ("row one" is the top row). The questions of one image
each take a different row, so their regions never overlap (``VQAItem.region``).

    grid_test = make_split("test", 30, questions_per_image=5, seed=0, grid=8, task="grid")
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageDraw

CELL = 28  # pixels per merged visual token (patch 14 x spatial merge 2)

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 190, 60),
    "blue": (50, 90, 235),
    "yellow": (240, 220, 40),
    "purple": (150, 60, 205),
    "orange": (250, 140, 20),
    "white": (245, 245, 245),
}
SHAPES = ("square", "circle", "triangle", "cross")
NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")

QTYPES = ("colour_of_shape", "shape_of_colour", "count_colour", "count_all", "same_colour",
          "list_colours", "list_shapes", "colours_present")
DEFAULT_QTYPES = ("colour_of_shape", "shape_of_colour", "count_colour", "count_all",
                  "same_colour", "list_colours", "colours_present")
MULTI_OBJECT_QTYPES = ("count_all", "same_colour", "list_colours", "list_shapes",
                       "colours_present")
LONG_ANSWER_QTYPES = ("list_colours", "list_shapes", "colours_present")

# The grid task (module doc): positional and background questions.
TASKS = ("vqa", "grid")
GRID_QTYPES = ("cell_colour", "cell_shape", "count_row", "empty_row", "row_colours")
GRID_CELL_QTYPES = ("cell_colour", "cell_shape")
GRID_COUNT_QTYPES = ("count_row", "empty_row")
GRID_LONG_ANSWER_QTYPES = ("row_colours",)
GRID_DENSITY = (0.1, 0.45)  # per-image probability that a cell holds an object (uniform draw)
GRID_SMALL_P = 0.35  # share of small (half-size) objects
GRID_OCCUPIED_P = 0.75  # a cell question picks an occupied cell of its row this often (if any)
ALL_QTYPES = QTYPES + GRID_QTYPES

_QUESTION_WORDS = (
    "what colour is the shape object how many objects are there and same list colours shapes of "
    "from top to bottom yes no which in image"
)
# Every word a question or answer uses (for the tokenizer corpus, so answers are few tokens).
VOCAB_WORDS: tuple[str, ...] = tuple(dict.fromkeys(
    _QUESTION_WORDS.split() + list(COLOURS) + list(SHAPES) + list(NUMBERS)))


@dataclass(frozen=True)
class SceneObject:
    row: int
    col: int
    colour: str
    shape: str
    small: bool = False  # half size (grid task)


@dataclass(frozen=True)
class Scene:
    grid: int
    objects: tuple[SceneObject, ...]  # sorted top to bottom (rows distinct, except grid scenes:
    #                                    row-major there)
    texture_seed: int
    coords: bool = False  # background shading encodes each cell's row and column (grid task)

    @property
    def coord_step(self) -> int:
        """Background level step per row (red) and per column (blue) of a ``coords`` scene."""
        return max(2, 64 // max(1, self.grid - 1))

    def at(self, row: int, col: int) -> SceneObject | None:
        return next((o for o in self.objects if o.row == row and o.col == col), None)

    def cell_targets(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-cell class ids in merged-token order (row-major): colour and shape, 0 = background.

        Colour ids are ``1 + index in COLOURS``, shape ids ``1 + index in SHAPES``.
        """
        colour = np.zeros(self.grid * self.grid, dtype=np.int64)
        shape = np.zeros(self.grid * self.grid, dtype=np.int64)
        names = list(COLOURS)
        for o in self.objects:
            colour[o.row * self.grid + o.col] = 1 + names.index(o.colour)
            shape[o.row * self.grid + o.col] = 1 + SHAPES.index(o.shape)
        return colour, shape


@dataclass
class VQAItem:
    image: Image.Image
    question: str
    answer: str
    qtype: str
    image_id: str
    question_index: int = 0  # position among this image's questions (0 warms the cache)
    scene: Scene | None = field(default=None, repr=False)
    # Merged-token indices (row-major cells) the question is about; () = not recorded (the
    # content-addressed default task). Grid-task questions of one image have disjoint regions.
    region: tuple[int, ...] = ()


# --------------------------------------------------------------------------- scenes


def random_scene(rng: random.Random, grid: int, min_objects: int = 3,
                 max_objects: int = 6, shared_colour_p: float = 0.5) -> Scene:
    """Objects on distinct rows and cells; with ``shared_colour_p`` two of them share a colour
    (so counts above one and "same colour: yes" occur often enough)."""
    hi = min(max_objects, grid)
    n = rng.randint(min(min_objects, hi), hi)
    rows = sorted(rng.sample(range(grid), n))
    colours = [rng.choice(list(COLOURS)) for _ in rows]
    shapes = [rng.choice(SHAPES) for _ in rows]
    if n >= 2 and rng.random() < shared_colour_p:
        a, b = rng.sample(range(n), 2)
        colours[b] = colours[a]
        # Prefer a shape nobody else has, so "are the X and the Y the same colour?" can be yes.
        free = [s for s in SHAPES if s not in shapes[:b] + shapes[b + 1:]]
        if free:
            shapes[b] = rng.choice(free)
    objects = tuple(
        SceneObject(row=r, col=rng.randrange(grid), colour=c, shape=s)
        for r, c, s in zip(rows, colours, shapes, strict=True)
    )
    return Scene(grid=grid, objects=objects, texture_seed=rng.getrandbits(63))


def _draw_shape(draw: ImageDraw.ImageDraw, x: int, y: int, shape: str,
                colour: tuple[int, int, int]) -> None:
    if shape == "square":
        draw.rectangle((x + 5, y + 5, x + 22, y + 22), fill=colour)
    elif shape == "circle":
        draw.ellipse((x + 4, y + 4, x + 23, y + 23), fill=colour)
    elif shape == "triangle":
        draw.polygon([(x + 14, y + 3), (x + 24, y + 23), (x + 3, y + 23)], fill=colour)
    elif shape == "cross":
        draw.rectangle((x + 11, y + 3, x + 16, y + 24), fill=colour)
        draw.rectangle((x + 3, y + 11, x + 24, y + 16), fill=colour)
    else:
        raise ValueError(f"unknown shape {shape!r}")


def _draw_small_shape(draw: ImageDraw.ImageDraw, x: int, y: int, shape: str,
                      colour: tuple[int, int, int]) -> None:
    """The shape at half size, centred in its cell (about 9 px across)."""
    if shape == "square":
        draw.rectangle((x + 10, y + 10, x + 18, y + 18), fill=colour)
    elif shape == "circle":
        draw.ellipse((x + 9, y + 9, x + 19, y + 19), fill=colour)
    elif shape == "triangle":
        draw.polygon([(x + 14, y + 8), (x + 19, y + 19), (x + 9, y + 19)], fill=colour)
    elif shape == "cross":
        draw.rectangle((x + 13, y + 8, x + 15, y + 20), fill=colour)
        draw.rectangle((x + 8, y + 13, x + 20, y + 15), fill=colour)
    else:
        raise ValueError(f"unknown shape {shape!r}")


def _coords_background(scene: Scene, rng: np.random.Generator) -> np.ndarray:
    """Grid-task background: dark grey, red channel + ``coord_step`` per row, blue channel +
    ``coord_step`` per column, small tint, the same stripes and texture as the default."""
    g, step = scene.grid, scene.coord_step
    level = rng.integers(28, 44, size=(g, g, 1))
    code = np.zeros((g, g, 3), dtype=np.int64)
    code[..., 0] = step * np.arange(g)[:, None]
    code[..., 2] = step * np.arange(g)[None, :]
    tint = rng.integers(-2, 3, size=(g, g, 3))
    base = np.repeat(np.repeat(level + code + tint, CELL, axis=0), CELL, axis=1)
    period = np.repeat(np.repeat(rng.integers(3, 8, size=(g, g)), CELL, 0), CELL, 1)
    phase = np.repeat(np.repeat(rng.integers(0, 7, size=(g, g)), CELL, 0), CELL, 1)
    yy, xx = np.mgrid[0:g * CELL, 0:g * CELL]
    stripe = np.where((xx + yy + phase) % period == 0, 8, 0)[..., None]
    noise = rng.integers(-5, 6, size=(g * CELL, g * CELL, 3))
    return np.clip(base + stripe + noise, 0, 255).astype(np.uint8)


def render_scene(scene: Scene) -> Image.Image:
    """The RGB image: ``grid * 28`` px square, one cell per merged visual token."""
    g = scene.grid
    rng = np.random.default_rng(scene.texture_seed)
    if scene.coords:
        img = Image.fromarray(_coords_background(scene, rng), "RGB")
        draw = ImageDraw.Draw(img)
        for o in scene.objects:
            jitter = rng.integers(-12, 13, size=3)
            colour = tuple(int(v) for v in np.clip(np.array(COLOURS[o.colour]) + jitter, 0, 255))
            (_draw_small_shape if o.small else _draw_shape)(draw, o.col * CELL, o.row * CELL,
                                                            o.shape, colour)
        return img
    # Per-cell background: dark grey level plus a small tint, then light per-pixel texture and a
    # faint stripe of per-cell period/phase, so background cells are never identical.
    level = rng.integers(30, 76, size=(g, g, 1))
    tint = rng.integers(-8, 9, size=(g, g, 3))
    base = np.repeat(np.repeat(level + tint, CELL, axis=0), CELL, axis=1)
    period = np.repeat(np.repeat(rng.integers(3, 8, size=(g, g)), CELL, 0), CELL, 1)
    phase = np.repeat(np.repeat(rng.integers(0, 7, size=(g, g)), CELL, 0), CELL, 1)
    yy, xx = np.mgrid[0:g * CELL, 0:g * CELL]
    stripe = np.where((xx + yy + phase) % period == 0, 10, 0)[..., None]
    noise = rng.integers(-6, 7, size=(g * CELL, g * CELL, 3))
    pixels = np.clip(base + stripe + noise, 0, 255).astype(np.uint8)
    img = Image.fromarray(pixels, "RGB")
    draw = ImageDraw.Draw(img)
    for o in scene.objects:
        jitter = rng.integers(-12, 13, size=3)
        colour = tuple(int(v) for v in np.clip(np.array(COLOURS[o.colour]) + jitter, 0, 255))
        _draw_shape(draw, o.col * CELL, o.row * CELL, o.shape, colour)
    return img


# --------------------------------------------------------------------------- questions


def _number(n: int) -> str:
    return NUMBERS[n] if n < len(NUMBERS) else str(n)


def ask(scene: Scene, qtype: str, rng: random.Random) -> tuple[str, str] | None:
    """One (question, answer) of ``qtype`` about ``scene``, or None when it cannot be asked
    unambiguously."""
    objs = scene.objects
    by_shape = Counter(o.shape for o in objs)
    by_colour = Counter(o.colour for o in objs)
    unique_shapes = [s for s in SHAPES if by_shape[s] == 1]
    if qtype == "colour_of_shape":
        if not unique_shapes:
            return None
        s = rng.choice(unique_shapes)
        return f"What colour is the {s}?", next(o.colour for o in objs if o.shape == s)
    if qtype == "shape_of_colour":
        unique = [c for c in COLOURS if by_colour[c] == 1]
        if not unique:
            return None
        c = rng.choice(unique)
        return f"What shape is the {c} object?", next(o.shape for o in objs if o.colour == c)
    if qtype == "count_colour":
        present = [c for c in COLOURS if by_colour[c]]
        absent = [c for c in COLOURS if not by_colour[c]]
        c = rng.choice(present if (rng.random() < 0.75 or not absent) else absent)
        return f"How many {c} objects are there?", _number(by_colour[c])
    if qtype == "count_all":
        return "How many objects are there?", _number(len(objs))
    if qtype == "same_colour":
        if len(unique_shapes) < 2:
            return None
        colour_of = {o.shape: o.colour for o in objs if o.shape in unique_shapes}
        pairs = [(a, b) for i, a in enumerate(unique_shapes) for b in unique_shapes[i + 1:]]
        want_yes = rng.random() < 0.5
        matching = [p for p in pairs if (colour_of[p[0]] == colour_of[p[1]]) == want_yes]
        a, b = rng.choice(matching or pairs)
        if rng.random() < 0.5:
            a, b = b, a
        answer = "yes" if colour_of[a] == colour_of[b] else "no"
        return f"Are the {a} and the {b} the same colour?", answer
    if qtype == "list_colours":
        return ("List the colours of the objects from top to bottom.",
                " ".join(o.colour for o in objs))
    if qtype == "list_shapes":
        return ("List the shapes of the objects from top to bottom.",
                " ".join(o.shape for o in objs))
    if qtype == "colours_present":
        return ("Which colours are in the image?",
                " ".join(c for c in COLOURS if by_colour[c]))
    if qtype in GRID_QTYPES:
        question, answer, _ = ask_grid(scene, qtype, rng.randrange(scene.grid), rng)
        return question, answer
    raise ValueError(f"unknown qtype {qtype!r}; known: {ALL_QTYPES}")


def ask_grid(scene: Scene, qtype: str, row: int,
             rng: random.Random) -> tuple[str, str, tuple[int, ...]]:
    """A grid-task (question, answer, region) about row ``row`` (0-based) of ``scene``; a cell
    question picks its column (an occupied cell with probability ``GRID_OCCUPIED_P`` when the
    row has one, else an empty cell). ``region`` holds the merged-token indices looked at."""
    g = scene.grid
    in_row = [o for o in scene.objects if o.row == row]
    name = _number(row + 1)
    row_cells = tuple(row * g + c for c in range(g))
    if qtype in GRID_CELL_QTYPES:
        occupied = [o.col for o in in_row]
        empty = [c for c in range(g) if c not in occupied]
        pool = occupied if (occupied and (not empty or rng.random() < GRID_OCCUPIED_P)) else empty
        col = rng.choice(pool)
        obj = scene.at(row, col)
        what = "colour" if qtype == "cell_colour" else "shape"
        answer = "none" if obj is None else (obj.colour if what == "colour" else obj.shape)
        return (f"What {what} is the object in row {name} column {_number(col + 1)}?", answer,
                (row * g + col,))
    if qtype == "count_row":
        return f"How many objects are in row {name}?", _number(len(in_row)), row_cells
    if qtype == "empty_row":
        return (f"How many empty cells are in row {name}?", _number(g - len(in_row)),
                row_cells)
    if qtype == "row_colours":
        present = {o.colour for o in in_row}
        return (f"Which colours are in row {name}?",
                " ".join(c for c in COLOURS if c in present) or "none", row_cells)
    raise ValueError(f"unknown grid qtype {qtype!r}; known: {GRID_QTYPES}")


def random_grid_scene(rng: random.Random, grid: int,
                      density: tuple[float, float] = GRID_DENSITY,
                      small_p: float = GRID_SMALL_P) -> Scene:
    """Grid-task scene: every cell holds an object with one per-image probability drawn from
    ``density``; colours and shapes uniform, a share ``small_p`` of the objects small; objects
    listed row-major; the background encodes coordinates (``coords``)."""
    p = rng.uniform(*density)
    objects = []
    for row in range(grid):
        for col in range(grid):
            if rng.random() < p:
                objects.append(SceneObject(row=row, col=col, colour=rng.choice(list(COLOURS)),
                                           shape=rng.choice(SHAPES),
                                           small=rng.random() < small_p))
    return Scene(grid=grid, objects=tuple(objects), texture_seed=rng.getrandbits(63),
                 coords=True)


def _grid_questions(scene: Scene, rng: random.Random, n: int,
                    qtypes: Sequence[str]) -> list[tuple[str, str, str, tuple[int, ...]]]:
    """Up to ``n`` grid questions (at most one per row): each on its own row, so no two
    questions of an image share a cell."""
    rows = rng.sample(range(scene.grid), min(n, scene.grid))
    out = []
    for row in rows:
        qtype = rng.choice(list(qtypes))
        question, answer, region = ask_grid(scene, qtype, row, rng)
        out.append((question, answer, qtype, region))
    return out


def _image_questions(scene: Scene, rng: random.Random, n: int,
                     qtypes: Sequence[str]) -> list[tuple[str, str, str]]:
    out: list[tuple[str, str, str]] = []
    seen: set[str] = set()
    for _ in range(50 * n):
        if len(out) == n:
            break
        qtype = rng.choice(list(qtypes))
        qa = ask(scene, qtype, rng)
        if qa is None or qa[0] in seen:
            continue
        seen.add(qa[0])
        out.append((qa[0], qa[1], qtype))
    return out


def default_qtypes(task: str = "vqa") -> tuple[str, ...]:
    """The question types a task asks when none are given."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known: {TASKS}")
    return DEFAULT_QTYPES if task == "vqa" else GRID_QTYPES


def image_items(name: str, seed: int, index: int, *, grid: int = 16,
                questions_per_image: int = 1, qtypes: Sequence[str] | None = None,
                min_objects: int = 3, max_objects: int = 6, task: str = "vqa") -> list[VQAItem]:
    """The items of image ``index`` of split ``name``: a pure function of the arguments.

    An image may get fewer than ``questions_per_image`` questions when its scene cannot support
    that many distinct ones (rare with the defaults; a grid image gets at most ``grid``, one per
    row). ``qtypes`` defaults to the task's (:func:`default_qtypes`); ``task="grid"`` draws from
    its own streams and ignores ``min_objects`` / ``max_objects``.
    """
    if qtypes is None:
        qtypes = default_qtypes(task)
    if task == "grid":
        return _grid_image_items(name, seed, index, grid, questions_per_image, qtypes)
    if task != "vqa":
        raise ValueError(f"unknown task {task!r}; known: {TASKS}")
    for q in qtypes:
        if q not in QTYPES:
            raise ValueError(f"unknown qtype {q!r}; known: {QTYPES}")
    rng = random.Random(f"unicache-vqa/{name}/{seed}/{grid}/{index}")
    scene = random_scene(rng, grid, min_objects, max_objects)
    image = render_scene(scene)
    image_id = f"{name}-{seed}-{index:06d}"
    return [
        VQAItem(image=image, question=question, answer=answer, qtype=qtype, image_id=image_id,
                question_index=k, scene=scene)
        for k, (question, answer, qtype) in enumerate(
            _image_questions(scene, rng, questions_per_image, qtypes))
    ]


def _grid_image_items(name: str, seed: int, index: int, grid: int, questions_per_image: int,
                      qtypes: Sequence[str]) -> list[VQAItem]:
    for q in qtypes:
        if q not in GRID_QTYPES:
            raise ValueError(f"unknown grid qtype {q!r}; known: {GRID_QTYPES}")
    rng = random.Random(f"unicache-grid/{name}/{seed}/{grid}/{index}")
    scene = random_grid_scene(rng, grid)
    image = render_scene(scene)
    image_id = f"{name}-grid{seed}-{index:06d}"
    return [
        VQAItem(image=image, question=question, answer=answer, qtype=qtype, image_id=image_id,
                question_index=k, scene=scene, region=region)
        for k, (question, answer, qtype, region) in enumerate(
            _grid_questions(scene, rng, questions_per_image, qtypes))
    ]


def iter_items(name: str, seed: int = 0, *, start: int = 0, **kwargs) -> Iterator[VQAItem]:
    """An endless deterministic stream of items, image by image from image ``start``
    (``kwargs`` as for :func:`image_items`)."""
    index = start
    while True:
        yield from image_items(name, seed, index, **kwargs)
        index += 1


def make_split(name: str, n_images: int, questions_per_image: int = 1, seed: int = 0,
               grid: int = 16, *, qtypes: Sequence[str] | None = None, min_objects: int = 3,
               max_objects: int = 6, task: str = "vqa") -> list[VQAItem]:
    """All items of ``n_images`` images of split ``name`` ("train", "validation", "test", ...).

    Different names draw from independent streams (and the two tasks from different ones).
    Items of one image are consecutive, share one ``PIL.Image`` and carry ``question_index``
    0..N-1 (the reuse benchmark warms the cache with 0 and scores the others). ``qtypes``
    defaults to the task's (:func:`default_qtypes`).
    """
    items: list[VQAItem] = []
    for index in range(n_images):
        items += image_items(name, seed, index, grid=grid,
                             questions_per_image=questions_per_image, qtypes=qtypes,
                             min_objects=min_objects, max_objects=max_objects, task=task)
    return items
