"""The test/benchmark server harness on a busy machine (issue 18): a port taken between picking
and binding is retried on another, a server that dies is noticed at once, and the start timeout
comes from ``UNICACHE_SERVER_START_TIMEOUT``. A stand-in HTTP server plays SGLang."""

from __future__ import annotations

import socket
import sys
import time

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
