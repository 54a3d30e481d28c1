"""A stand-in for SGLang's server in the harness tests: ``python -m tests.support.health_standin
PORT [EXIT_CODE]`` answers ``/health`` on PORT (with the variable its import set), or exits at
once with EXIT_CODE."""

from __future__ import annotations

import http.server
import os
import sys

if __name__ != "__main__":  # set by an import (the zygote's), as SGLang's sets cache directories
    os.environ.setdefault("UNICACHE_STANDIN_IMPORTED", "1")


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(os.environ.get("UNICACHE_STANDIN_IMPORTED", "unset").encode())

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    if len(sys.argv) > 2:
        print("exiting as asked", flush=True)
        sys.exit(int(sys.argv[2]))
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
