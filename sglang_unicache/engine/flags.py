"""The ``--unicache*`` flags: parsed by the launcher, validated once, carried to the scheduler.

An AFTER hook on ``ServerArgs.add_cli_args`` adds the flags; an AROUND hook on
``ServerArgs.from_cli_args`` turns them into one frozen ``UniCacheConfig`` and attaches it to the
``ServerArgs`` record as bookkeeping (``_unicache_config``), which survives the pickling that hands
the record to the scheduler process. ``sglang.Engine(..., unicache=True, ...)`` takes the same
settings as keyword arguments (``unicache_method=...``, ...).

Bad values stop the launcher with one line naming the flag and the allowed values.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from sglang_unicache.policy.config import UniCacheConfig
from sglang_unicache.policy.registry import known_methods

ATTR = "_unicache_config"


@dataclass(frozen=True)
class Flag:
    """One CLI flag and the config field it sets."""

    option: str
    field: str
    type: type
    help: str

    @property
    def dest(self) -> str:
        return self.option.lstrip("-").replace("-", "_")


FLAGS = (
    Flag("--unicache-method", "method", str,
         f"Compression method ({', '.join(known_methods())})."),
    Flag("--unicache-keep-ratio", "keep_ratio", float,
         "Fraction of an image's visual KV kept after prefill, in (0, 1]."),
    Flag("--unicache-min-image-tokens", "min_image_tokens", int,
         "Images with fewer visual tokens are left uncompressed."),
    Flag("--unicache-host-copies", "host_copies", str,
         "Full KV of each compressed image kept in host memory for later questions: int8, "
         "exact or off."),
    Flag("--unicache-host-copy-gb", "host_copy_gb", float,
         "Host memory the copies may hold, GiB per scheduler; 0 turns them off."),
    Flag("--unicache-view-max-keep", "view_max_keep", float,
         "With host copies: the largest share of its image a request's own view decodes on "
         "(default 0.15, or the keep ratio if larger); 0: no bound, the self-check's ladder "
         "up to full KV."),
)
CONFIG_FLAG = "--unicache-config"
ENABLE_FLAG = "--unicache"


class UniCacheFlagError(ValueError):
    """A ``--unicache*`` value that cannot be used; the message is one line."""


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sglang-unicache (compressed multimodal KV cache)")
    group.add_argument(ENABLE_FLAG, action="store_true", default=False,
                       help="Compress the KV cache of image tokens after prefill.")
    for flag in FLAGS:
        group.add_argument(flag.option, type=str, default=None, help=flag.help)
    group.add_argument(CONFIG_FLAG, type=str, default=None, metavar="PATH",
                       help="JSON or YAML file with policy parameters (see docs/configuration.md).")


def _convert(flag: Flag, raw: Any) -> Any:
    if isinstance(raw, flag.type):
        return raw
    try:
        return flag.type(raw)
    except (TypeError, ValueError):
        kind = {float: "a number", int: "an integer"}.get(flag.type, "a string")
        raise UniCacheFlagError(f"{flag.option}: expected {kind}, got {raw!r}") from None


def build_config(enabled: bool, config_path: str | None, values: dict[str, Any]
                 ) -> UniCacheConfig | None:
    """Validate every ``--unicache*`` value; the config when enabled, else None.

    ``values`` maps config field names (``method``, ``keep_ratio``, ...) to raw flag values;
    None means the flag was not given. Flag values win over the config file.
    """
    try:
        config = (UniCacheConfig.from_file(config_path) if config_path is not None
                  else UniCacheConfig())
    except ValueError as exc:
        raise UniCacheFlagError(f"{CONFIG_FLAG}: {exc}") from None
    for flag in FLAGS:
        raw = values.get(flag.field)
        if raw is None:
            continue
        value = _convert(flag, raw)
        try:
            config = config.replace(**{flag.field: value})
        except ValueError as exc:
            raise UniCacheFlagError(f"{flag.option}: {exc}") from None
    return config if enabled else None


ENGINE_KWARGS = ("unicache", "unicache_config", *(flag.dest for flag in FLAGS))


def config_from_options(options: dict[str, Any]) -> UniCacheConfig | None:
    """The config from flag destinations (``unicache``, ``unicache_keep_ratio``, ...)."""
    values = {flag.field: options.get(flag.dest) for flag in FLAGS}
    return build_config(bool(options.get("unicache")), options.get("unicache_config"), values)


def config_from_namespace(args: argparse.Namespace) -> UniCacheConfig | None:
    return config_from_options(vars(args))


def pop_engine_kwargs(kwargs: dict[str, Any]) -> UniCacheConfig | None:
    """Take the ``unicache*`` keyword arguments out of ``sglang.Engine(**kwargs)``."""
    return config_from_options({key: kwargs.pop(key) for key in ENGINE_KWARGS if key in kwargs})


def attach(server_args: Any, config: UniCacheConfig | None) -> None:
    # A bookkeeping attribute (leading underscore) is allowed on ServerArgs at any time and is
    # kept by its __reduce__, so it reaches the scheduler process.
    setattr(server_args, ATTR, config)


def config_of(server_args: Any) -> UniCacheConfig | None:
    return getattr(server_args, ATTR, None)
