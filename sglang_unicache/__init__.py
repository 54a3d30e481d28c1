"""sglang-unicache: compressed multimodal KV cache for SGLang (UniCache + AirCache).

Importing this package has no side effects and imports no SGLang module: the engine hooks are
registered by ``sglang_unicache.integration.plugin.register`` (entry point ``sglang.srt.plugins``)
and the CPU platform by ``sglang_unicache.platform.cpu.activate`` (``sglang.srt.platforms``).
"""

__version__ = "0.1.0"
SGLANG_VERSION = "0.5.23"
