"""Train NOSA's eviction heads (:mod:`.eviction_head`) of a frozen Llama-architecture model.

    python -m sglang_ext.selection.train_eviction --model-path .models/smollm2 \\
        --out .models/smollm2/eviction_head.safetensors [--steps N --seq-len T --device cpu|cuda --seed S]

Only the eviction heads learn; every weight of the model stays frozen. The text is local: the
Python standard library's docstrings (as the label calibration and the accuracy suite's haystack
use) or ``--text FILE``.

**Objective: layer-wise distillation toward dense attention, with the NOSA selection active.**
The frozen model runs once over the training windows; per layer we keep its post-RoPE queries
and keys and its values (what the server's KV cache holds). At a training step, for sampled
query positions ``t`` of each window and every layer, the attention of ``t`` is computed under
the server's locality-constrained two_level selection (:func:`select_token_mask_locality`, the
same function the server calls, with the heads' current scores): sink + window + the ``k_e``
query-agnostic blocks ``E_t`` + the query-aware tokens chosen from the other middle blocks with
the rest of the budget. The loss is the relative squared error of that attention's output
against the dense attention's output, averaged over query heads, positions and layers.

Why this objective: the base is frozen, so the best a selection can do is reproduce the dense
attention, and the layer's attention output is exactly what the selection changes (an LM loss
would add 30 layers of backward through the frozen model for the same signal, too slow on a
CPU). Each layer gets the dense model's own inputs (teacher forcing per layer), so the layers'
losses are independent and the forward runs once per window, not once per step.

**Differentiable form (exp-delayed).** Hard top-``k_e`` has no gradient. The block scores act
on the attention the exp-delayed way, as an additive term of the logits: every middle token not
taken by the query-aware part gets the log of a soft membership ``g_b = σ((z_b − θ) / (τ·σ_z))``
of its block ``b`` in the query-agnostic set, where ``z`` are the pooled block scores of the
eligible blocks, ``θ`` the midpoint between the ``k_e``-th and ``(k_e+1)``-th largest and
``σ_z`` their standard deviation (so only the ranking matters: shifting or scaling all scores
changes nothing). ``τ`` (``--temperature``) sets how close the gate is to the hard set. Tokens
of the sink, the window and the query-aware part weigh 1. The hard loss (the exact selection,
``g_b ∈ {0, 1}``) is reported beside the trained soft loss.

With fixed per-token scores, NOSA's rule (a block dropped from the query-agnostic set never
returns) keeps exactly the top ``k_e`` of all blocks that have entered the middle, so the closed
form used here and the server's step-by-step rule choose the same blocks.

The run is deterministic for a fixed ``--seed`` (initialisation and sampled positions); the loss
curve is printed and written beside ``--out`` (``.loss.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from sglang_ext.progress import progress as progress_bar
from sglang_ext.selection.calibrate import (
    attention_modules,
    capture_post_rope_qk,
    load_label_config,
    load_model,
    load_text,
    model_dims,
)
from sglang_ext.selection.eviction_head import EvictionHeads, save_eviction_heads
from sglang_ext.selection.locality import (
    LocalityState,
    select_token_mask_locality,
    two_stage_pool,
    update_eviction_scores,
)
from sglang_ext.selection.params import SelectionParams


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 150
    seq_len: int = 768
    windows: int = 8  # training windows of seq_len tokens (the frozen forward runs once each)
    batch: int = 2  # windows per step
    positions: int = 8  # query positions per window and step (in the window's second half)
    budget: int = 128
    block_size: int = 4
    sink: int = 16
    window: int = 32
    locality_blocks: int = 10  # k_e: half of (128 - 16 - 32) / 4 = 20 middle blocks
    lr: float = 0.02
    temperature: float = 0.25
    seed: int = 0

    def params(self) -> SelectionParams:
        middle = self.budget - self.sink - self.window
        return SelectionParams("two_level", self.budget, self.block_size,
                               max(1, 2 * -(-middle // self.block_size)), self.sink, self.window,
                               locality_blocks=self.locality_blocks, eviction_score="learned")


@dataclass
class LayerQKV:
    """One window's post-RoPE queries ``[Hq, T, D]``, keys and values ``[T, Hkv, D]`` (the KV
    cache's layout), float32."""

    q: Tensor
    k: Tensor
    v: Tensor


