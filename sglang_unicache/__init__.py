"""sglang-unicache: compressed multimodal KV cache for SGLang (UniCache + AirCache).

The public API: ``UniCacheConfig`` (every parameter), ``build_method(config or name)`` (a
``Method``: plan and execute the compression of one request's image KV), ``known_methods()``.
Elsewhere: ``adapters.transformers.compress`` (the same methods on a transformers model) and
``client.routing_headers`` (keep an image on one server behind ``sglang-router``).

The layers, bottom to top: ``policy/`` (pure torch) <- ``engine/`` (the only SGLang importer)
and ``adapters/``; ``platform/cpu/`` (the out-of-tree CPU platform) and ``client/`` stand alone.

Importing this package registers nothing and imports no SGLang module: the engine hooks are
registered by ``sglang_unicache.engine.plugin.register`` (entry point ``sglang.srt.plugins``)
and the CPU platform by ``sglang_unicache.platform.cpu.activate`` (``sglang.srt.platforms``).
"""

__version__ = "0.1.0"
SGLANG_VERSION = "0.5.23"

from sglang_unicache.policy import (  # noqa: E402  (the versions first: compat reads them)
    PRESETS,
    Method,
    UniCacheConfig,
    build_method,
    known_methods,
)

__all__ = ["PRESETS", "SGLANG_VERSION", "Method", "UniCacheConfig", "__version__",
           "build_method", "known_methods"]
