"""Compression on a CPU pool runs on one intra-op thread and gives the threads back after, even
when it fails; on any other device the thread count is left alone."""

from __future__ import annotations

import pytest
import torch

from sglang_unicache.engine.cpu_threads import one_thread_on_cpu


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield 2
    torch.set_num_threads(before)


def test_one_thread_inside_then_restored(two_threads):
    with one_thread_on_cpu(torch.device("cpu")):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == two_threads


def test_restored_when_the_block_fails(two_threads):
    with pytest.raises(RuntimeError), one_thread_on_cpu(torch.device("cpu")):
        raise RuntimeError("plan failed")
    assert torch.get_num_threads() == two_threads


def test_other_devices_keep_their_threads(two_threads):
    with one_thread_on_cpu(torch.device("meta")):
        assert torch.get_num_threads() == two_threads