@torch.no_grad()  # not inference_mode: the tensors are used under autograd later
def capture_windows(model: nn.Module, windows: Sequence[Tensor], *,
                    progress: bool = True) -> list[list[LayerQKV]]:
    """Per window, per layer: what the frozen model's attention sees."""
    device = next(model.parameters()).device
    out: list[list[LayerQKV]] = []
    for ids in progress_bar(windows, desc="frozen forward", unit="window", enabled=progress):
        qk: dict[int, tuple[Tensor, Tensor]] = {}
        vs: dict[int, Tensor] = {}
        handles = []
        for attn in attention_modules(model):
            def hook(module, args, output, layer=attn.layer_idx, hd=int(attn.head_dim)):
                vs[layer] = output[0].reshape(output.shape[1], -1, hd).float()  # [T, Hkv, D]
            handles.append(attn.v_proj.register_forward_hook(hook))

        def save_qk(layer: int, q: Tensor, k: Tensor) -> None:
            qk[layer] = (q[0].float(), k[0].transpose(0, 1).float())

        try:
            with capture_post_rope_qk(model, save_qk):
                model(input_ids=ids.unsqueeze(0).to(device), use_cache=False)
        finally:
            for h in handles:
                h.remove()
        out.append([LayerQKV(qk[l][0].clone(), qk[l][1].clone(), vs[l].clone())
                    for l in range(len(qk))])
    return out


class _Fixed:
    """Token scores already computed (detached), served to select_token_mask_locality."""

    def __init__(self, token_scores: Tensor) -> None:
        self.scores = token_scores

    def token_scores(self, values: Tensor) -> Tensor:
        return self.scores[:, : values.shape[0]]


def _attend(q: Tensor, k: Tensor, v: Tensor, weight: Tensor | None, scale: float) -> Tensor:
    """Attention of one query ``[Hq, D]`` over ``k``/``v`` ``[L, Hkv, D]`` with per-token
    multiplicative weights ``[Hkv, L]`` (``exp(logit + log w)``: the exp-delayed bias; 0 drops a
    token): ``[Hq, D]``."""
    hkv = k.shape[1]
    qg = q.reshape(hkv, -1, q.shape[-1])  # [Hkv, G, D]
    logits = torch.einsum("hgd,lhd->hgl", qg, k) * scale
    e = torch.exp(logits - logits.amax(dim=2, keepdim=True))
    if weight is not None:
        e = e * weight[:, None, :]
    p = e / e.sum(dim=2, keepdim=True)
    return torch.einsum("hgl,lhd->hgd", p, v).reshape(q.shape[0], -1)


