"""Plugin entry point (``sglang.srt.plugins``): registers every hook, in every SGLang process.

SGLang calls ``register`` in the launcher and again in each spawned process (scheduler,
detokenizer), so all state is created here, never inherited.
"""

from __future__ import annotations

from sglang_unicache.engine.compat import check_compatible


def register() -> None:
    check_compatible()  # the version first: the imports below assume the pinned SGLang

    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_unicache.engine import hooks, radix_cache
    from sglang_unicache.platform import cpu
    from sglang_unicache.platform.cpu import dp_idle

    check_compatible(hooks.targets())
    radix_cache.register()
    for target, fn, kind in hooks.HOOKS:
        HookRegistry.register(target, fn, getattr(HookType, kind))
    if cpu.is_current():  # the CPU platform's own fix, with or without --unicache
        HookRegistry.register(dp_idle.TARGET, dp_idle.around_event_loop, HookType.AROUND)
    # Not through HookRegistry: it would rebind every module's reference to the ServerArgs
    # class. Engine.__init__ reads this attribute after loading plugins, so the first Engine
    # of a process already takes the unicache keyword arguments.
    Engine.server_args_class = staticmethod(hooks.make_engine_server_args)
