"""``kernels.warm_up``: the Triton kernels compile at server start, not inside a request."""

from __future__ import annotations

import pytest
import torch

from sglang_unicache.policy.kernels import warm_up


def test_no_kernel_runs_on_the_cpu() -> None:
    assert warm_up("cpu", 2, 4, 16, torch.float32) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_every_kernel_compiles_on_a_gpu() -> None:
    assert warm_up("cuda", 2, 4, 64, torch.bfloat16) == ["window_colsum", "scatter_rows"]
