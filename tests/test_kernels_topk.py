"""Batched masked top-k (kernels/topk.py): the Triton radix select equals the reference exactly
(ties to the lower index, ascending output, -1 padding); the torch.topk path selects the same
sets when there are no ties."""

import pytest
import torch

from sglang_ext.kernels import topk as topk_mod
from sglang_ext.kernels.testing import (
    case_generator,
)
from sglang_ext.kernels.topk import topk_masked, topk_masked_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
POISON = 123456


def _scores(gen, rows, n, ties=False):
    """Rows covering the cases: random, partly masked, fully masked, fewer finite than k,
    +inf entries, (optionally) heavy ties, negative and positive zero."""
    if ties:
        s = torch.randint(-4, 5, (rows, n), generator=gen).float() / 2
    else:
        s = torch.randn(rows, n, generator=gen) * 100
    s[0, torch.rand(n, generator=gen) < 0.5] = float("-inf")
    if rows > 1:
        s[1] = float("-inf")
    if rows > 2:
        s[2, 3:] = float("-inf")  # only 3 finite
    if rows > 3:
        s[3, : min(n, 4)] = float("inf")
        s[3, -1] = -0.0
        s[3, 5 % n] = -0.0  # ties with +0.0 (reference semantics), before later +0.0s
    return s


def _sets(idx):
    return [set(x for x in row.tolist() if x >= 0) for row in idx.reshape(-1, idx.shape[-1])]


@pytest.mark.parametrize("n,k", [(1, 1), (13, 5), (40, 40), (50, 64), (100, 17), (300, 150)])
@pytest.mark.parametrize("ties", [False, True], ids=["cont", "ties"])
def test_triton_equals_reference(n, k, ties):
    gen = case_generator("topk", n, k, ties)
    s = _scores(gen, 5, n, ties).to(DEVICE)
    out = torch.full((5, k), POISON, dtype=torch.int32, device=DEVICE)
    got = topk_masked(s, k, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got, topk_masked_ref(s, k))


@pytest.mark.parametrize("radix_bits", [5, 6, 8])
@pytest.mark.parametrize("early_exit", [True, False], ids=["exit", "noexit"])
def test_radix_variants(radix_bits, early_exit):
    """Every digit width, with and without the early exit, on rows that exit at different
    passes: continuous (usually before the last pass), heavy ties (never), distinct powers of
    two (after the first pass), all equal (never), one finite entry."""
    gen = case_generator("topk-radix", radix_bits, early_exit)
    n = 200
    s = torch.cat([
        _scores(gen, 4, n),
        _scores(gen, 4, n, ties=True),
        torch.stack([
            2.0 ** (torch.randperm(n, generator=gen).float() - 100),  # distinct exponents
            -(2.0 ** (torch.randperm(n, generator=gen).float() - 100)),
            torch.full((n,), 3.0),
            torch.where(torch.arange(n) == 77, 1.0, float("-inf")),
        ]),
    ]).to(DEVICE)
    for k in (1, 100, 199):
        got = topk_masked(s, k, radix_bits=radix_bits, early_exit=early_exit)
        assert torch.equal(got, topk_masked_ref(s, k)), k


@pytest.mark.parametrize("n,k", [(8192, 246), (3936, 1968)])
def test_pipeline_row_lengths(n, k):
    """The block top-k of a 128k context at block size 16 (8192 entries: register resident,
    16 warps) and the two_level token top-k (3936 candidates, k 1968)."""
    gen = case_generator("topk-pipeline", n, k)
    s = torch.cat([_scores(gen, 2, n), _scores(gen, 1, n, ties=True)]).to(DEVICE)
    assert torch.equal(topk_masked(s, k), topk_masked_ref(s, k))


def test_streaming_rows_and_batched_shape(monkeypatch):
    """Rows longer than the register-resident limit stream from memory each pass; leading
    dims are kept."""
    monkeypatch.setattr(topk_mod, "_MAX_RESIDENT", 256)
    monkeypatch.setattr(topk_mod, "_STREAM_BLOCK", 128)
    gen = case_generator("topk-stream")
    for ties in (False, True):
        s = _scores(gen, 4, 1000, ties).view(2, 2, 1000).to(DEVICE)
        for k, early_exit in ((7, True), (300, True), (300, False)):
            got = topk_masked(s, k, early_exit=early_exit)
            assert got.shape == (2, 2, k)
            assert torch.equal(got, topk_masked_ref(s, k))


def test_torch_impl_same_sets():
    gen = case_generator("topk-torch")
    for n, k in [(13, 5), (50, 64), (300, 150)]:
        s = _scores(gen, 5, n).to(DEVICE)
        s[3, :4] = torch.arange(4.0) + 1e3  # distinct, no +inf ties
        out = torch.full((5, k), POISON, dtype=torch.int32, device=DEVICE)
        got = topk_masked(s, k, out=out, impl="torch")
        assert not (got == POISON).any()
        assert _sets(got) == _sets(topk_masked_ref(s, k))
        # -1 exactly where the row has fewer finite entries than k
        finite = s.isfinite().sum(-1).clamp(max=k)
        assert torch.equal((got >= 0).sum(-1), finite)


def test_k_zero():
    s = torch.randn(3, 10, device=DEVICE)
    assert topk_masked(s, 0).shape == (3, 0)


@gpu
@needs_cuda
@pytest.mark.parametrize("n,k", [(2048, 123), (2048, 246), (3936, 1968), (8192, 246),
                                 (32768, 1968), (131072, 1968)])
def test_gpu_real_shapes(n, k):
    """Pipeline shapes: block top-k (max_blocks x C), token top-k (C*bs x n_sel), DS over the
    whole 32k / 128k context; 32 rows = B 4 x Hkv 8."""
    gen = case_generator("gpu-topk", n, k)
    for ties in (False, True):
        s = _scores(gen, 32, n, ties).cuda()
        got = topk_masked(s, k)
        assert torch.equal(got, topk_masked_ref(s, k))
        for bits, early_exit in ((6, True), (8, False)):
            assert torch.equal(topk_masked(s, k, radix_bits=bits, early_exit=early_exit), got)
        for warps in (4, 32):  # the launch's warps (benchmarks/bench_sparse_attention.py)
            assert torch.equal(topk_masked(s, k, num_warps=warps), got)
        if not ties:
            assert _sets(topk_masked(s, k, impl="torch")) == _sets(got)


def test_out_rows_scatter_each_entry_into_its_table_row():
    """``out_rows``: entry i's rows land in table row out_rows[i]; other table rows keep what
    they held."""
    gen = case_generator("topk-out-rows")
    scores = _scores(gen, 6, 40).view(3, 2, 40).to(DEVICE)
    table = torch.full((5, 2, 7), POISON, dtype=torch.int32, device=DEVICE)
    rows = torch.tensor([4, 0, 2], device=DEVICE)
    got = topk_masked(scores, 7, out=table, out_rows=rows)
    assert got.data_ptr() == table.data_ptr()
    want = topk_masked_ref(scores, 7)
    assert torch.equal(table[rows], want)
    assert (table[[1, 3]] == POISON).all()
    with pytest.raises(ValueError, match="out_rows"):
        topk_masked(scores, 7, out_rows=rows)
    with pytest.raises(ValueError, match="output table"):
        topk_masked(scores, 7, out=table[:, :1], out_rows=rows)
