"""Shared fixtures: the tiny checkpoint, one CPU server per configuration, one offline Engine.

Servers are session-scoped (a start costs 10-37 s here), bound to 127.0.0.1 on a free port
(retried on another if it was taken meanwhile), and stopped by PID. Their logs stay in
``runs/test-logs/`` (override with UNICACHE_TEST_LOGS); UNICACHE_SERVER_START_TIMEOUT bounds a
start (default 300 s) and UNICACHE_TEST_MAX_SERVERS how many schedulers run at once (default 5,
across the pytest-xdist workers when ``make test TEST_WORKERS=2`` runs two, each one test file at
a time). Servers fork from a process that imported SGLang once (``support/zygote.py``;
UNICACHE_TEST_FORK_SERVERS=0: each a new interpreter).
"""

from __future__ import annotations

import atexit
import hashlib
import os
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

os.environ.setdefault("SGLANG_PLATFORM", "unicache_cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

LOG_DIR = Path(os.environ.get("UNICACHE_TEST_LOGS", Path(__file__).parent.parent / "runs" /
                              "test-logs"))
# Under pytest-xdist each worker runs its own servers: their logs carry the worker's name.
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")


ENGINE_TESTS = Path(__file__).parent / "engine"


def pytest_collection_modifyitems(items) -> None:
    """Every test under tests/engine/ starts servers: ``pytest -m "not engine"`` is the fast
    suite (policy and unit tests, about a minute)."""
    for item in items:
        if ENGINE_TESTS in Path(item.fspath).parents:
            item.add_marker(pytest.mark.engine)


@pytest.fixture(scope="session", autouse=True)
def _forked_servers():
    """Test servers fork from one process that imported SGLang once (``support/zygote.py``),
    and fork their scheduler and detokenizer: about 10 s a start against 37 s as a new
    interpreter. ``UNICACHE_TEST_FORK_SERVERS=0`` starts each as a new interpreter."""
    if os.environ.get("UNICACHE_TEST_FORK_SERVERS", "1") == "0":
        yield
        return
    from tests.support.server import forking_servers

    with forking_servers(LOG_DIR / f"zygote{WORKER}.log"):
        yield


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A deterministic random Qwen2-VL (64 visual tokens per 224 px image)."""
    from tests.support.tiny_vlm import build_tiny_qwen2_vl

    # "qwen2-vl" in the path lets SGLang's frontend pick the Qwen2-VL chat template.
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("models") / "tiny-qwen2-vl")


# A server costs ~2.7 GB of RAM (launcher, scheduler, detokenizer: their PSS), one more scheduler
# per extra data- or tensor-parallel rank: five units, the offline engines and pytest leave ~6 GB
# of 24 free. The xdist workers share the five (tests/support/budget.py).
# UNICACHE_TEST_MAX_SERVERS lowers it on a smaller or busier machine.
MAX_LIVE_SERVERS = int(os.environ.get("UNICACHE_TEST_MAX_SERVERS", "5"))
# Flags that change no token and no slot: every test server has them, so two configurations that
# differ only by them are one server (a start costs 23-37 s here).
ALWAYS = ("--enable-cache-report", "--enable-metrics")


def server_units(args: tuple[str, ...]) -> int:
    """Schedulers a server runs (``--dp-size`` x ``--tp-size``): what its RAM scales with."""
    units = 1
    for flag in ("--dp-size", "--tp-size"):
        if flag in args:
            units *= int(args[args.index(flag) + 1])
    return units


@pytest.fixture(scope="session")
def server_factory(tiny_model, tmp_path_factory):
    """A server for a list of flags, shared by every test that asks for the same flags.

    ``ALWAYS`` is added to every list. The servers of all xdist workers stay within
    ``MAX_LIVE_SERVERS`` units: starting another stops this worker's least recently used one
    first, except those asked for with ``keep=True`` (the servers most tests share: stopping them
    between test files cost a start each time; they go only while another worker waits for room)
    and those the running test uses. Tests that start servers of their own make room first
    (``server_factory.make_room(units)``, held until the test ends, or until
    ``server_factory.release(units)`` with ``hold=True``: a module's own server);
    ``server_factory.prefetch(flags, ...)`` starts the servers a test file needs next side by side.
    """
    from tests.support.budget import Budget
    from tests.support.server import start_server

    servers: OrderedDict = OrderedDict()
    kept: set = set()
    in_use: set = set()  # keys handed to the running test: never stopped under it
    reserved = [0]  # units of the running test's own servers
    held_long = [0]  # units of servers that modules started (``make_room(units, hold=True)``)
    shared = tmp_path_factory.getbasetemp().parent / "server-budget" if WORKER else None
    budget = Budget(shared, WORKER or "main", MAX_LIVE_SERVERS)

    def held() -> int:
        return sum(server_units(k[0]) for k in servers) + reserved[0] + held_long[0]

    def stop_one(kept_ones: bool) -> bool:
        """Stop the least recently used server (kept for the session or not); False if none."""
        for key in servers:
            if (key in kept) == kept_ones and key not in in_use:
                servers.pop(key).stop()
                return True
        return False

    def make_room(units: int, hold: bool = False) -> None:
        """Room for ``units`` more schedulers, counted as the running test's until it ends (a
        test that starts servers of its own calls it first), or until ``release(units)``."""
        budget.acquire(units, held, stop_one)
        (held_long if hold else reserved)[0] += units

    def release(units: int) -> None:
        held_long[0] -= units
        budget.yield_to_waiting(held, stop_one)

    def end_test() -> None:
        reserved[0] = 0
        in_use.clear()
        budget.yield_to_waiting(held, stop_one)

    def key_of(args: tuple[str, ...], env: dict[str, str] | None) -> tuple:
        args = (*(a for a in args if a not in ALWAYS), *ALWAYS)
        return (args, tuple(sorted((env or {}).items())))

    def start(key: tuple):
        args, env = key[0], dict(key[1]) or None
        flags = "_".join(Path(a).name if "/" in a else a.lstrip("-") for a in args[:-len(ALWAYS)])
        name = "server-" + (flags or "stock")[:90]
        if env:
            name += "_" + "_".join(f"{k}={v}" for k, v in sorted(env.items()))
        # Two servers whose flags share the first 90 characters must not share a log.
        name += "-" + hashlib.sha1(repr(key).encode()).hexdigest()[:8] + WORKER
        return start_server(tiny_model, list(args), LOG_DIR / f"{name}.log", env=env)

    def add(key: tuple, server, units: int) -> None:
        servers[key] = server
        reserved[0] -= units  # now counted as a server of the factory

    def get(*args: str, env: dict[str, str] | None = None, keep: bool = False):
        key = key_of(args, env)
        if keep:
            kept.add(key)
        if key not in servers:
            units = server_units(key[0])
            make_room(units)
            add(key, start(key), units)
        servers.move_to_end(key)
        in_use.add(key)
        return servers[key]

    def prefetch(*flag_lists: tuple[str, ...]) -> None:
        """Start the servers of several flag lists side by side (each start is mostly one core's
        imports), for the tests that ask for them next."""
        missing = list(dict.fromkeys(k for k in (key_of(f, None) for f in flag_lists)
                                     if k not in servers))
        if len(missing) < 2:
            return
        make_room(sum(server_units(k[0]) for k in missing))
        with ThreadPoolExecutor(len(missing)) as pool:
            started = [(k, pool.submit(start, k)) for k in missing]
        for k, future in started:
            if future.exception() is None:
                add(k, future.result(), server_units(k[0]))
        for _, future in started:
            future.result()  # a failed start raises here; the others are kept and stopped later

    get.make_room = make_room
    get.prefetch = prefetch
    get.release = release
    get.end_test = end_test
    yield get
    for server in servers.values():
        server.stop()
    budget.leave()


@pytest.fixture(autouse=True)
def _server_budget(request):
    """Ends the running test's claim on server units (``server_factory.make_room``), and gives
    servers back to another xdist worker waiting for room."""
    yield
    if "server_factory" in request.fixturenames:
        request.getfixturevalue("server_factory").end_test()


def assert_integrity(server) -> None:
    """The plugin's ``check_integrity`` (slots in exactly one place, span metadata on live
    nodes), read through ``/server_info``."""
    from tests.support.client import internal_state

    assert internal_state(server)["unicache"]["integrity"] == []


@pytest.fixture
def serve(model, server_factory, tmp_path):
    """``serve(*flags)``: a server of the test module's own ``model`` fixture (a checkpoint other
    than the tiny Qwen2-VL), stopped after the test; room is made for one. ``serve.all(flags,
    ...)`` starts several side by side (each start is mostly one core's imports)."""
    from tests.support.server import start_server

    server_factory.make_room(1)
    started = []
    names = iter(range(1_000))

    def launch(flags: tuple[str, ...], index: int):
        server = start_server(model, [*flags, "--enable-cache-report"],
                              tmp_path / f"server-{index}.log")
        started.append(server)
        return server

    def start(*flags: str):
        return launch(flags, next(names))

    def start_all(*flag_lists: tuple[str, ...]) -> list:
        server_factory.make_room(len(flag_lists))
        jobs = [(flags, next(names)) for flags in flag_lists]
        with ThreadPoolExecutor(len(jobs)) as pool:
            futures = [pool.submit(launch, *job) for job in jobs]
        return [future.result() for future in futures]

    start.all = start_all
    yield start
    for server in started:
        server.stop()


@pytest.fixture
def unicache_server(server_factory):
    server = server_factory("--unicache", "--unicache-keep-ratio", "0.25", "--enable-cache-report")
    yield server
    assert_integrity(server)


@pytest.fixture(scope="session")
def engine(tiny_model, server_factory):
    """An offline ``sglang.Engine`` with the plugin enabled through keyword arguments (its
    scheduler counts as one server unit)."""
    import sglang

    server_factory.make_room(1, hold=True)
    eng = sglang.Engine(model_path=str(tiny_model), unicache=True, unicache_keep_ratio=0.5,
                        log_level="error")
    yield eng
    eng.shutdown()
    # SGLang registers the shutdown with atexit too; run again after pytest closed its streams,
    # it logs into a closed file (a "Logging error" traceback at the end of the run).
    atexit.unregister(eng.shutdown)
    server_factory.release(1)


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
    return server_factory(keep=True)


@pytest.fixture
def identity(server_factory):
    """``--unicache`` at keep 1.0: it must answer token for token as stock."""
    return server_factory("--unicache", "--unicache-keep-ratio", "1.0", keep=True)


@pytest.fixture
def compressing(server_factory, nocheck_config):
    """key-norm at 25%: query-independent, so the spans it compresses are shared. The plugin's
    integrity check must hold after every test."""
    server = server_factory("--unicache", "--unicache-method", "knorm", "--unicache-keep-ratio",
                            str(KEEP), "--unicache-config", nocheck_config, keep=True)
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
