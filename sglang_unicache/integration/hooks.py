"""The hook functions the plugin installs on SGLang (see ``plugin.register`` for the targets)."""

from __future__ import annotations

import logging
from typing import Any

from sglang_unicache.integration import flags
from sglang_unicache.integration.support import local_hf_config, unsupported_setup

logger = logging.getLogger("sglang_unicache")


class UniCacheStartupError(SystemExit):
    """One-line startup failure; a SystemExit so the launcher prints it without a traceback."""

    def __init__(self, message: str) -> None:
        super().__init__(f"error: {message}")


def _checked_config(server_args: Any, config: Any) -> Any:
    if config is not None:
        reason = unsupported_setup(server_args, local_hf_config(server_args.model_path))
        if reason:
            raise flags.UniCacheFlagError(reason)
    return config


def after_add_cli_args(result: Any, parser: Any) -> Any:
    flags.add_cli_args(parser)
    return result


def around_from_cli_args(original: Any, cls: Any, args: Any) -> Any:
    server_args = original(cls, args)
    try:
        config = _checked_config(server_args, flags.config_from_namespace(args))
    except flags.UniCacheFlagError as exc:
        raise UniCacheStartupError(str(exc)) from None
    flags.attach(server_args, config)
    if config is not None:
        logger.info("sglang-unicache: enabled (method=%s, keep_ratio=%s)",
                    config.method, config.keep_ratio)
    return server_args


def make_engine_server_args(**kwargs: Any) -> Any:
    """``Engine.server_args_class``: ServerArgs plus the ``unicache*`` keyword arguments."""
    from sglang.srt.server_args import ServerArgs

    config = flags.pop_engine_kwargs(kwargs)
    server_args = ServerArgs(**kwargs)
    flags.attach(server_args, _checked_config(server_args, config))
    return server_args


def after_scheduler_init(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    config = flags.config_of(scheduler.server_args)
    scheduler.unicache_config = config
    if config is not None:
        hf_config = scheduler.model_config.hf_config.to_dict()
        reason = unsupported_setup(scheduler.server_args, hf_config)
        if reason:
            raise flags.UniCacheFlagError(reason)
        # Flags only, until compression lands (issue 4): nothing is compressed yet.
        logger.info(
            "sglang-unicache: scheduler received config method=%s keep_ratio=%s "
            "min_image_tokens=%s (compression not active in this version)",
            config.method, config.keep_ratio, config.min_image_tokens,
        )
    return result
