"""Small HTTP helpers for tests and benchmarks against a running server."""

from __future__ import annotations

import concurrent.futures as futures
import json
import time

import requests


def chat(server, body: dict, timeout: float = 120) -> dict:
    response = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=timeout)
    response.raise_for_status()
    return response.json()


def stream_chat(server, body: dict, timeout: float = 300) -> dict:
    """Send ``body`` with ``stream=True``: the answer ``content``, the final ``usage`` and
    ``times``, the arrival of every chunk that carried a choice (seconds after sending; the first
    one comes with the first output token, so ``times[0]`` is the time to first token), and
    ``sent``, the ``time.perf_counter()`` of sending (to line up concurrent requests)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    content, times, usage = [], [], None
    with requests.post(f"{server.url}/v1/chat/completions", json=body, stream=True,
                       timeout=timeout) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[len(b"data: "):])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                times.append(time.perf_counter() - start)
                content.append(choice["delta"].get("content") or "")
    return {"content": "".join(content), "usage": usage, "times": times, "sent": start}


def answer(out: dict) -> str:
    return out["choices"][0]["message"]["content"]


def chat_all(server, bodies: list[dict], concurrency: int = 8) -> list[dict]:
    """Send the bodies concurrently (so the scheduler batches them), results in input order."""
    with futures.ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(lambda body: chat(server, body), bodies))


def internal_state(server) -> dict:
    info = requests.get(f"{server.url}/server_info", timeout=30).json()
    return info["internal_states"][0]


def available_slots(server) -> int:
    return internal_state(server)["kv_available_slots"]


def flush_cache(server, timeout: float = 30) -> None:
    """Empty the radix tree (retries while requests are still running)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if requests.post(f"{server.url}/flush_cache", timeout=30).status_code == 200:
            return
        time.sleep(0.2)
    raise TimeoutError("flush_cache kept failing: requests still running?")
