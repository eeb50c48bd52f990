"""The plain-torch selection reference against brute-force oracles.

The oracles below loop explicitly over heads, blocks and tokens and follow the definitions
directly (float64, no shared code with the implementation). Selection tests use dyadic inputs
(see `_dyadic`) so every score is exact in both and masks can be compared bit for bit, ties
included.
"""

from __future__ import annotations

import dataclasses

import math
import zlib

import pytest
import torch
import torch.nn.functional as F

from sglang_ext.selection import (
    METHODS,
    SelectionParams,
    block_minmax,
    label_token_scores,
    merge_attention_states,
    quest_block_scores,
    select_token_mask,
    sparse_attention,
    sparse_attention_with_lse,
    sparse_decode,
)
from sglang_ext.selection.reference import (
    BatchedSparseDecode,
    round_summaries,
    to_fp8_directed,
)

# (Hq, Hkv): MHA, GQA 9/3, GQA 32/8, MQA.
HEADS = [(4, 4), (9, 3), (32, 8), (8, 1)]
HEAD_IDS = ["mha", "gqa9x3", "gqa32x8", "mqa"]
D, DV = 32, 24
SM_SCALE = 1 / math.sqrt(D)
NUM_LABEL_CHANNELS = 8


def _gen(*case: object) -> torch.Generator:
    """A reproducible generator seeded differently for every test case."""
    return torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))


def _dyadic(gen: torch.Generator, *shape: int, levels: int = 128, dtype=torch.float32):
    """Random multiples of 1/32 in [-levels/32, levels/32].

    With levels <= 128 these are exact in bf16, and a D=32 dot product of them is a multiple
    of 2^-10 below 2^9, so it is exact in fp32 whatever the summation order.
    """
    return (torch.randint(-levels, levels + 1, shape, generator=gen) / 32).to(dtype)


def _randn(gen: torch.Generator, *shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype)


def _qkv(gen: torch.Generator, hq: int, hkv: int, length: int, dtype=torch.float32):
    """Random normal q [Hq, D], keys [L, Hkv, D], values [L, Hkv, DV]."""
    return (
        _randn(gen, hq, D, dtype=dtype),
        _randn(gen, length, hkv, D, dtype=dtype),
        _randn(gen, length, hkv, DV, dtype=dtype),
    )


def _random_channels(gen: torch.Generator, num_kv_heads: int) -> torch.Tensor:
    return torch.stack(
        [torch.randperm(D, generator=gen)[:NUM_LABEL_CHANNELS] for _ in range(num_kv_heads)]
    )


# ----------------------------------------------------------------------------- oracles


def _dot(x: list[float], y: list[float]) -> float:
    return sum(a * b for a, b in zip(x, y))


def _group(hq: int, hkv: int, g: int) -> range:
    size = hq // hkv
    return range(g * size, (g + 1) * size)


