"""Label bases: a change of basis of each kv head's query/key space in which r coordinates carry
q·k best (``calibrate --basis``; the server applies one at its entry, attention/qk_basis.py; the
research harness ``benchmarks/block_filter_study.py`` compares them with channels).

Double Sparsity scores a token by r of the D channels of q·k (``calibrate.py`` picks them). A
basis change ``q' = q Bq``, ``k' = k Bk`` with ``Bq Bkᵀ = I`` leaves every q·k unchanged
(``q' · k' = q Bq Bkᵀ kᵀ``), so attention over (q', k') is attention over (q, k); what changes is
how much of q·k the first r coordinates hold. Two bases, from the second moments of post-RoPE
queries and keys on calibration text (``Σq`` pooled over each kv head's query heads, ``Σk``):

* ``kpca``: the keys' principal directions (uncentered; Loki's choice): ``Bq = Bk = V``,
  orthonormal, in order of the keys' energy.
* ``qk``: the rank-r bilinear form closest to q·k in mean square when q and k are drawn
  independently from those moments. With ``Σq^½ Σk^½ = U S Vᵀ``: ``Bq = Σq^-½ U S^½`` and
  ``Bk = Σk^-½ V S^½``; the first r columns of each are the best rank-r pair.

Both cost the same per token as channels do: r stored values and r products.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

BASES = ("kpca", "qk")
# Tikhonov term (relative to the mean eigenvalue) that keeps the whitening finite on a
# direction the calibration text never excites.
_RIDGE = 1e-6
# NOSA's eviction heads are trained on keys in the model's own basis.
EVICTION_HEAD_CONFLICT = ("--sparse-eviction-head scores keys in the model's own basis; it does "
                          "not combine with a --sparse-label-config that has a basis")


@dataclass
class QKMoments:
    """Running second moments of post-RoPE queries and keys per (layer, kv head): a
    ``capture_post_rope_qk`` callback (``q`` ``[B, Hq, T, D]``, ``k`` ``[B, Hkv, T, D]``)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    sq: Tensor = field(init=False)
    sk: Tensor = field(init=False)
    windows: Tensor = field(init=False)

    def __post_init__(self) -> None:
        shape = (self.num_layers, self.num_kv_heads, self.head_dim, self.head_dim)
        self.sq = torch.zeros(shape, dtype=torch.float64)
        self.sk = torch.zeros(shape, dtype=torch.float64)
        self.windows = torch.zeros(self.num_layers, dtype=torch.long)

    def __call__(self, layer: int, q: Tensor, k: Tensor) -> None:
        hkv, d = self.num_kv_heads, self.head_dim
        # [B, Hq, T, D] -> [Hkv, B * G * T, D]: a kv head's group of query heads pooled
        qg = q.double().transpose(0, 1).reshape(hkv, -1, d)
        kk = k.double().transpose(0, 1).reshape(hkv, -1, d)
        self.sq[layer] += torch.einsum("hnd,hne->hde", qg, qg) / qg.shape[1]
        self.sk[layer] += torch.einsum("hnd,hne->hde", kk, kk) / kk.shape[1]
        self.windows[layer] += 1

    def means(self) -> tuple[Tensor, Tensor]:
        if not bool((self.windows > 0).all()):
            raise ValueError("a layer saw no calibration window")
        scale = self.windows.double()[:, None, None, None]
        return self.sq / scale, self.sk / scale


def _symmetric_powers(m: Tensor) -> tuple[Tensor, Tensor]:
    """(m^½, m^-½) of symmetric positive semi-definite matrices ``[..., D, D]``."""
    d = m.shape[-1]
    ridge = _RIDGE * m.diagonal(dim1=-2, dim2=-1).mean(-1).clamp(min=1e-30)
    w, v = torch.linalg.eigh(m + ridge[..., None, None] * torch.eye(d, dtype=m.dtype))
    w = w.clamp(min=1e-30)
    vt = v.transpose(-1, -2)
    return (v * w.sqrt()[..., None, :]) @ vt, (v * w.rsqrt()[..., None, :]) @ vt


def label_basis(sq: Tensor, sk: Tensor, kind: str) -> tuple[Tensor, Tensor]:
    """``(Bq, Bk)`` ``[..., D, D]`` float32 with ``Bq Bkᵀ = I`` (see the module docstring), from
    the queries' and keys' second moments ``[..., D, D]``; columns in order of importance."""
    if kind not in BASES:
        raise ValueError(f"label basis must be one of {BASES}, got {kind!r}")
    sq, sk = sq.double(), sk.double()
    if kind == "kpca":
        _, v = torch.linalg.eigh(sk)
        v = v.flip(-1)  # descending energy
        return v.float(), v.float()
    q_half, q_inv_half = _symmetric_powers(sq)
    k_half, k_inv_half = _symmetric_powers(sk)
    u, s, vh = torch.linalg.svd(q_half @ k_half)
    root = s.sqrt()[..., None, :]
    bq = q_inv_half @ (u * root)
    bk = k_inv_half @ (vh.transpose(-1, -2) * root)
    return bq.float(), bk.float()


def truncated_scores(q: Tensor, keys: Tensor, bq: Tensor, bk: Tensor, r: int) -> Tensor:
    """One layer's label scores in a basis: ``[Hkv, L]``, max over each kv head's query heads of
    the first ``r`` coordinates' share of q·k. ``q`` ``[Hq, D]``, ``keys`` ``[L, Hkv, D]``,
    ``bq`` / ``bk`` ``[Hkv, D, D]``."""
    hkv, d = keys.shape[1], keys.shape[2]
    qg = q.float().reshape(hkv, -1, d)  # [Hkv, G, D]
    k = keys.float().transpose(0, 1)  # [Hkv, L, D]
    q_r = torch.bmm(qg, bq[..., :r])
    k_r = torch.bmm(k, bk[..., :r])
    return torch.bmm(q_r, k_r.transpose(1, 2)).amax(1)
