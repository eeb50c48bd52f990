"""NOSA's eviction head (the exp-delayed form, "ED-DMA") for a Llama-architecture model.

The query-agnostic part of the locality-constrained selection (:mod:`.locality`) keeps the
``k_e`` blocks with the largest eviction score. Here that score is *learned*: per layer and kv
head a small head maps each token's **value** vector to a score

    s = A · softplus(w · v + b)          (one ``w ∈ R^D``, ``b``, ``A`` per (layer, kv head))

and a block's score is NOSA's two-stage pooling of its tokens' scores: the mean inside
sub-blocks of 4 tokens, then the max over the block's sub-blocks
(:func:`sglang_ext.selection.locality.two_stage_pool`).

Why the value: NOSA (like DMA, whose head it adapts) computes the score from the value
projection. Values carry no rotary position, so a token's score does not depend on where it sits,
and the server has them: they are the V half of the KV cache the decode step reads anyway (the
post-RoPE keys are the other half; a key-based head would have to learn to undo RoPE's rotation).
One head per kv head (rather than NOSA's single projection of all kv heads' values) keeps the
heads independent, so under ``--tp`` each rank scores its own kv heads from its own KV shard.

Exp-delayed: DMA weights a token's attention by ``exp(s)``; at low precision the exponential
saturates and ranks ties. NOSA delays the exponential to the attention itself: selection
compares the pre-exponential scores ``s`` (pooled as above, never exponentiated), and wherever
the score acts on attention it does so as an additive term of the logits, i.e. the exponential
is taken once, inside the softmax. Our server's base model is frozen, so at inference the score
only *selects* (the attended tokens get their plain attention); during training
(:mod:`.train_eviction`) it enters the logits as the log of a soft membership gate.

The score of a token depends only on its value, so a block's score never changes once the block
exists. NOSA's rule (a block the query-agnostic part drops is never taken again) then keeps
exactly the ``k_e`` best blocks that have entered the middle so far; training uses that closed
form, the server runs the rule step by step (the same sets).

File format: safetensors with tensors ``weight`` ``[L, Hkv, D]``, ``bias`` and ``scale``
(``A``) ``[L, Hkv]`` (float32) and metadata ``format``, ``model``, ``num_layers``,
``num_kv_heads``, ``head_dim``, ``sub_block`` and the training settings.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import torch
from torch import Tensor, nn

FORMAT = "sglang_ext-eviction-head-v1"
SUB_BLOCK = 4  # NOSA's two-stage pooling: mean over sub-blocks of this many tokens, then max


class EvictionHeads(nn.Module):
    """The eviction heads of every (layer, kv head) of a model."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        # Small random directions: softplus(w·v) then differs between tokens from the start,
        # so the gradient reaches every w (A = 0, NOSA's initialisation for a logit bias, would
        # make every score 0 and every w's gradient 0 in our gate, see train_eviction).
        w = torch.randn(num_layers, num_kv_heads, head_dim, generator=generator) * head_dim ** -0.5
        self.weight = nn.Parameter(w)
        self.bias = nn.Parameter(torch.zeros(num_layers, num_kv_heads))
        self.scale = nn.Parameter(torch.ones(num_layers, num_kv_heads))  # NOSA's A

    def token_scores(self, layer: int, values: Tensor) -> Tensor:
        """Pre-exponential eviction score of each token: float32 ``[Hkv, n]`` from the layer's
        values ``[n, Hkv, D]`` (or ``[B, n, Hkv, D]`` -> ``[B, Hkv, n]``)."""
        w = self.weight[layer].to(values.device)
        logit = torch.einsum("...nhd,hd->...hn", values.float(), w)
        logit = logit + self.bias[layer].to(values.device)[:, None]
        return self.scale[layer].to(values.device)[:, None] * nn.functional.softplus(logit)

    def layer(self, layer: int) -> "LayerEvictionHead":
        return LayerEvictionHead(self, layer)

    def kv_heads(self, start: int, stop: int) -> "EvictionHeads":
        """The heads of kv heads ``[start, stop)`` (one tensor-parallel rank's)."""
        out = EvictionHeads(self.num_layers, stop - start, self.head_dim)
        with torch.no_grad():
            out.weight.copy_(self.weight[:, start:stop])
            out.bias.copy_(self.bias[:, start:stop])
            out.scale.copy_(self.scale[:, start:stop])
        return out.requires_grad_(False)


class LayerEvictionHead:
    """One layer's heads, what :func:`select_token_mask_locality` calls."""

    def __init__(self, heads: EvictionHeads, layer: int) -> None:
        self.heads, self.index = heads, layer

    def token_scores(self, values: Tensor) -> Tensor:
        return self.heads.token_scores(self.index, values)


def save_eviction_heads(heads: EvictionHeads, path: str | os.PathLike[str], *, model: str,
                        extra: Mapping[str, Any] | None = None) -> None:
    from safetensors.torch import save_file

    meta = {"format": FORMAT, "model": model, "num_layers": str(heads.num_layers),
            "num_kv_heads": str(heads.num_kv_heads), "head_dim": str(heads.head_dim),
            "sub_block": str(SUB_BLOCK)}
    if extra:
        meta["training"] = json.dumps(dict(extra), sort_keys=True)
    tensors = {"weight": heads.weight.detach().float().contiguous(),
               "bias": heads.bias.detach().float().contiguous(),
               "scale": heads.scale.detach().float().contiguous()}
    save_file(tensors, os.fspath(path), metadata=meta)


def load_eviction_heads(path: str | os.PathLike[str], *, num_layers: int, num_kv_heads: int,
                        head_dim: int) -> EvictionHeads:
    """The heads stored at ``path``, checked against the model's shape; ``ValueError`` with a
    one-line message naming the file and the mismatch otherwise."""
    from safetensors import safe_open

    where = f"eviction head {os.fspath(path)}"
    try:
        with safe_open(os.fspath(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # not a safetensors file, truncated, unreadable
        raise ValueError(f"{where} is not a readable safetensors file "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{where} has format {meta.get('format')!r}, expected {FORMAT!r}")
    want = (num_layers, num_kv_heads, head_dim)
    try:
        got = tuple(int(meta[k]) for k in ("num_layers", "num_kv_heads", "head_dim"))
    except (KeyError, ValueError):
        raise ValueError(f"{where}: metadata lacks num_layers/num_kv_heads/head_dim") from None
    if got != want:
        raise ValueError(f"{where} is for {got[0]} layers/{got[1]} kv heads/head dim {got[2]} "
                         f"({meta.get('model', '?')}), the model has {want[0]}/{want[1]}/{want[2]}")
    shapes = {"weight": want, "bias": want[:2], "scale": want[:2]}
    for name, shape in shapes.items():
        t = tensors.get(name)
        if t is None or tuple(t.shape) != shape:
            raise ValueError(f"{where}: tensor {name!r} must have shape {list(shape)}, got "
                             f"{None if t is None else list(t.shape)}")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{where}: tensor {name!r} is not finite")
    heads = EvictionHeads(*want)
    with torch.no_grad():
        for name in shapes:
            getattr(heads, name).copy_(tensors[name].float())
    return heads.requires_grad_(False)
