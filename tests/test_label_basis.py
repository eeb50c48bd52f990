"""Label bases (sglang_ext/selection/label_basis.py): a change of basis that leaves q·k unchanged,
in which the first r coordinates approximate q·k; checked on synthetic queries and keys whose
energy lies in a few directions that are not channels."""

from __future__ import annotations

import pytest
import torch

from sglang_ext.selection.label_basis import (
    BASES,
    QKMoments,
    label_basis,
    truncated_scores,
)
from sglang_ext.selection.reference import label_token_scores

D, HKV, GROUP = 16, 2, 3


def _correlated(gen: torch.Generator, n: int, mix: torch.Tensor, scales: torch.Tensor):
    """n vectors per kv head whose energy lies along ``mix``'s rows, weighted by ``scales``."""
    return (torch.randn(n, HKV, D, generator=gen, dtype=torch.float64) * scales) @ mix


def _setup(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    mix, _ = torch.linalg.qr(torch.randn(D, D, generator=gen, dtype=torch.float64))
    scales = torch.logspace(1, -2, D, dtype=torch.float64)  # a few strong directions
    keys = _correlated(gen, 4000, mix, scales)
    queries = _correlated(gen, 4000 * GROUP, mix, scales.flip(0).sqrt() + scales)
    moments = QKMoments(1, HKV, D)
    # capture_post_rope_qk's layout: q [B, Hq, T, D], k [B, Hkv, T, D]
    q = queries.reshape(-1, GROUP, HKV, D).permute(2, 1, 0, 3).reshape(1, HKV * GROUP, -1, D)
    moments(0, q, keys.permute(1, 0, 2)[None])
    sq, sk = moments.means()
    return gen, mix, scales, keys, sq[0], sk[0]


@pytest.mark.parametrize("kind", BASES)
def test_the_basis_leaves_every_q_dot_k_unchanged(kind: str) -> None:
    gen, _, _, keys, sq, sk = _setup()
    bq, bk = label_basis(sq, sk, kind)
    assert bq.shape == bk.shape == (HKV, D, D)
    eye = torch.eye(D).expand(HKV, D, D)
    torch.testing.assert_close(bq @ bk.transpose(1, 2), eye, atol=2e-4, rtol=0)
    q = torch.randn(HKV * GROUP, D, generator=gen, dtype=torch.float64).float()
    exact = label_token_scores(q, keys[:50].float(), None)
    torch.testing.assert_close(truncated_scores(q, keys[:50], bq, bk, D), exact,
                               atol=1e-3, rtol=1e-4)


def test_kpca_is_orthonormal_in_order_of_the_keys_energy() -> None:
    _, _, _, keys, sq, sk = _setup()
    bq, bk = label_basis(sq, sk, "kpca")
    assert torch.equal(bq, bk)
    torch.testing.assert_close(bk.transpose(1, 2) @ bk, torch.eye(D).expand(HKV, D, D),
                               atol=1e-5, rtol=0)
    energy = (keys.float().transpose(0, 1) @ bk).pow(2).mean(1)  # [Hkv, D]
    assert bool((energy[:, :-1] >= energy[:, 1:] * 0.9).all())


@pytest.mark.parametrize("kind", BASES)
def test_r_coordinates_of_a_basis_rank_better_than_r_channels(kind: str) -> None:
    """Energy along rotated directions: the best r channels (by the calibration's own
    measure) keep less of q·k's ranking than r coordinates of either basis."""
    gen, _, _, keys, sq, sk = _setup(1)
    r = 3
    bq, bk = label_basis(sq, sk, kind)
    q = _correlated(gen, 40 * GROUP, *_setup(1)[1:3]).reshape(40, HKV * GROUP, D).float()
    channel_mass = (sq.diagonal(dim1=-2, dim2=-1) * sk.diagonal(dim1=-2, dim2=-1))
    channels = channel_mass.topk(r, dim=-1).indices
    keys = keys[:400].float()

    def overlap(scores: torch.Tensor, exact: torch.Tensor, k: int = 20) -> float:
        top = scores.topk(k, dim=1).indices
        want = exact.topk(k, dim=1).indices
        return sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(top, want)) / want.numel()

    by_channels = by_basis = 0.0
    for qi in q:
        exact = label_token_scores(qi, keys, None)
        by_channels += overlap(label_token_scores(qi, keys, channels), exact)
        by_basis += overlap(truncated_scores(qi, keys, bq, bk, r), exact)
    assert by_basis > by_channels + 0.1 * len(q), (by_basis / len(q), by_channels / len(q))


def test_an_unknown_basis_is_refused() -> None:
    with pytest.raises(ValueError, match="label basis must be one of"):
        label_basis(torch.eye(D), torch.eye(D), "pca")


def test_a_layer_without_windows_is_refused() -> None:
    moments = QKMoments(2, HKV, D)
    moments(0, torch.zeros(1, HKV * GROUP, 3, D), torch.zeros(1, HKV, 3, D))
    with pytest.raises(ValueError, match="saw no calibration window"):
        moments.means()


@pytest.mark.parametrize("kind", BASES)
def test_the_backend_rotation_keeps_attention(kind: str) -> None:
    """attention/qk_basis.py at the backend's entry: q as SGLang hands it (``[T, Hq * D]``), k
    ``[T, Hkv, D]``; attention over the rotated pair equals attention over the original."""
    from sglang_ext.attention.qk_basis import QKBasis

    gen, _, _, keys, sq, sk = _setup(2)
    bq, bk = label_basis(sq, sk, kind)
    layers = 2
    basis = QKBasis(torch.stack([bq] * layers), torch.stack([bk] * layers), "cpu")
    q = torch.randn(5, HKV * GROUP * D, generator=gen, dtype=torch.float64).float()
    k, v = keys[:40].float(), torch.randn(40, HKV, D, generator=gen)
    q2, k2 = basis.rotate(1, q, k)
    assert q2.shape == q.shape and k2.shape == k.shape and q2.dtype == q.dtype
    # the KV pool views k flat (k.view(-1, row)): a strided result fails there
    assert q2.is_contiguous() and k2.is_contiguous()
    k2.view(k2.shape[0], -1)

    def attend(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        qg = q.reshape(5, HKV, GROUP, D)
        logits = torch.einsum("thgd,shd->thgs", qg, k) / D ** 0.5
        return torch.einsum("thgs,shd->thgd", logits.softmax(-1), v)

    torch.testing.assert_close(attend(q2, k2), attend(q, k), atol=1e-4, rtol=1e-4)
    q3, none = basis.rotate(0, q.reshape(5, HKV * GROUP, D).bfloat16(), None)
    assert none is None and q3.dtype == torch.bfloat16 and q3.shape == (5, HKV * GROUP, D)
    assert q3.is_contiguous()