def position_loss(heads: EvictionHeads, layer: int, qkv: LayerQKV, t: int, cfg: TrainConfig,
                  token_scores: Tensor, channels: Tensor | None) -> tuple[Tensor, float] | None:
    """(soft loss with gradient, hard loss) of query position ``t`` in one layer, or None when
    the context leaves no choice (every eligible block fits in ``E_t``)."""
    params = cfg.params()
    bs, length = params.block_size, t + 1
    lo, hi = params.sink, length - params.window
    first, last = lo // bs, (hi - 1) // bs
    k_e = min(params.locality_blocks, (params.budget - params.sink - params.window) // bs)
    if length <= params.budget or last - first + 1 <= k_e:
        return None
    q, keys, values = qkv.q[:, t], qkv.k[:length], qkv.v[:length]
    state = LocalityState(num_kv_heads=keys.shape[1])
    mask = select_token_mask_locality(q, keys, params, state, k_e, channels, "learned", values,
                                      _Fixed(token_scores.detach()))
    in_e = state.keep[:, first:last + 1].to(keys.device)  # hard E_t over the eligible blocks
    # Soft membership of every eligible block, from the pooled scores (with gradient).
    z = two_stage_pool(token_scores[:, first * bs:(last + 1) * bs], bs)  # [Hkv, nb]
    top = z.topk(k_e + 1, dim=1).values
    theta = 0.5 * (top[:, k_e - 1:k_e] + top[:, k_e:k_e + 1])
    spread = z.std(dim=1, keepdim=True).clamp_min(1e-6)
    gate = torch.sigmoid((z - theta) / (cfg.temperature * spread))
    block_of_pos = torch.arange(lo, hi, device=keys.device) // bs - first
    query_aware = mask[:, lo:hi] & ~in_e[:, block_of_pos]
    ones = torch.ones(keys.shape[1], length, device=keys.device)
    soft = ones.clone()
    soft[:, lo:hi] = torch.where(query_aware, 1.0, gate[:, block_of_pos])
    scale = q.shape[-1] ** -0.5
    dense = _attend(q, keys, values, None, scale)
    norm = dense.pow(2).sum(dim=1).clamp_min(1e-12)
    soft_out = _attend(q, keys, values, soft, scale)
    soft_loss = ((soft_out - dense).pow(2).sum(dim=1) / norm).mean()
    with torch.no_grad():
        hard_out = _attend(q, keys, values, mask.float(), scale)
        hard_loss = float(((hard_out - dense).pow(2).sum(dim=1) / norm).mean())
    return soft_loss, hard_loss


@torch.no_grad()
def evaluate(heads: EvictionHeads, data: list[list[LayerQKV]], cfg: TrainConfig, *,
             channels: Tensor | None = None, steps: int = 32,
             progress: bool = True) -> dict[str, dict[str, float]]:
    """Per selection, ``error``: the hard-selection error (relative squared error of the attention output vs dense, as in
    training) on ``data`` (held-out windows), decoding the last ``steps`` positions of each
    window one step at a time as the server does (the query-agnostic state carried from step to
    step): two_level alone (k_e = 0), and the locality constraint at the same budget with the
    training-free ``attention`` (decayed attention mass) and ``key_norm`` scores and with the
    trained heads; ``gamma`` / ``gamma_min``: the mean / smallest locality γ(t) (share of a
    step's attended blocks attended at the step before, mean over kv heads) over those steps."""
    params = cfg.params()
    length = data[0][0].k.shape[0]
    first = max(length - steps, cfg.budget + 1)
    kinds = (("two_level", 0, "attention"),
             ("locality_attention", cfg.locality_blocks, "attention"),
             ("locality_key_norm", cfg.locality_blocks, "key_norm"),
             ("locality_learned", cfg.locality_blocks, "learned"))
    sums = {name: 0.0 for name, _, _ in kinds}
    gammas: dict[str, list[float]] = {name: [] for name, _, _ in kinds}
    n = 0
    bar = progress_bar(total=len(data) * len(data[0]), desc="evaluate", unit="layer",
                       enabled=progress)
    for window in data:
        for layer, qkv in enumerate(window):
            bar.update(1)
            ch = None if channels is None else channels[layer]
            head = _Fixed(heads.token_scores(layer, qkv.v))
            states = {name: LocalityState(qkv.k.shape[1]) for name, _, _ in kinds}
            for t in range(first, length):
                q, keys, values = qkv.q[:, t], qkv.k[:t + 1], qkv.v[:t + 1]
                scale = q.shape[-1] ** -0.5
                dense = _attend(q, keys, values, None, scale)
                norm = dense.pow(2).sum(dim=1).clamp_min(1e-12)
                for name, k_e, kind in kinds:
                    mask = select_token_mask_locality(q, keys, params, states[name], k_e, ch,
                                                      kind, values, head)
                    if kind == "attention" and k_e:
                        update_eviction_scores(states[name], q, keys, mask, scale,
                                               params.block_size)
                    out = _attend(q, keys, values, mask.float(), scale)
                    sums[name] += float(((out - dense).pow(2).sum(dim=1) / norm).mean())
                n += 1
            for name in states:
                gammas[name] += states[name].locality
    bar.close()
    return {k: {"error": sums[k] / max(n, 1),
                "gamma": sum(gammas[k]) / max(len(gammas[k]), 1),
                "gamma_min": min(gammas[k], default=0.0)} for k in sums}


def train(heads: EvictionHeads, data: list[list[LayerQKV]], cfg: TrainConfig, *,
          channels: Tensor | None = None, progress: bool = True,
          fixed_batch: bool = False) -> list[dict[str, float]]:
    """Adam on the heads; returns the loss curve (one entry per step). ``fixed_batch``: every
    step sees the same windows and positions (the test that the loss goes down)."""
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.Adam(heads.parameters(), lr=cfg.lr)
    num_layers = len(data[0])
    length = data[0][0].k.shape[0]
    curve: list[dict[str, float]] = []
    batch = None
    bar = progress_bar(range(cfg.steps), desc="eviction heads", unit="step", enabled=progress)
    for step in bar:
        if batch is None or not fixed_batch:
            wins = torch.randperm(len(data), generator=gen)[: cfg.batch].tolist()
            lo = max(length // 2, cfg.budget + 1)
            pos = torch.randint(lo, length, (len(wins), cfg.positions), generator=gen).tolist()
            batch = list(zip(wins, pos))
        opt.zero_grad()
        soft_terms: list[Tensor] = []
        hard_terms: list[float] = []
        for w, positions in batch:
            for layer in range(num_layers):
                qkv = data[w][layer]
                scores = heads.token_scores(layer, qkv.v)  # [Hkv, T], with gradient
                ch = None if channels is None else channels[layer]
                for t in positions:
                    got = position_loss(heads, layer, qkv, t, cfg, scores, ch)
                    if got is not None:
                        soft_terms.append(got[0])
                        hard_terms.append(got[1])
        if not soft_terms:
            raise ValueError("no query position leaves a choice: lengthen --seq-len or lower "
                             "--budget / --locality-blocks")
        loss = torch.stack(soft_terms).mean()
        loss.backward()
        opt.step()
        entry = {"step": step, "soft_loss": float(loss.detach()),
                 "hard_loss": sum(hard_terms) / len(hard_terms)}
        curve.append(entry)
        bar.set_postfix(soft=f"{entry['soft_loss']:.4f}", hard=f"{entry['hard_loss']:.4f}")
    bar.close()
    return curve


def token_windows(tokenizer: Any, text: str, seq_len: int, count: int) -> list[Tensor]:
    ids = tokenizer(text, add_special_tokens=False).input_ids
    windows = [torch.tensor(ids[i:i + seq_len]) for i in range(0, len(ids) - seq_len + 1, seq_len)]
    if len(windows) < count:
        raise ValueError(f"the text gives {len(windows)} windows of {seq_len} tokens, "
                         f"{count} needed")
    return windows[:count]


def main(argv: Sequence[str] | None = None) -> int:
    d = TrainConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True, help="a Hugging Face Llama-architecture folder")
    p.add_argument("--out", required=True, help="where to write the heads (.safetensors)")
    p.add_argument("--text", default=None, help="training text (default: stdlib docstrings)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--label-config", default=None,
                   help="label channels for the query-aware token scores, as the server uses "
                        "(default: MODEL/sparse_labels.json when present, else exact q·k)")
    for name in ("steps", "seq_len", "windows", "batch", "positions", "budget", "block_size",
                 "sink", "window", "locality_blocks", "seed"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    p.add_argument("--label-channels", type=int, default=16,
                   help="label channels per kv head, as the server's --sparse-label-channels")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    cfg = TrainConfig(**{k: getattr(args, k) for k in asdict(d)})
    try:
        cfg.params()
    except ValueError as e:
        p.error(str(e))
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device visible")
    torch.manual_seed(cfg.seed)
    t0 = time.time()
    model, tokenizer = load_model(args.model_path)
    model.requires_grad_(False).to(args.device)
    dims = model_dims(model)
    # One more window than trained on: held out for the evaluation.
    text, source = load_text(args.text, max_tokens=cfg.seq_len * (cfg.windows + 1))
    windows = token_windows(tokenizer, text, cfg.seq_len, cfg.windows + 1)
    data = capture_windows(model, windows, progress=not args.no_progress)
    held_out, data = data[-1:], data[:-1]
    del model
    label_path = args.label_config
    if label_path is None and os.path.isfile(os.path.join(args.model_path, "sparse_labels.json")):
        label_path = os.path.join(args.model_path, "sparse_labels.json")
    channels = None
    if label_path is not None:
        channels = load_label_config(label_path, num_layers=dims["num_layers"],
                                     num_kv_heads=dims["num_kv_heads"], head_dim=dims["head_dim"])
        channels = channels[:, :, :args.label_channels].to(args.device)
    print(f"train_eviction: {cfg.windows} windows x {cfg.seq_len} tokens of {source}, "
          f"frozen forward {time.time() - t0:.1f}s; budget {cfg.budget}, block {cfg.block_size}, "
          f"k_e {cfg.locality_blocks}, labels {label_path or 'none (exact q·k)'}", flush=True)
    heads = EvictionHeads(dims["num_layers"], dims["num_kv_heads"], dims["head_dim"],
                          generator=torch.Generator().manual_seed(cfg.seed)).to(args.device)
    before = evaluate(heads, held_out, cfg, channels=channels, progress=not args.no_progress)
    curve = train(heads, data, cfg, channels=channels, progress=not args.no_progress)
    after = evaluate(heads, held_out, cfg, channels=channels, progress=not args.no_progress)
    seconds = time.time() - t0
    every = max(1, len(curve) // 10)
    print("step  soft_loss  hard_loss")
    for e in curve[::every] + ([curve[-1]] if (len(curve) - 1) % every else []):
        print(f"{e['step']:4d}  {e['soft_loss']:.5f}    {e['hard_loss']:.5f}")
    print(f"held-out window, {cfg.budget}-token budget, k_e {cfg.locality_blocks}, decoding its "
          f"last 32 positions: relative error of the attention output vs dense (mean over "
          f"layers, heads, steps) and locality γ (mean, min)")
    for k, v in after.items():
        print(f"  {k:18s} error {v['error']:.5f}  γ {v['gamma']:.3f} (min {v['gamma_min']:.3f})"
              + (f"  untrained heads: error {before[k]['error']:.5f}"
                 if k == "locality_learned" else ""))
    name = Path(args.model_path).resolve().name
    save_eviction_heads(heads.cpu(), args.out, model=name,
                        extra={**asdict(cfg), "text": source, "seconds": round(seconds, 1),
                               "final_soft_loss": curve[-1]["soft_loss"],
                               "final_hard_loss": curve[-1]["hard_loss"],
                               "held_out_after": after})
    loss_path = str(args.out) + ".loss.json"
    Path(loss_path).write_text(json.dumps({"config": asdict(cfg), "text": source,
                                           "model": name, "seconds": round(seconds, 1),
                                           "held_out_before": before, "held_out_after": after,
                                           "curve": curve}, indent=1) + "\n")
    print(f"train_eviction: {seconds:.0f}s -> {args.out} (loss curve {loss_path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
