"""The test/benchmark server harness on a busy machine: a port taken between picking and binding
is retried on another, a server that dies is noticed at once, a start that hangs is tried once
more, the start timeout comes from ``UNICACHE_SERVER_START_TIMEOUT``, and servers forked from a
zygote behave as started ones. A stand-in HTTP server plays SGLang."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
import requests

from tests.support import server as harness

HEALTH_SERVER = """
import sys, http.server
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def health_server(port: int) -> list[str]:
    return [sys.executable, "-c", HEALTH_SERVER, str(port)]


def test_a_port_taken_before_the_server_binds_it_is_retried(monkeypatch, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        taken_port = taken.getsockname()[1]
        ports = iter([taken_port, harness.free_port()])
        monkeypatch.setattr(harness, "free_port", lambda: next(ports))
        server = harness.launch(health_server, tmp_path / "s.log", timeout=60)
    try:
        assert server.port != taken_port
        assert "address already in use" not in server.log().lower()
        assert requests.get(f"{server.url}/health", timeout=5).status_code == 200
    finally:
        server.stop()


def test_a_port_another_server_took_first_is_not_mistaken_for_ours(monkeypatch, tmp_path):
    """Another worker's server bound the port we picked: it answers ``/health``, ours exits."""
    foreign = harness.launch(health_server, tmp_path / "foreign.log", timeout=60)
    try:
        ports = iter([foreign.port, harness.free_port()])
        monkeypatch.setattr(harness, "free_port", lambda: next(ports))
        slow = ["import time; time.sleep(2)\n" + HEALTH_SERVER]
        server = harness.launch(lambda port: [sys.executable, "-c", *slow, str(port)],
                                tmp_path / "s.log", timeout=60)
        try:
            assert server.port != foreign.port
        finally:
            server.stop()
    finally:
        foreign.stop()


def test_a_server_that_exits_is_reported_at_once(tmp_path):
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="server exited with code 3"):
        harness.launch(lambda port: [sys.executable, "-c", "print('boom'); exit(3)"],
                       tmp_path / "s.log", timeout=120)
    assert time.monotonic() - start < 30


def test_the_start_timeout_comes_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("UNICACHE_SERVER_START_TIMEOUT", "2")
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="not ready after 2s"):
        harness.launch(lambda port: [sys.executable, "-c", "import time; time.sleep(60)"],
                       tmp_path / "s.log")
    assert time.monotonic() - start < 20


def test_a_start_that_hangs_is_tried_once_more_with_its_log(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("UNICACHE_SERVER_START_TIMEOUT", "3")
    starts = []

    def hangs_first(port: int) -> list[str]:
        starts.append(port)
        if len(starts) == 1:
            return [sys.executable, "-c", "print('stuck loading', flush=True); "
                    "import time; time.sleep(60)"]
        return health_server(port)

    server = harness.launch(hangs_first, tmp_path / "s.log")
    try:
        assert len(starts) == 2
        assert requests.get(f"{server.url}/health", timeout=5).status_code == 200
        assert "stuck loading" in capsys.readouterr().err
    finally:
        server.stop()


def test_a_start_that_hangs_twice_raises_with_the_log_tail(monkeypatch, tmp_path):
    monkeypatch.setenv("UNICACHE_SERVER_START_TIMEOUT", "2")
    with pytest.raises(TimeoutError, match="(?s)not ready after 2s.*stuck loading"):
        harness.launch(lambda port: [sys.executable, "-c", "print('stuck loading', flush=True); "
                                     "import time; time.sleep(60)"], tmp_path / "s.log")


STANDIN = "tests.support.health_standin"


def standin(*extra: str):
    return lambda port: [sys.executable, "-m", STANDIN, str(port), *extra]


def test_a_forked_server_answers_in_its_own_group_and_stops(tmp_path):
    """``forking_servers``: the server is a fork of the zygote (not a child of this process),
    leads its own process group like a ``Popen`` server, and is stopped through it."""
    with harness.forking_servers(tmp_path / "zygote.log", STANDIN):
        server = harness.launch(standin(), tmp_path / "s.log", timeout=60)
        try:
            assert not isinstance(server.process, subprocess.Popen)
            assert psutil.Process(server.process.pid).ppid() != os.getpid()
            assert os.getpgid(server.process.pid) == server.process.pid
            # Named as its command, as ``ps`` shows a started server (SGLang names its own).
            assert f"-m {STANDIN} {server.port}" in " ".join(
                psutil.Process(server.process.pid).cmdline())
            health = requests.get(f"{server.url}/health", timeout=5)
            # What the module's import put in the environment is there, as after an import.
            assert health.status_code == 200 and health.text == "1"
        finally:
            server.stop()
        assert server.process.returncode == -signal.SIGTERM
        assert not psutil.pid_exists(server.process.pid)


def test_a_forked_server_forks_its_own_children(tmp_path):
    """SGLang spawns its scheduler from a fresh interpreter; a forked server forks it (what
    the zygote imported is there already), a started one still spawns it."""
    with harness.forking_servers(tmp_path / "zygote.log", STANDIN):
        for server, expected in ((harness.launch(standin(), tmp_path / "f.log", timeout=60),
                                  "forked"),
                                 (harness.launch(standin(), tmp_path / "s.log", timeout=60,
                                                 env={"UNICACHE_TEST_SOMETHING": "1"}),
                                  "spawned")):
            try:
                assert requests.get(f"{server.url}/child", timeout=60).text == expected
            finally:
                server.stop()


def test_a_forked_server_that_exits_is_reported_with_its_code(tmp_path):
    with harness.forking_servers(tmp_path / "zygote.log", STANDIN):
        with pytest.raises(RuntimeError, match="server exited with code 3"):
            harness.launch(standin("3"), tmp_path / "s.log", timeout=60)
    assert "exiting as asked" in (tmp_path / "s.log").read_text()


def test_a_server_whose_environment_differs_from_the_zygote_starts_afresh(tmp_path):
    """A variable read at import would keep the zygote's value in a fork: such a server, and
    any other command, is a new interpreter."""
    with harness.forking_servers(tmp_path / "zygote.log", STANDIN):
        for server in (harness.launch(standin(), tmp_path / "env.log", timeout=60,
                                      env={"UNICACHE_TEST_SOMETHING": "1"}),
                       harness.launch(health_server, tmp_path / "other.log", timeout=60)):
            try:
                assert isinstance(server.process, subprocess.Popen)
                assert requests.get(f"{server.url}/health", timeout=5).status_code == 200
            finally:
                server.stop()


def test_servers_of_a_killed_zygote_read_as_exited(tmp_path):
    """An offline ``sglang.Engine``'s shutdown kills every child of the test process, the
    zygote and its servers among them: stopping them afterwards is not an error, and the next
    server forks from a new zygote."""
    with harness.forking_servers(tmp_path / "zygote.log", STANDIN):
        server = harness.launch(standin(), tmp_path / "s.log", timeout=60)
        os.killpg(server.process.pid, signal.SIGKILL)
        harness._forking.zygote.process.kill()
        harness._forking.zygote.process.wait(timeout=30)
        server.stop()
        assert server.process.returncode == -signal.SIGKILL
        # The next server forks from a new zygote.
        again = harness.launch(standin(), tmp_path / "again.log", timeout=60)
        try:
            assert not isinstance(again.process, subprocess.Popen)
            assert requests.get(f"{again.url}/health", timeout=5).status_code == 200
        finally:
            again.stop()
