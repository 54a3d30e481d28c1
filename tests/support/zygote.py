"""Test servers forked from a process that imported SGLang once.

``python -m sglang.launch_server`` spends about 15 s of a 37 s start importing torch, transformers
and SGLang before it parses a flag; a test run starts dozens of servers. The zygote pays that
import once: a child process of the test run that imports ``sglang.launch_server`` and computes
nothing (torch starts its intra-op thread pool at the first parallel op, so none is copied),
then forks one server per request. Each fork
gets a new session (stopped by process group, as a ``Popen`` server is), the log file on its
stdout and stderr, the requested environment and working directory, and runs
``sglang.launch_server`` as ``__main__``, exactly as ``python -m`` does, except that the
processes it starts (scheduler, detokenizer, data-parallel controller) are forked from it rather
than spawned: SGLang sets the ``spawn`` start method, which would import everything again in
each (``_fork_children``). SGLang's plugin loading is idempotent, so a forked scheduler keeps
the hooks its launcher registered. Servers started as new interpreters (below) spawn theirs,
as in production.

Only a request whose environment is the zygote's own (but for ``PYTEST_CURRENT_TEST``) is forked
(``Zygote.can_start``): a variable read at import (by SGLang, torch or the plugin) would
otherwise keep the zygote's value. Anything else, and any other command, starts as a plain
subprocess. What the import itself set (SGLang's cache directories) is set in each fork again.

Protocol: JSON lines on the zygote's stdin and stdout. ``{"op": "start", "args", "env", "log",
"cwd"}`` answers ``{"pid"}``; ``{"op": "poll", "pid"}`` answers ``{"code"}`` (null while it runs).
The zygote reaps its children and exits when its stdin closes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

MODULE = "sglang.launch_server"
REPO = Path(__file__).resolve().parents[2]


def _settled(env: dict[str, str]) -> dict[str, str]:
    """``env`` without what pytest changes per test phase (``PYTEST_CURRENT_TEST``)."""
    return {k: v for k, v in env.items() if k != "PYTEST_CURRENT_TEST"}


class ForkedProcess:
    """What the harness uses of a ``Popen`` (``pid``, ``poll``, ``wait``, ``returncode``) for a
    server the zygote forked: its parent is the zygote, which reports its exit."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]):
        self.zygote, self.pid, self.args = zygote, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.1)
        return self.returncode


class Zygote:
    def __init__(self, env: dict[str, str], log_path: Path, cwd: Path, module: str = MODULE):
        self.env, self.cwd, self.module = dict(env), cwd, module
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.support.zygote", module], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=log, env=self.env, cwd=REPO, text=True, bufsize=1)
        self.lock = threading.Lock()
        ready = self.process.stdout.readline()
        if ready.strip() != "ready":
            self.process.kill()
            raise RuntimeError(f"the server zygote did not start; log: {log_path}")

    def can_start(self, env: dict[str, str]) -> bool:
        """Whether a server of this zygote's module with ``env`` may be forked (that the
        zygote is alive is the harness's to check: it starts a new one)."""
        return _settled(env) == _settled(self.env)

    def _ask(self, request: dict) -> dict:
        with self.lock:
            self.process.stdin.write(json.dumps(request) + "\n")
            answer = self.process.stdout.readline()
        if not answer:
            raise RuntimeError("the server zygote exited")
        return json.loads(answer)

    def start(self, command: list[str], env: dict[str, str], log_path: Path) -> ForkedProcess:
        pid = self._ask({"op": "start", "args": command[3:], "env": env,
                         "log": str(log_path), "cwd": str(self.cwd)})["pid"]
        return ForkedProcess(self, pid, command)

    def exit_code(self, pid: int) -> int | None:
        try:
            return self._ask({"op": "poll", "pid": pid})["code"]
        except (OSError, ValueError, RuntimeError):
            # The zygote is gone: killed with the test process's children (an offline
            # ``sglang.Engine``'s shutdown kills them all), its servers with it.
            import psutil

            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    return None
            except psutil.NoSuchProcess:
                pass
            return -signal.SIGKILL

    def close(self) -> None:
        try:
            self.process.stdin.close()
        except OSError:
            pass  # already gone
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def _fork_children() -> None:
    """Make the server fork its scheduler and detokenizer rather than spawn them: SGLang sets
    the ``spawn`` start method before it starts them, which would import everything again."""
    import multiprocessing

    set_start_method = multiprocessing.set_start_method

    def forking(method: str | None, force: bool = False) -> None:
        set_start_method("fork" if method == "spawn" else method, force=force)

    multiprocessing.set_start_method = forking


def _run_server(module: str, request: dict, imported_env: dict[str, str]) -> None:
    """In the forked child: become the server, as ``python -m module`` would; ``imported_env``:
    the variables the module's import set (SGLang sets cache directories), set again."""
    import runpy
    import traceback

    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.environ.clear()
        os.environ.update(request["env"])
        for key, value in imported_env.items():
            os.environ.setdefault(key, value)
        os.chdir(request["cwd"])
        sys.argv = [module, *request["args"]]
        import setproctitle

        setproctitle.setproctitle(" ".join([sys.executable, "-m", module, *request["args"]]))
        _fork_children()
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def main(module: str) -> None:
    import importlib

    import setproctitle

    # The title's memory is claimed while the environment is the process's own: later, a
    # fork whose environment was replaced could not set one (SGLang names its processes).
    setproctitle.setproctitle(setproctitle.getproctitle())
    before = dict(os.environ)
    importlib.import_module(module)  # the import every fork shares
    if module == MODULE:
        importlib.import_module("sglang.srt.entrypoints.http_server")
    imported_env = {k: v for k, v in os.environ.items() if before.get(k) != v}

    exited: dict[int, int] = {}

    def reap(*_) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            exited[pid] = os.waitstatus_to_exitcode(status)

    signal.signal(signal.SIGCHLD, reap)
    answers = sys.stdout
    answers.write("ready\n")
    answers.flush()
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "start":
            sys.stderr.flush()
            # SIGCHLD waits until a reused pid's old exit code is forgotten.
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
            pid = os.fork()
            if pid == 0:
                _run_server(module, request, imported_env)
            exited.pop(pid, None)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
            answer = {"pid": pid}
        else:
            reap()
            answer = {"code": exited.get(request["pid"])}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    main(sys.argv[1])
