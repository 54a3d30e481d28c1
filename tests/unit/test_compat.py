"""The plugin refuses a different SGLang version or a missing hook target with one line."""

from __future__ import annotations

import pytest

from sglang_unicache.engine import compat, hooks


def test_installed_version_is_the_pinned_one():
    compat.check_compatible(hooks.targets())  # the test environment installs exactly sglang==0.5.23


def test_version_mismatch_names_the_expected_version(monkeypatch):
    monkeypatch.setattr(compat, "installed_sglang_version", lambda: "0.5.22")
    with pytest.raises(SystemExit) as info:
        compat.check_compatible()
    assert str(info.value.code) == (
        "sglang-unicache: expected sglang==0.5.23, found 0.5.22; install the pinned version "
        "(pip install sglang==0.5.23)"
    )


def test_missing_target_is_named():
    target = "sglang.srt.managers.scheduler.Scheduler.no_such_method"
    with pytest.raises(SystemExit) as info:
        compat.check_compatible((*hooks.targets(), target))
    assert str(info.value.code).endswith(f"lacks the hooked target {target}")


def test_not_swallowed_by_sglang_plugin_loader():
    # load_plugins() logs and continues on Exception; a SystemExit stops the process.
    assert not issubclass(compat.IncompatibleSGLang, Exception)


def test_every_hook_function_declares_its_target():
    declared = {fn.__name__ for _, fn, _ in hooks.HOOKS}
    defined = {name for name in vars(hooks) if name.startswith(("after_", "around_"))}
    assert declared == defined
    assert len({target for target, _, _ in hooks.HOOKS}) == len(hooks.HOOKS)
    assert {kind for _, _, kind in hooks.HOOKS} <= {"AFTER", "AROUND"}
