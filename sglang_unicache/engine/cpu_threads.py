"""Compression's tensors are small (one request's image KV, a few thousand rows): on a CPU pool
torch's intra-op threads cost more than they give. With two threads on two cores, while the
tokenizer or another server keeps one core busy, each small op waits at OpenMP's barrier for the
busy core: the plan of a 4 x 1,024-token request measured 10x slower than on one thread
(BENCHMARKS.md, "Overhead"). The forward passes keep every thread; on a GPU pool this changes
nothing (the plan's ops run on the device).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def one_thread_on_cpu(device: torch.device) -> Iterator[None]:
    """Run the block with one intra-op thread when ``device`` is the CPU, then restore."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
