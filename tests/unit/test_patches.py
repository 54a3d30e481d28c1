"""Every upstream patch in ``patches/`` applies cleanly to the pinned wheel's source and leaves
Python that compiles, alone and as a series, and ``patches/README.md`` lists it.

The patches are diffs against the installed ``sglang`` package (paths ``a/sglang/srt/...``,
relative to site-packages). Each test copies only the files a patch touches into a temporary
tree, so the suite runs in a few seconds and never changes the installed package.
"""

from __future__ import annotations

import importlib.util
import os
import py_compile
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("sglang")

PATCHES_DIR = Path(__file__).resolve().parents[2] / "patches"
PATCHES = sorted(PATCHES_DIR.glob("*.patch"))
SITE_PACKAGES = Path(importlib.util.find_spec("sglang").submodule_search_locations[0]).parent

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def touched(patch: Path) -> tuple[list[str], list[str]]:
    """(paths the patch reads, paths it writes), relative to site-packages."""
    old, new = [], []
    for line in patch.read_text().splitlines():
        if line.startswith("--- a/"):
            old.append(line[len("--- a/"):])
        elif line.startswith("+++ b/"):
            new.append(line[len("+++ b/"):])
    return old, new


def copy_sources(paths: list[str], root: Path) -> None:
    for rel in paths:
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(SITE_PACKAGES / rel, target)


def git_apply(root: Path, patch: Path, *flags: str) -> subprocess.CompletedProcess:
    # Outside any repository (the ceiling stops git from finding one above the temporary
    # tree), git apply patches the working files like patch(1) does.
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(root.parent)}
    return subprocess.run(["git", "apply", *flags, "-p1", str(patch)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=60)


def test_patches_exist():
    assert len(PATCHES) >= 7, f"expected the seven extension-point patches in {PATCHES_DIR}"
    assert [p.name[:3] for p in PATCHES] == [f"{i:02d}-" for i in range(1, len(PATCHES) + 1)]


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_patch_applies_and_compiles(patch: Path, tmp_path: Path):
    old, new = touched(patch)
    assert new, f"{patch.name} touches no file"
    for rel in (*old, *new):
        assert rel.startswith("sglang/srt/") and rel.endswith(".py"), rel
    missing = [rel for rel in old if not (SITE_PACKAGES / rel).is_file()]
    assert not missing, f"{patch.name}: the wheel lacks {missing}"
    root = tmp_path / "site"
    copy_sources(old, root)

    check = git_apply(root, patch, "--check")
    assert check.returncode == 0, f"{patch.name} does not apply:\n{check.stderr}"
    applied = git_apply(root, patch)
    assert applied.returncode == 0, applied.stderr
    for rel in new:
        py_compile.compile(str(root / rel), cfile=str(tmp_path / "out.pyc"), doraise=True)


def test_patches_apply_as_a_series(tmp_path: Path):
    """In numeric order on one tree: no two patches' hunks collide."""
    root = tmp_path / "site"
    old = sorted({rel for patch in PATCHES for rel in touched(patch)[0]})
    copy_sources(old, root)
    for patch in PATCHES:
        applied = git_apply(root, patch)
        assert applied.returncode == 0, f"{patch.name} after the ones before:\n{applied.stderr}"
    for rel in sorted({rel for patch in PATCHES for rel in touched(patch)[1]}):
        py_compile.compile(str(root / rel), cfile=str(tmp_path / "out.pyc"), doraise=True)


def test_readme_lists_every_patch():
    readme = (PATCHES_DIR / "README.md").read_text()
    listed = set(re.findall(r"\b\d\d-[a-z0-9-]+\.patch\b", readme))
    names = {p.name for p in PATCHES}
    assert names <= listed, f"not in patches/README.md: {sorted(names - listed)}"
    assert listed <= names, f"patches/README.md names missing files: {sorted(listed - names)}"
