"""Start and stop a real SGLang server process for tests, demos and benchmarks.

Binds 127.0.0.1 on a free port, waits for readiness with a bounded timeout, keeps the log in a
file, and stops the whole process tree by PID.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a CPU server: our platform, quiet warnings, no hub access."""
    env = dict(os.environ)
    env.setdefault("SGLANG_PLATFORM", "unicache_cpu")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")
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

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"server exited with code {self.process.returncode}; log: {self.log_path}\n"
                    + self.log()[-4000:]
                )
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"server not ready after {timeout:.0f}s; log: {self.log_path}")

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


def start_server(model_path: str | Path, args: list[str], log_path: str | Path, *,
                 env: dict[str, str] | None = None, timeout: float = 300.0) -> Server:
    """Launch the server in its own process group and wait until it answers ``/health`` (one that
    does not within ``timeout`` seconds is stopped; 300 s leaves room for a loaded machine)."""
    port = free_port()
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path),
           "--host", "127.0.0.1", "--port", str(port), *args]
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                   env=cpu_env(env), start_new_session=True)
    server = Server(process=process, port=port, log_path=log_path, args=args)
    server.wait_ready(timeout)
    return server