def oracle_block_minmax(keys: torch.Tensor, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    length, hkv, dim = keys.shape
    k = keys.double().tolist()
    kmin, kmax = [], []
    for b in range(-(-length // bs)):
        block = range(b * bs, min(length, (b + 1) * bs))
        kmin.append([[min(k[t][g][d] for t in block) for d in range(dim)] for g in range(hkv)])
        kmax.append([[max(k[t][g][d] for t in block) for d in range(dim)] for g in range(hkv)])
    return torch.tensor(kmin, dtype=torch.float64), torch.tensor(kmax, dtype=torch.float64)


def oracle_quest_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    nb, hkv, dim = kmin.shape
    ql, lo, hi = q.double().tolist(), kmin.double().tolist(), kmax.double().tolist()
    out = [[0.0] * nb for _ in range(hkv)]
    for g in range(hkv):
        for b in range(nb):
            out[g][b] = max(
                sum(max(ql[h][d] * hi[b][g][d], ql[h][d] * lo[b][g][d]) for d in range(dim))
                for h in _group(q.shape[0], hkv, g)
            )
    return torch.tensor(out, dtype=torch.float64)


def oracle_token_scores(
    q: torch.Tensor, keys: torch.Tensor, channels: torch.Tensor | None
) -> torch.Tensor:
    length, hkv, dim = keys.shape
    ql, kl = q.double().tolist(), keys.double().tolist()
    out = [[0.0] * length for _ in range(hkv)]
    for g in range(hkv):
        ch = range(dim) if channels is None else channels[g].tolist()
        heads = [[ql[h][c] for c in ch] for h in _group(q.shape[0], hkv, g)]
        for t in range(length):
            k_t = [kl[t][g][c] for c in ch]
            out[g][t] = max(_dot(q_h, k_t) for q_h in heads)
    return torch.tensor(out, dtype=torch.float64)


def _top(items, k: int, score) -> list[int]:
    """The k items of highest score, ties to the lower index."""
    return sorted(items, key=lambda i: (-score[i], i))[:k]


def oracle_select_from_scores(
    p: SelectionParams, length: int, quest: torch.Tensor, tok: torch.Tensor
) -> torch.Tensor:
    """The selection rules, given quest scores [Hkv, NB] and token scores [Hkv, L]."""
    hkv = tok.shape[0]
    if length <= p.budget:
        return torch.ones(hkv, length, dtype=torch.bool)
    bs = p.block_size
    middle = list(range(p.sink, length - p.window))
    n_sel = p.budget - p.sink - p.window
    blocks = sorted({t // bs for t in middle})
    rows = []
    for g in range(hkv):
        bscore, tscore = quest[g].tolist(), tok[g].tolist()
        chosen = set(range(p.sink)) | set(range(length - p.window, length))
        if p.method == "quest":
            kept = _top(blocks, n_sel // bs, bscore)
            chosen |= {t for t in middle if t // bs in kept}
        elif p.method == "ds":
            chosen |= set(_top(middle, n_sel, tscore))
        else:
            if p.block_score == "label_max":  # a block's largest middle token score
                bscore = {b: max(tscore[t] for t in middle if t // bs == b) for b in blocks}
            kept = _top(blocks, min(p.candidate_blocks, len(blocks)), bscore)
            chosen |= set(_top([t for t in middle if t // bs in kept], n_sel, tscore))
        rows.append([t in chosen for t in range(length)])
    return torch.tensor(rows, dtype=torch.bool)


def oracle_select(
    q: torch.Tensor, keys: torch.Tensor, p: SelectionParams, channels: torch.Tensor | None
) -> torch.Tensor:
    quest = oracle_quest_scores(q, *oracle_block_minmax(keys, p.block_size))
    tok = oracle_token_scores(q, keys, channels)
    return oracle_select_from_scores(p, keys.shape[0], quest, tok)


def oracle_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive softmax per query head over its kv head's masked positions (output, LSE)."""
    length, hkv, _ = keys.shape
    ql, kl, vl = q.double().tolist(), keys.double().tolist(), values.double().tolist()
    dv = values.shape[2]
    out = [[0.0] * dv for _ in range(q.shape[0])]
    lse = [-math.inf] * q.shape[0]
    for g in range(hkv):
        pos = [t for t in range(length) if mask[g, t]]
        for h in _group(q.shape[0], hkv, g):
            if not pos:
                continue
            s = [_dot(ql[h], kl[t][g]) * scale for t in pos]
            m = max(s)
            w = [math.exp(x - m) for x in s]
            z = sum(w)
            for wi, t in zip(w, pos):
                for d in range(dv):
                    out[h][d] += wi / z * vl[t][g][d]
            lse[h] = m + math.log(z)
    return torch.tensor(out, dtype=torch.float64), torch.tensor(lse, dtype=torch.float64)


def full_attention(q, keys, values, scale: float) -> torch.Tensor:
    """torch SDPA with GQA, fp32, as [Hq, Dv]."""
    return F.scaled_dot_product_attention(
        q.float()[None, :, None],
        keys.float().transpose(0, 1)[None],
        values.float().transpose(0, 1)[None],
        scale=scale,
        enable_gqa=True,
    )[0, :, 0]


# ------------------------------------------------------------------ selection building blocks


@pytest.mark.parametrize("bs", [1, 16, 64])
@pytest.mark.parametrize("length", [1, 15, 16, 17, 63, 64, 65, 130])
def test_block_minmax(bs: int, length: int) -> None:
    keys = _randn(_gen("minmax", bs, length), length, 3, D, dtype=torch.bfloat16)
    kmin, kmax = block_minmax(keys, bs)
    omin, omax = oracle_block_minmax(keys, bs)
    assert kmin.dtype == kmax.dtype == torch.float32
    assert kmin.shape == (-(-length // bs), 3, D)
    torch.testing.assert_close(kmin.double(), omin, rtol=0, atol=0)
    torch.testing.assert_close(kmax.double(), omax, rtol=0, atol=0)


@pytest.mark.parametrize("bs", [1, 16, 64])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_quest_block_scores(heads: tuple[int, int], bs: int) -> None:
    hq, hkv = heads
    gen = _gen("quest", heads, bs)
    q, keys = _randn(gen, hq, D), _randn(gen, 3 * bs + 5, hkv, D)
    kmin, kmax = block_minmax(keys, bs)
    scores = quest_block_scores(q, kmin, kmax)
    assert scores.dtype == torch.float32 and scores.shape == (hkv, kmin.shape[0])
    expected = oracle_quest_scores(q, kmin, kmax)
    torch.testing.assert_close(scores.double(), expected, rtol=1e-5, atol=1e-4)
    # It bounds every q·k of the block from above, for every query head of the group.
    qk = torch.einsum("gjd,tgd->gjt", q.view(hkv, hq // hkv, D), keys).amax(1)
    block_of = torch.arange(keys.shape[0]) // bs
    assert (qk <= scores[:, block_of] + 1e-4).all()


@pytest.mark.parametrize("use_channels", [False, True], ids=["all_channels", "label_channels"])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_label_token_scores(heads: tuple[int, int], use_channels: bool) -> None:
    hq, hkv = heads
    gen = _gen("label", heads, use_channels)
    q, keys = _randn(gen, hq, D), _randn(gen, 37, hkv, D, dtype=torch.bfloat16)
    channels = _random_channels(gen, hkv) if use_channels else None
    scores = label_token_scores(q, keys, channels)
    assert scores.dtype == torch.float32 and scores.shape == (hkv, 37)
    torch.testing.assert_close(
        scores.double(), oracle_token_scores(q, keys, channels), rtol=1e-5, atol=1e-4
    )


# ------------------------------------------------------------------------------ selection

# name: ((block_size, budget, candidate_blocks, sink, window), context lengths)
SELECT_CONFIGS = {
    "bs16": ((16, 64, 4, 4, 8), [40, 64, 65, 95, 96, 97, 127, 128, 129, 257]),
    "bs16_few_candidates": ((16, 64, 2, 4, 8), [97, 129, 200]),
    "bs1": ((1, 20, 24, 2, 3), [19, 20, 21, 50]),
    "bs1_few_candidates": ((1, 20, 6, 2, 3), [21, 50]),
    "bs64": ((64, 160, 3, 16, 16), [161, 191, 192, 193, 255, 256, 257, 400]),
    "sink0_window1": ((16, 40, 3, 0, 1), [41, 47, 48, 49, 63, 64, 65, 150]),
    "nsel0": ((16, 12, 2, 4, 8), [12, 13, 100]),
    "nsel_below_block": ((16, 20, 2, 4, 8), [21, 64, 100]),
    "wide_sink_window": ((16, 80, 3, 20, 40), [81, 112, 113, 300]),
}
SELECT_CASES = [
    pytest.param(cfg, length, id=f"{name}-L{length}")
    for name, (cfg, lengths) in SELECT_CONFIGS.items()
    for length in lengths
]


def _params(method: str, cfg: tuple[int, int, int, int, int]) -> SelectionParams:
    bs, budget, cand, sink, window = cfg
    return SelectionParams(method, budget, bs, cand, sink, window)


def _must_fill_budget(p: SelectionParams, length: int) -> bool:
    """Whether the mask must hold exactly min(L, budget) positions, from the counts alone."""
    if length <= p.budget or p.method == "ds":
        return True
    if p.method == "quest":
        return False
    # two_level is exact if even the kept blocks with the fewest middle positions hold n_sel.
    middle = range(p.sink, length - p.window)
    per_block: dict[int, int] = {}
    for t in middle:
        per_block[t // p.block_size] = per_block.get(t // p.block_size, 0) + 1
    fewest = sorted(per_block.values())[: min(p.candidate_blocks, len(per_block))]
    return sum(fewest) >= p.budget - p.sink - p.window


def _check_selection(q, keys, p: SelectionParams, channels, label: str, expected=None) -> None:
    length = keys.shape[0]
    mask = select_token_mask(q, keys, p, channels)
    if expected is None:
        expected = oracle_select(q, keys, p, channels)
    assert mask.dtype == torch.bool and mask.shape == expected.shape
    diff = (mask != expected).nonzero().tolist()
    assert not diff, f"{label}: (kv head, position) differing from the oracle: {diff[:10]}"
    counts = mask.sum(1)
    assert (counts <= p.budget).all()
    if _must_fill_budget(p, length):
        assert (counts == min(length, p.budget)).all(), f"{label}: counts {counts.tolist()}"
    assert mask[:, : p.sink].all() and mask[:, length - p.window :].all()


@pytest.mark.parametrize("cfg,length", SELECT_CASES)
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_select_token_mask(heads: tuple[int, int], cfg, length: int) -> None:
    hq, hkv = heads
    gen = _gen("select", heads, cfg, length)
    q, keys = _dyadic(gen, hq, D), _dyadic(gen, length, hkv, D)
    # The oracle's scores are the slow part: compute them once for the three methods.
    quest = oracle_quest_scores(q, *oracle_block_minmax(keys, cfg[0]))
    for channels in (None, _random_channels(gen, hkv)):
        tok = oracle_token_scores(q, keys, channels)
        for method in (*METHODS, "two_level_label_max"):
            p = _params(method.removesuffix("_label_max"), cfg)
            if method.endswith("label_max"):
                p = dataclasses.replace(p, block_score="label_max")
            expected = oracle_select_from_scores(p, length, quest, tok)
            label = f"{method}, channels={'all' if channels is None else 'label'}"
            _check_selection(q, keys, p, channels, label, expected)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_select_token_mask_ties(heads: tuple[int, int], method: str) -> None:
    """Values in {-1/32, 0, 1/32} make many equal scores: ties must go to the lower index."""
    hq, hkv = heads
    gen = _gen("ties", heads, method)
    q, keys = _dyadic(gen, hq, D, levels=1), _dyadic(gen, 150, hkv, D, levels=1)
    keys[40:80] = 0  # whole blocks with identical summaries and zero token scores
    for cfg in [(16, 64, 4, 4, 8), (1, 20, 6, 2, 3)]:
        _check_selection(q, keys, _params(method, cfg), _random_channels(gen, hkv), method)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_select_token_mask_bf16(heads: tuple[int, int], method: str) -> None:
    hq, hkv = heads
    gen = _gen("bf16", heads, method)
    q = _dyadic(gen, hq, D, dtype=torch.bfloat16)
    keys = _dyadic(gen, 130, hkv, D, dtype=torch.bfloat16)
    _check_selection(q, keys, _params(method, (16, 64, 4, 4, 8)), None, method)


# ------------------------------------------------------------------------------ attention


def _random_mask(gen: torch.Generator, hkv: int, length: int) -> torch.Tensor:
    """Per-head masks of different sizes, one head keeping a single position."""
    mask = torch.rand(hkv, length, generator=gen) < torch.linspace(0.2, 0.8, hkv)[:, None]
    mask[0] = False
    mask[0, length // 2] = True
    return mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_sparse_attention_matches_naive(heads: tuple[int, int], dtype: torch.dtype) -> None:
    hq, hkv = heads
    gen = _gen("attn", heads, dtype)
    length = 70
    q, keys, values = _qkv(gen, hq, hkv, length, dtype)
    mask = _random_mask(gen, hkv, length)
    out, lse = sparse_attention_with_lse(q, keys, values, mask, SM_SCALE)
    ref_out, ref_lse = oracle_attention(q, keys, values, mask, SM_SCALE)
    assert out.dtype == dtype and out.shape == (hq, DV)
    assert lse.dtype == torch.float32 and lse.shape == (hq,)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(out.double(), ref_out, **tol)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    assert torch.equal(sparse_attention(q, keys, values, mask, SM_SCALE), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_full_mask_matches_sdpa(heads: tuple[int, int], dtype: torch.dtype) -> None:
    hq, hkv = heads
    gen = _gen("sdpa", heads, dtype)
    length = 333
    q, keys, values = _qkv(gen, hq, hkv, length, dtype)
    out = sparse_attention(q, keys, values, torch.ones(hkv, length, dtype=torch.bool), SM_SCALE)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(out.float(), full_attention(q, keys, values, SM_SCALE), **tol)


@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_merge_attention_states(heads: tuple[int, int]) -> None:
    hq, hkv = heads
    gen = _gen("merge", heads)
    length = 90
    q, keys, values = _qkv(gen, hq, hkv, length)
    union = _random_mask(gen, hkv, length)
    part1 = union & (torch.rand(hkv, length, generator=gen) < 0.5)
    part1[0] = False  # one kv head's first part is empty: LSE -inf must merge as identity
    part2 = union & ~part1
    o1, lse1 = sparse_attention_with_lse(q, keys, values, part1, SM_SCALE)
    o2, lse2 = sparse_attention_with_lse(q, keys, values, part2, SM_SCALE)
    assert torch.isneginf(lse1[: hq // hkv]).all() and (o1[: hq // hkv] == 0).all()
    out, lse = merge_attention_states(o1, lse1, o2, lse2)
    ref_out, ref_lse = sparse_attention_with_lse(q, keys, values, union, SM_SCALE)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    # Merging in the other order, and merging two empty states, are consistent too.
    swapped, _ = merge_attention_states(o2, lse2, o1, lse1)
    torch.testing.assert_close(swapped, out, rtol=1e-6, atol=1e-6)
    empty_out, empty_lse = merge_attention_states(o1[:1], lse1[:1], o1[:1], lse1[:1])
    assert (empty_out == 0).all() and torch.isneginf(empty_lse).all()


# ------------------------------------------------------------------------------ decode


@pytest.mark.parametrize("length", [1, 50, 64])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_dense_decode_equals_full_attention(
    heads: tuple[int, int], method: str, length: int
) -> None:
    hq, hkv = heads
    gen = _gen("dense", heads, method, length)
    q, keys, values = _qkv(gen, hq, hkv, length)
    p = _params(method, (16, 64, 4, 4, 8))
    out = sparse_decode(q, keys, values, p, SM_SCALE, _random_channels(gen, hkv))
    torch.testing.assert_close(out, full_attention(q, keys, values, SM_SCALE), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_sparse_decode_matches_oracle(heads: tuple[int, int], method: str) -> None:
    hq, hkv = heads
    gen = _gen("decode", heads, method)
    length = 200
    q, keys = _dyadic(gen, hq, D), _dyadic(gen, length, hkv, D)
    values = _randn(gen, length, hkv, DV)
    channels = _random_channels(gen, hkv)
    p = _params(method, (16, 64, 4, 4, 8))
    out = sparse_decode(q, keys, values, p, SM_SCALE, channels)
    ref_out, _ = oracle_attention(q, keys, values, oracle_select(q, keys, p, channels), SM_SCALE)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"method": "topk"},
        {"block_size": 12},
        {"block_size": 0},
        {"sink": 40, "window": 30},
        {"window": 0},
        {"sink": -1},
        {"method": "two_level", "candidate_blocks": 0},
    ],
)
def test_params_validation(kwargs: dict) -> None:
    base = dict(method="ds", budget=64, block_size=16, candidate_blocks=4, sink=4, window=8)
    with pytest.raises(ValueError):
        SelectionParams(**{**base, **kwargs})


def test_fp8_directed_rounding_brackets_every_value() -> None:
    """``to_fp8_directed`` gives the nearest fp8 value on the asked side (checked against every
    finite float8_e4m3fn value), -0 and subnormals included, saturating at ±448."""
    fp8 = torch.float8_e4m3fn
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8).float()
    grid = grid[torch.isfinite(grid)].unique().sort().values
    gen = _gen("fp8-directed")
    x = torch.cat([torch.randn(4000, generator=gen) * s for s in (1e-3, 0.05, 1, 30, 1000)]
                  + [grid, grid * 1.01, torch.tensor([0.0, -0.0, 2 ** -9, -(2 ** -10)])])
    clamped = x.clamp(-448, 448)
    up = to_fp8_directed(x, up=True).float()
    down = to_fp8_directed(x, up=False).float()
    assert torch.equal(up, grid[torch.searchsorted(grid, clamped)])
    assert torch.equal(down, grid[torch.searchsorted(grid, clamped, right=True) - 1])
    kmin, kmax = round_summaries(x, x, "fp8_e4m3")
    assert torch.equal(kmin, down) and torch.equal(kmax, up)
    assert round_summaries(x, x, "auto")[0] is x


@pytest.mark.parametrize("label_dtype, summary_dtype",
                         [("fp8_e4m3", "auto"), ("auto", "fp8_e4m3"), ("fp8_e4m3", "fp8_e4m3")])
def test_batched_reference_scores_stored_labels_and_summaries(label_dtype: str,
                                                             summary_dtype: str) -> None:
    """The CPU server's batched reference decode (``BatchedSparseDecode``) rounds the labels and
    the summaries as the server stores them, request for request the same output as
    ``sparse_decode`` with those params; and the rounding changes what is selected here (so the
    comparison can tell a decode that ignores it)."""
    hq, hkv, length = 6, 2, 300
    gen = _gen("batched-stored", label_dtype, summary_dtype)
    lengths = [length, length - 37, length - 101]
    keys = [_randn(gen, n, hkv, D) * 3 for n in lengths]
    values = [_randn(gen, n, hkv, DV) for n in lengths]
    pool_k = torch.cat(keys)
    pool_v = torch.cat(values)
    starts = [0, lengths[0], lengths[0] + lengths[1]]
    rows = torch.zeros(3, length, dtype=torch.long)
    for i, (s, n) in enumerate(zip(starts, lengths)):
        rows[i, :n] = torch.arange(s, s + n)
    channels = _random_channels(gen, hkv)
    q = _randn(gen, 3, hq, D)
    base = SelectionParams("two_level", 48, 4, 16, 4, 8)  # 64 candidates for 36 tokens
    stored = SelectionParams("two_level", 48, 4, 16, 4, 8, label_dtype=label_dtype,
                             summary_dtype=summary_dtype)
    out = BatchedSparseDecode(rows, lengths, [stored] * 3).decode(q, pool_k, pool_v, SM_SCALE,
                                                                channels)
    changed = False
    for i in range(3):
        expected = sparse_decode(q[i], keys[i], values[i], stored, SM_SCALE, channels)
        torch.testing.assert_close(out[i], expected, rtol=1e-5, atol=1e-5)
        changed |= not torch.equal(
            select_token_mask(q[i], keys[i], stored, channels),
            select_token_mask(q[i], keys[i], base, channels))
    assert changed
    with pytest.raises(ValueError, match="one label_dtype"):
        BatchedSparseDecode(rows, lengths, [stored, base, stored], split_families=False)


def test_batched_reference_label_max_block_filter() -> None:
    """``BatchedSparseDecode`` ranks the blocks of label_max rows by their largest middle
    token score and the others by the bound, in one batch, each row as ``sparse_decode`` alone;
    and the two filters keep different blocks here (so the test tells them apart)."""
    hq, hkv = 6, 2
    gen = _gen("batched-label-max")
    lengths = [300, 263, 199]
    keys = [_randn(gen, n, hkv, D) * 3 for n in lengths]
    values = [_randn(gen, n, hkv, DV) for n in lengths]
    pool_k, pool_v = torch.cat(keys), torch.cat(values)
    rows = torch.zeros(3, max(lengths), dtype=torch.long)
    start = 0
    for i, n in enumerate(lengths):
        rows[i, :n] = torch.arange(start, start + n)
        start += n
    channels = _random_channels(gen, hkv)
    q = _randn(gen, 3, hq, D)
    bound = SelectionParams("two_level", 48, 8, 5, 4, 8)
    label_max = dataclasses.replace(bound, block_score="label_max")
    params = [label_max, bound, label_max]
    out = BatchedSparseDecode(rows, lengths, params).decode(q, pool_k, pool_v, SM_SCALE, channels)
    for i in range(3):
        expected = sparse_decode(q[i], keys[i], values[i], params[i], SM_SCALE, channels)
        torch.testing.assert_close(out[i], expected, rtol=1e-5, atol=1e-5)
    assert any(not torch.equal(select_token_mask(q[i], keys[i], bound, channels),
                               select_token_mask(q[i], keys[i], label_max, channels))
               for i in range(3))


def test_rerank_picks_by_exact_score_among_the_label_shortlist() -> None:
    """``rerank``: the label scores shortlist rerank x n_sel tokens and the exact q·k picks the
    n_sel among them: from scratch with a plain sort here; with a shortlist covering the whole
    middle it is the exact top-k; and it differs from the label choice (so a decode that
    ignores rerank fails)."""
    hq, hkv, length = 6, 2, 256
    gen = _gen("rerank")
    q, keys, _ = _qkv(gen, hq, hkv, length)
    channels = _random_channels(gen, hkv)
    plain = SelectionParams("ds", 48, 4, 0, 4, 8)
    n_sel = 48 - 4 - 8
    lo, hi = 4, length - 8
    # (factor, floor): the shortlist is max(factor x n_sel, floor) tokens
    for rerank, floor, size in ((2, 0, 2 * n_sel), (4, 0, 4 * n_sel), (2, 150, 150)):
        p = dataclasses.replace(plain, rerank=rerank, rerank_min_tokens=floor)
        mask = select_token_mask(q, keys, p, channels)
        label = label_token_scores(q, keys[lo:hi], channels)
        exact = label_token_scores(q, keys[lo:hi], None)
        for h in range(hkv):
            shortlist = label[h].argsort(descending=True, stable=True)[:size]
            best = shortlist[exact[h, shortlist].argsort(descending=True, stable=True)[:n_sel]]
            expected = torch.zeros(hi - lo, dtype=torch.bool)
            expected[best] = True
            assert torch.equal(mask[h, lo:hi], expected), (rerank, floor, h)
    whole = dataclasses.replace(plain, rerank=(hi - lo) // n_sel + 1)
    assert torch.equal(select_token_mask(q, keys, whole, channels),
                       select_token_mask(q, keys, plain, None))  # no channels: exact scores
    assert not torch.equal(select_token_mask(q, keys, dataclasses.replace(plain, rerank=4),
                                             channels),
                           select_token_mask(q, keys, plain, channels))


@pytest.mark.parametrize("bad", [1, -2])
def test_rerank_values(bad: int) -> None:
    with pytest.raises(ValueError, match="rerank"):
        SelectionParams("ds", 48, 4, 0, 4, 8, rerank=bad)
    with pytest.raises(ValueError, match="rerank"):
        SelectionParams("quest", 48, 4, 0, 4, 8, rerank=2)


def test_batched_reference_reranks_per_row() -> None:
    """``BatchedSparseDecode`` reranks the rows that ask for it (two_level and ds) beside rows
    that do not, each row as ``sparse_decode`` alone."""
    hq, hkv = 6, 2
    gen = _gen("batched-rerank")
    lengths = [300, 263, 199, 280, 70]  # the last one's middle is within its shortlist
    keys = [_randn(gen, n, hkv, D) * 3 for n in lengths]
    values = [_randn(gen, n, hkv, DV) for n in lengths]
    pool_k, pool_v = torch.cat(keys), torch.cat(values)
    rows = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    start = 0
    for i, n in enumerate(lengths):
        rows[i, :n] = torch.arange(start, start + n)
        start += n
    channels = _random_channels(gen, hkv)
    q = _randn(gen, len(lengths), hq, D)
    two = SelectionParams("two_level", 48, 8, 10, 4, 8, block_score="label_max")
    params = [dataclasses.replace(two, rerank=2), two, SelectionParams("ds", 48, 8, 0, 4, 8,
                                                                       rerank=3),
              SelectionParams("ds", 48, 8, 0, 4, 8), dataclasses.replace(two, rerank=2)]
    out = BatchedSparseDecode(rows, lengths, params).decode(q, pool_k, pool_v, SM_SCALE, channels)
    for i in range(len(lengths)):
        expected = sparse_decode(q[i], keys[i], values[i], params[i], SM_SCALE, channels)
        torch.testing.assert_close(out[i], expected, rtol=1e-5, atol=1e-5)
    # a middle within the shortlist is ranked whole by the exact q.k, kept blocks or not
    short = dataclasses.replace(two, rerank=2)
    assert torch.equal(select_token_mask(q[4], keys[4], short, channels),
                       select_token_mask(q[4], keys[4], SelectionParams("ds", 48, 8, 0, 4, 8),
                                         None))
