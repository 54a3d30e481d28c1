"""A stand-in for SGLang's server in the harness tests: ``python -m tests.support.health_standin
PORT [EXIT_CODE]`` answers ``/health`` on PORT (with the variable its import set), or exits at
once with EXIT_CODE. ``/child`` starts a child process as SGLang starts its scheduler (after
``set_start_method("spawn")``) and answers whether it was forked or spawned."""

from __future__ import annotations

import http.server
import multiprocessing
import os
import sys

if __name__ != "__main__":  # set by an import (the zygote's), as SGLang's sets cache directories
    os.environ.setdefault("UNICACHE_STANDIN_IMPORTED", "1")

SERVING = False  # True where the server runs; a spawned child re-imports the module: False


def _child() -> None:
    sys.exit(0 if SERVING else 3)


def started_child() -> str:
    multiprocessing.set_start_method("spawn", force=True)
    child = multiprocessing.Process(target=_child)
    child.start()
    child.join(timeout=60)
    return {0: "forked", 3: "spawned"}.get(child.exitcode, f"exit {child.exitcode}")


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = (started_child() if self.path == "/child"
                else os.environ.get("UNICACHE_STANDIN_IMPORTED", "unset"))
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    if len(sys.argv) > 2:
        print("exiting as asked", flush=True)
        sys.exit(int(sys.argv[2]))
    SERVING = True
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
