"""Shared fixtures: the tiny checkpoint, one CPU server per configuration, one offline Engine.

Servers are session-scoped (a start costs ~20-30 s here), bound to 127.0.0.1 on a free port
(retried on another if it was taken meanwhile), and stopped by PID. Their logs stay in
``runs/test-logs/`` (override with UNICACHE_TEST_LOGS); UNICACHE_SERVER_START_TIMEOUT bounds a
start (default 300 s) and UNICACHE_TEST_MAX_SERVERS how many run at once (default 3).
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from pathlib import Path

import pytest

os.environ.setdefault("SGLANG_PLATFORM", "unicache_cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

LOG_DIR = Path(os.environ.get("UNICACHE_TEST_LOGS", Path(__file__).parent.parent / "runs" /
                              "test-logs"))


ENGINE_TESTS = Path(__file__).parent / "engine"


def pytest_collection_modifyitems(items) -> None:
    """Every test under tests/engine/ starts servers: ``pytest -m "not engine"`` is the fast
    suite (policy and unit tests, about a minute)."""
    for item in items:
        if ENGINE_TESTS in Path(item.fspath).parents:
            item.add_marker(pytest.mark.engine)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A deterministic random Qwen2-VL (64 visual tokens per 224 px image)."""
    from tests.support.tiny_vlm import build_tiny_qwen2_vl

    # "qwen2-vl" in the path lets SGLang's frontend pick the Qwen2-VL chat template.
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("models") / "tiny-qwen2-vl")


# Each server costs ~2.4 GB of RAM (launcher, scheduler, detokenizer): 3 and the offline engine
# leave ~14 GB of 24 free. UNICACHE_TEST_MAX_SERVERS lowers it on a smaller or busier machine.
MAX_LIVE_SERVERS = int(os.environ.get("UNICACHE_TEST_MAX_SERVERS", "3"))


@pytest.fixture(scope="session")
def server_factory(tiny_model):
    """A server for a list of flags, shared by every test that asks for the same flags.

    At most ``MAX_LIVE_SERVERS`` run at once: starting another stops the least recently used
    (a later test that needs it again starts it anew).
    """
    from tests.support.server import start_server

    servers: OrderedDict = OrderedDict()

    def get(*args: str, env: dict[str, str] | None = None):
        key = (tuple(args), tuple(sorted((env or {}).items())))
        if key in servers:
            servers.move_to_end(key)
            return servers[key]
        while len(servers) >= MAX_LIVE_SERVERS:
            servers.popitem(last=False)[1].stop()
        flags = "_".join(Path(a).name if "/" in a else a.lstrip("-") for a in args)
        name = "server-" + (flags or "stock")[:90]
        if env:
            name += "_" + "_".join(f"{k}={v}" for k, v in sorted(env.items()))
        # Two servers whose flags share the first 90 characters must not share a log.
        name += "-" + hashlib.sha1(repr(key).encode()).hexdigest()[:8]
        servers[key] = start_server(tiny_model, list(args), LOG_DIR / f"{name}.log", env=env)
        return servers[key]

    yield get
    for server in servers.values():
        server.stop()


def assert_integrity(server) -> None:
    """The plugin's ``check_integrity`` (slots in exactly one place, span metadata on live
    nodes), read through ``/server_info``."""
    from tests.support.client import internal_state

    assert internal_state(server)["unicache"]["integrity"] == []


@pytest.fixture
def unicache_server(server_factory):
    server = server_factory("--unicache", "--unicache-keep-ratio", "0.25", "--enable-cache-report")
    yield server
    assert_integrity(server)


@pytest.fixture(scope="session")
def engine(tiny_model):
    """An offline ``sglang.Engine`` with the plugin enabled through keyword arguments."""
    import sglang

    eng = sglang.Engine(model_path=str(tiny_model), unicache=True, unicache_keep_ratio=0.5,
                        log_level="error")
    yield eng
    eng.shutdown()


KEEP = 0.25
KEPT = 16  # round(KEEP * 64): entries kept of a 64-token image


@pytest.fixture(scope="session")
def nocheck_config(tmp_path_factory) -> str:
    """A policy config without the KL self-check (it trips on a random model's attention)."""
    path = tmp_path_factory.mktemp("cfg") / "nocheck.yaml"
    path.write_text("selfcheck: false\n")
    return str(path)


@pytest.fixture
def stock(server_factory):
    return server_factory("--enable-cache-report")


@pytest.fixture
def compressing(server_factory, nocheck_config):
    """key-norm at 25%: query-independent, so the spans it compresses are shared. The plugin's
    integrity check must hold after every test."""
    server = server_factory("--unicache", "--unicache-method", "knorm", "--unicache-keep-ratio",
                            str(KEEP), "--unicache-config", nocheck_config,
                            "--enable-cache-report")
    yield server
    assert_integrity(server)


@pytest.fixture(scope="session")
def prompt_of(tiny_model):
    """The tiny model's chat template around one image and ``question`` (for ``/generate``)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)

    def render(question: str) -> str:
        messages = [{"role": "user", "content": [{"type": "image"},
                                                 {"type": "text", "text": question}]}]
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True)

    return render
