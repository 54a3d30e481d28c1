"""Start and stop a real SGLang server process for tests, demos and benchmarks.

Binds 127.0.0.1 on a free port, waits for readiness with a bounded timeout, keeps the log in a
file, and stops the whole process tree by PID. The port is picked before the server binds it (a
minute later on a loaded machine), so another process can take it first: a server that exits
with "address already in use" is started again on another port. A server that exits is noticed
at once (its log tail is raised), not after the timeout. A start that hangs past the timeout is
stopped and tried once more on another port (its log tail goes to stderr, and into the error if
the second try hangs too).

``UNICACHE_SERVER_START_TIMEOUT`` (seconds, default 300) bounds each start. Within
``forking_servers`` (the test session's) an SGLang server forks from a process that imported
SGLang once (``zygote.py``) instead of starting a new interpreter.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import requests


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a CPU server: our platform, quiet warnings, no hub access, and the
    plugin's integrity check in ``/server_info``."""
    env = dict(os.environ)
    env.setdefault("SGLANG_PLATFORM", "unicache_cpu")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    env.setdefault("SGLANG_UNICACHE_CHECK_INTEGRITY", "1")  # /server_info reports the invariants
    # A stop's SIGTERM ends the scheduler first; SGLang reads that as a crash and waits 5 s
    # before its diagnostics (py-spy, CUDA core dumps: nothing on a CPU) unless these are off.
    env.setdefault("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "0")
    env.setdefault("SGLANG_CUDA_COREDUMP_BEFORE_CRASH", "0")
    env.update(extra or {})
    return env


@dataclass
class Server:
    """A running ``python -m sglang.launch_server`` process."""

    process: subprocess.Popen
    port: int
    log_path: Path
    args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"server exited with code {self.process.returncode}; log: {self.log_path}\n"
                    + self.log()[-4000:]
                )
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200 \
                        and self.owns_port():
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"server not ready after {timeout:.0f}s; log: {self.log_path}\n"
                           + self.log()[-4000:])

    def owns_port(self) -> bool:
        """Whether a process of this server's group listens on its port: another server (another
        pytest-xdist worker's) that took the port first answers ``/health`` too."""
        import psutil

        for conn in psutil.net_connections("tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr.port == self.port and conn.pid:
                try:
                    if os.getpgid(conn.pid) == self.process.pid:
                        return True
                except ProcessLookupError:
                    pass
        return False

    def stop(self, timeout: float = 30.0) -> None:
        if self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=timeout)
        except ProcessLookupError:
            pass


PORT_TAKEN = "address already in use"
START_ATTEMPTS = 3
HUNG_ATTEMPTS = 2


class PortTaken(RuntimeError):
    pass


class _Forking:
    """``forking_servers``' state: where the zygote logs, and the zygote once a launch needed
    it (started on first use, so a run without servers never pays its import)."""

    def __init__(self) -> None:
        self.log_path: Path | None = None
        self.module = ""
        self.zygote = None
        self.lock = threading.Lock()

    def zygote_for(self, argv: list[str], env: dict[str, str]):
        """The zygote that can fork ``argv`` with ``env``, or None."""
        with self.lock:
            if self.log_path is None or argv[:3] != [sys.executable, "-m", self.module]:
                return None
            if self.zygote is None or self.zygote.process.poll() is not None:
                # First use, or the zygote was killed (an offline ``sglang.Engine``'s shutdown
                # kills every child of the test process): a new one.
                from tests.support.zygote import Zygote

                self.zygote = Zygote(cpu_env(), self.log_path, Path.cwd(), self.module)
        return self.zygote if self.zygote.can_start(env) else None


_forking = _Forking()


@contextmanager
def forking_servers(log_path: Path, module: str = "sglang.launch_server") -> Iterator[None]:
    """Within the block, ``launch`` forks the servers it starts as ``python -m module`` (SGLang's)
    from one process that imported the module once (``zygote.py``) where it can, instead of
    starting each as a new interpreter."""
    with _forking.lock:
        outer = _forking.log_path, _forking.module, _forking.zygote
        _forking.log_path, _forking.module, _forking.zygote = log_path, module, None
    try:
        yield
    finally:
        with _forking.lock:
            zygote = _forking.zygote
            _forking.log_path, _forking.module, _forking.zygote = outer
        if zygote is not None:
            zygote.close()


def start_timeout() -> float:
    return float(os.environ.get("UNICACHE_SERVER_START_TIMEOUT", "300"))


def launch(command: Callable[[int], list[str]], log_path: str | Path, *,
           env: dict[str, str] | None = None, timeout: float | None = None,
           args: Sequence[str] = ()) -> Server:
    """Run ``command(port)`` in its own process group until it answers ``/health``; again on a
    new port when the one picked was taken meanwhile (up to ``START_ATTEMPTS`` times) or the start
    hung (up to ``HUNG_ATTEMPTS`` times)."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    hung = 0
    for attempt in range(1, START_ATTEMPTS + 1):
        port = free_port()
        argv, full_env = command(port), cpu_env(env)
        zygote = _forking.zygote_for(argv, full_env)
        if zygote is not None:
            process = zygote.start(argv, full_env, log_path)
        else:
            with open(log_path, "w") as log:
                process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                           env=full_env, start_new_session=True)
        server = Server(process=process, port=port, log_path=log_path, args=list(args))
        try:
            server.wait_ready(start_timeout() if timeout is None else timeout)
            return server
        except TimeoutError as error:
            hung += 1
            if hung == HUNG_ATTEMPTS or attempt == START_ATTEMPTS:
                raise
            print(f"warning: {error}\nstarting it again", file=sys.stderr)
        except RuntimeError:
            if PORT_TAKEN not in server.log().lower() or attempt == START_ATTEMPTS:
                raise
    raise AssertionError("unreachable")


def start_server(model_path: str | Path, args: list[str], log_path: str | Path, *,
                 env: dict[str, str] | None = None, timeout: float | None = None) -> Server:
    """An SGLang server for ``model_path`` with ``args`` (see ``launch``)."""

    def command(port: int) -> list[str]:
        return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path),
                "--host", "127.0.0.1", "--port", str(port), *args]

    return launch(command, log_path, env=env, timeout=timeout, args=args)
