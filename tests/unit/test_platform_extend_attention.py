"""The CPU platform's extend attention (``UNICACHE_CPU_EXTEND_ROWS``): each request's new rows
against its prefix and themselves give SGLang's own rows; a request without a prefix takes the
same SDPA call as SGLang's."""

import pytest
import torch

from sglang_unicache.platform.cpu import extend_attention

backend = pytest.importorskip("sglang.srt.layers.attention.torch_native_backend")
# SGLang's code even where the platform has installed the new rows in this process
SGLANG = extend_attention.sglang_extend(backend.TorchNativeAttnBackend)
HEADS, KV_HEADS, DIM = 4, 2, 16


def _batch(prefixes, extends, seed=0):
    g = torch.Generator().manual_seed(seed)
    totals = [p + e for p, e in zip(prefixes, extends, strict=True)]
    slots = sum(totals) + 3
    k_cache = torch.randn(slots, KV_HEADS, DIM, generator=g)
    v_cache = torch.randn(slots, KV_HEADS, DIM, generator=g)
    perm = torch.randperm(slots, generator=g)  # a request's slots are scattered in the pool
    req_to_token = torch.zeros(len(totals) + 1, max(totals), dtype=torch.int64)
    used = 0
    for i, t in enumerate(totals):
        req_to_token[i + 1, :t] = perm[used:used + t]
        used += t
    query = torch.randn(sum(extends), HEADS, DIM, generator=g)
    args = dict(k_cache=k_cache, v_cache=v_cache, req_to_token=req_to_token,
                req_pool_indices=torch.arange(1, len(totals) + 1),
                seq_lens=torch.tensor(totals), extend_prefix_lens=torch.tensor(prefixes),
                extend_seq_lens=torch.tensor(extends), scaling=DIM ** -0.5, enable_gqa=True,
                causal=True)
    return query, args


class _Backend:
    """A backend whose SGLang original (for the fallbacks) is SGLang's own code."""


setattr(_Backend, extend_attention._ORIGINAL, SGLANG)


def _run(fn, query, args):
    output = torch.full_like(query, float("nan"))
    fn(_Backend(), query, output, **args)
    return output


def test_offset_causal_mask_lets_each_new_row_see_its_prefix_and_itself():
    mask = extend_attention.offset_causal_mask(2, 5, "cpu")
    assert mask.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]


@pytest.mark.parametrize("prefixes,extends", [([0, 30, 7], [12, 5, 1]), ([64], [3]),
                                              ([1, 2], [40, 9])])
def test_the_new_rows_are_sglangs_rows(prefixes, extends):
    query, args = _batch(prefixes, extends)
    ours = _run(extend_attention.forward_extend_rows, query, args)
    theirs = _run(SGLANG, query, args)
    assert not ours.isnan().any()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    # no prefix: the same call as SGLang's, the same bits
    first = slice(0, extends[0])
    if prefixes[0] == 0:
        assert torch.equal(ours[first], theirs[first])


def test_without_a_prefix_it_is_sglangs_own_code():
    query, args = _batch([0, 0], [6, 4])
    calls = []

    class Backend:
        pass

    def original(self, *a, **kw):
        calls.append(a)
        return SGLANG(self, *a, **kw)

    setattr(Backend, extend_attention._ORIGINAL, original)
    output = torch.empty_like(query)
    extend_attention.forward_extend_rows(Backend(), query, output, **args)
    assert len(calls) == 1


def test_installed_by_default_and_kept_off_when_asked(monkeypatch):
    cls = backend.TorchNativeAttnBackend
    # SGLang's class as it ships; monkeypatch puts back whatever this process had installed
    monkeypatch.setattr(cls, "_run_sdpa_forward_extend", SGLANG)
    monkeypatch.setattr(cls, extend_attention._ORIGINAL, None, raising=False)
    monkeypatch.setenv(extend_attention.ENV, "0")
    assert extend_attention.install() is False
    assert cls._run_sdpa_forward_extend is SGLANG
    monkeypatch.delenv(extend_attention.ENV)
    for _ in range(2):  # idempotent: SGLang's code is kept aside once
        assert extend_attention.install() is True
        assert cls._run_sdpa_forward_extend is extend_attention.forward_extend_rows
        assert extend_attention.sglang_extend(cls) is SGLANG
