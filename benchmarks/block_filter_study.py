"""Which block filter keeps the needle? Needle tasks on the real model, every variant decoded
from one shared prefill (research harness; CPU float32 through transformers).

Each sample's prompt is prefilled densely once; the cache is repeated once per variant and the
variants decode greedily side by side, each attending what its selection picks at every layer.
Scores are the suite's (``benchmarks.accuracy.tasks.score``), with Wilson intervals.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import Tensor
from tqdm import tqdm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.accuracy import tasks as T  # noqa: E402
from benchmarks.accuracy.runner import shrunk_sink_window  # noqa: E402
from benchmarks.results_io import git_commit, write_results  # noqa: E402
from sglang_ext.selection.label_basis import (  # noqa: E402
    BASES,
    QKMoments,
    label_basis,
    truncated_scores,
)
from sglang_ext.selection.reference import (  # noqa: E402
    _top_k_mask,
    label_token_scores,
    sparse_attention,
)

ATTN_NAME = "sglang_ext_block_filter_study"


@dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # dense | oracle (top-k by the exact q.k: the ceiling of token-level selection) | ds | two_level
    block_size: int = 16
    cand_scale: float = 2.0  # candidate blocks = scale x the blocks the budget's middle fills
    sub_block: int = 0  # summary granularity inside a page (0 = the page)
    summary_channels: str = "all"  # all | labels
    dense_layers: int = 0  # the first layers attend densely (as Quest and Double Sparsity do)
    page_score: str = "bound"  # bound | label_max (a page's best label score)
    rerank: float = 0.0  # > 0: labels keep rerank x the budget's tokens, the exact q.k picks
    labels: str = "channels"  # channels (Double Sparsity) | kpca | qk: a label basis


def group_queries(q: Tensor, hkv: int) -> Tensor:
    return q.float().reshape(hkv, q.shape[0] // hkv, q.shape[1])


def page_scores(q: Tensor, keys: Tensor, first: int, last: int, v: Variant,
                channels: Optional[Tensor]) -> Tensor:
    """[Hkv, pages]: each page's score = max over its sub-blocks of the Quest bound."""
    bs = v.block_size
    sub = v.sub_block or bs
    hkv = keys.shape[1]
    k = keys[first * bs:(last + 1) * bs].float()  # [L, Hkv, D]
    qg = group_queries(q, hkv)  # [Hkv, G, D]
    if v.summary_channels == "labels":
        k = k.gather(2, channels[None].expand(k.shape[0], -1, -1))
        qg = qg.gather(2, channels[:, None, :].expand(-1, qg.shape[1], -1))
    n = k.shape[0]
    pad = (-n) % sub
    kmin = torch.cat([k, k[-1:].expand(pad, -1, -1)]) if pad else k
    kmin = kmin.reshape(-1, sub, hkv, k.shape[2])
    kmax, kmin = kmin.amax(1), kmin.amin(1)  # [S, Hkv, d]
    bound = (torch.bmm(qg.clamp(min=0), kmax.permute(1, 2, 0))
             + torch.bmm(qg.clamp(max=0), kmin.permute(1, 2, 0))).amax(1)  # [Hkv, S]
    per_page = bs // sub
    s = bound.shape[1]
    pad = (-s) % per_page
    if pad:
        bound = torch.cat([bound, bound.new_full((hkv, pad), float("-inf"))], 1)
    return bound.reshape(hkv, -1, per_page).amax(2)


def select(q: Tensor, keys: Tensor, v: Variant, budget: int, sink: int, window: int,
           channels: Optional[Tensor]) -> Tensor:
    length, hkv = keys.shape[:2]
    mask = torch.ones(hkv, length, dtype=torch.bool)
    if v.kind == "dense" or length <= budget:
        return mask
    lo, hi = sink, length - window
    n_sel = budget - sink - window
    mask[:, lo:hi] = False
    token_channels = None if v.kind == "oracle" else channels
    label_scores = approx_scores(q, keys[lo:hi], token_channels)
    if v.kind in ("ds", "oracle"):
        mask[:, lo:hi] = top_tokens(q, keys[lo:hi], label_scores, n_sel, v.rerank)
        return mask
    bs = v.block_size
    first, last = lo // bs, (hi - 1) // bs
    num_cand = last - first + 1
    if v.page_score == "label_max":
        # pad the middle out to whole pages; sink and window tokens never rank a page
        by_page = torch.cat([label_scores.new_full((hkv, lo - first * bs), float("-inf")),
                             label_scores,
                             label_scores.new_full((hkv, (last + 1) * bs - hi), float("-inf"))], 1)
        pages = by_page.reshape(hkv, num_cand, bs).amax(2)
    else:
        pages = page_scores(q, keys, first, last, v, channels)
    kept = _top_k_mask(pages, min(num_cand, max(1, round(v.cand_scale * -(-n_sel // bs)))))
    in_kept = kept[:, torch.arange(lo, hi) // bs - first]
    scores = label_scores.masked_fill(~in_kept, float("-inf"))
    mask[:, lo:hi] = top_tokens(q, keys[lo:hi], scores, n_sel, v.rerank) & in_kept
    return mask


def approx_scores(q: Tensor, keys: Tensor, labels: Any) -> Tensor:
    """[Hkv, L] label scores (max over each kv head's query heads): by channels (a long
    ``[Hkv, r]`` tensor), by the first r coordinates of a label basis (``(Bq, Bk, r)``,
    :mod:`sglang_ext.selection.label_basis`), or exactly (None)."""
    if not isinstance(labels, tuple):
        return label_token_scores(q, keys, labels)
    return truncated_scores(q, keys, *labels)


def calibrate_bases(model: Any, tok: Any, tokens: int = 8192,
                    window: int = 2048) -> dict[str, tuple[Tensor, Tensor]]:
    """Every label basis (:data:`BASES`) per layer, ``(Bq, Bk)`` ``[L, Hkv, D, D]``, from the
    post-RoPE queries and keys of the label calibration's text (the stdlib docstrings) in
    windows of ``window`` tokens."""
    from sglang_ext.selection.calibrate import capture_post_rope_qk, load_text, model_dims

    dims = model_dims(model)
    moments = QKMoments(dims["num_layers"], dims["num_kv_heads"], dims["head_dim"])
    text, _ = load_text(None, max_tokens=tokens)
    ids = tok(text, add_special_tokens=False, truncation=True, max_length=tokens).input_ids
    with capture_post_rope_qk(model, moments):
        for i in tqdm(range(0, len(ids), window), desc="label bases"):
            model(input_ids=torch.tensor([ids[i:i + window]]), use_cache=False)
    sq, sk = moments.means()
    return {kind: label_basis(sq, sk, kind) for kind in BASES}


def top_tokens(q: Tensor, keys: Tensor, label_scores: Tensor, n_sel: int, rerank: float) -> Tensor:
    """The ``n_sel`` best tokens by label score, or with ``rerank`` by the exact q.k among the
    ``rerank * n_sel`` best by label score."""
    if not rerank:
        return _top_k_mask(label_scores, n_sel)
    shortlist = _top_k_mask(label_scores, min(label_scores.shape[1], round(rerank * n_sel)))
    shortlist &= label_scores > float("-inf")
    exact = label_token_scores(q, keys, None).masked_fill(~shortlist, float("-inf"))
    return _top_k_mask(exact, n_sel) & shortlist


class StudyAttention:
    def __init__(self, channels: Optional[Tensor]):
        self.channels = channels
        self.variants: list[Variant] = []
        self.bases: dict[str, tuple[Tensor, Tensor]] = {}
        self.label_channels = 0 if channels is None else channels.shape[-1]
        self.budget = self.sink = self.window = 0

    def __call__(self, module: Any, query: Tensor, key: Tensor, value: Tensor,
                 attention_mask: Optional[Tensor], scaling: Optional[float] = None,
                 dropout: float = 0.0, **kwargs: Any):
        if query.shape[2] != 1:
            from transformers.integrations.sdpa_attention import sdpa_attention_forward
            return sdpa_attention_forward(module, query, key, value, attention_mask,
                                          dropout=dropout, scaling=scaling, **kwargs)
        layer = module.layer_idx
        ch = None if self.channels is None else self.channels[layer]
        out = query.new_empty(query.shape[0], 1, query.shape[1], value.shape[-1])
        for b, v in enumerate(self.variants):
            labels = ch if v.labels == "channels" else (
                *(b[layer] for b in self.bases[v.labels]), self.label_channels)
            q = query[b, :, 0]
            keys, values = key[b].transpose(0, 1), value[b].transpose(0, 1)
            if module.layer_idx < v.dense_layers:
                mask = torch.ones(keys.shape[1], keys.shape[0], dtype=torch.bool)
            else:
                mask = select(q, keys, v, self.budget, self.sink, self.window, labels)
            out[b, 0] = sparse_attention(q, keys, values, mask, scaling)
        return out, None


def wilson(k: float, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return 0.0, 0.0
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return 100 * max(0.0, c - h), 100 * min(1.0, c + h)


def parse_variant(text: str) -> Variant:
    """dense | oracle[:dN] | ds[:dN][:rM][:kpca|:qk] |
    two_level:BS[:xSCALE][:sSUB][:labels][:lm][:rM][:dN][:kpca|:qk]

    ``lm``: pages ranked by their best label score; ``rM``: the exact q.k reranks M x the
    budget's best tokens by label score; ``kpca`` / ``qk``: label scores by the first r
    coordinates of a label basis (:mod:`sglang_ext.selection.label_basis`) instead of r
    channels."""
    parts = text.split(":")
    kw: dict = {}
    whole_context_kinds = ("dense", "oracle", "ds")
    if parts[0] in whole_context_kinds:
        rest = parts[1:]
    else:
        kw["block_size"] = int(parts[1])
        rest = parts[2:]
    for p in rest:
        if p.startswith("d"):
            kw["dense_layers"] = int(p[1:])
            continue
        if p == "lm":
            kw["page_score"] = "label_max"
        elif p.startswith("r"):
            kw["rerank"] = float(p[1:])
        elif p.startswith("x"):
            kw["cand_scale"] = float(p[1:])
        elif p.startswith("s"):
            kw["sub_block"] = int(p[1:])
        elif p == "labels":
            kw["summary_channels"] = "labels"
        elif p in ("kpca", "qk"):
            kw["labels"] = p
        else:
            raise ValueError(f"bad variant part {p!r} in {text!r}")
    return Variant(text, parts[0] if parts[0] in whole_context_kinds else "two_level", **kw)


def plot(rows: list[dict[str, Any]], path: str, title: str = "") -> None:
    """One panel per budget: each (task, context) cell's score per variant, with its Wilson
    interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = sorted({r.get("budget_share") or r["budget"] for r in rows}, reverse=True)
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    cells = sorted({(r["task"], r["context"]) for r in rows}, key=lambda c: (c[1], c[0]))
    fig, axes = plt.subplots(len(budgets), 1, figsize=(max(6, 1.2 * len(cells)), 3.2 * len(budgets)),
                             squeeze=False)
    width = 0.8 / len(variants)
    for ax, budget in zip(axes[:, 0], budgets):
        for j, name in enumerate(variants):
            got = {(r["task"], r["context"]): r for r in rows if r["variant"] == name
                   and (r.get("budget_share") or r["budget"]) == budget}
            xs = [i + (j - (len(variants) - 1) / 2) * width for i, c in enumerate(cells) if c in got]
            ys = [got[c]["score"] for c in cells if c in got]
            err = [[got[c]["score"] - got[c]["ci_low"] for c in cells if c in got],
                   [got[c]["ci_high"] - got[c]["score"] for c in cells if c in got]]
            ax.bar(xs, ys, width, yerr=err, capsize=2, label=name)
        ax.set_xticks(range(len(cells)), [f"{t}\n{c // 1024}k" for t, c in cells], fontsize=7)
        label = f"budget = context/{round(1 / budget)}" if budget < 1 else f"budget {budget}"
        ax.set_title(f"{title} {label}".strip(), fontsize=9)
        ax.set_ylabel("score (Wilson 95%)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def merge_study_files(paths: Sequence[str], out: str, draw: bool) -> None:
    """One results file from runs at other budgets (``--merge``): each row keeps its run's
    ``--budget-ratio`` as ``budget_share``, the file keeps every run's arguments."""
    docs = []
    for path in paths:
        with open(path) as f:
            docs.append(json.load(f))
    rows = [{**r, "budget_share": r.get("budget_share") or d["args"]["budget_ratio"] or None}
            for d in docs for r in d["rows"]]
    commits = sorted({d["commit"] for d in docs})
    write_results(out, rows, {"commit": commits[0] if len(commits) == 1 else commits,
                              "machine": "cpu", "model": docs[0]["model"],
                              "merged_runs": [d["args"] for d in docs]})
    if draw:
        plot(rows, os.path.splitext(out)[0] + ".png", f"{docs[0]['model']}, CPU harness,")


@torch.inference_mode()
def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model-dir", default=os.environ.get("SGLANG_EXT_MODEL_DIR", ".models/smollm2"))
    ap.add_argument("--label-config", default=None)
    ap.add_argument("--label-channels", type=int, default=16)
    ap.add_argument("--tasks", nargs="+", default=["passkey", "niah_number"])
    ap.add_argument("--contexts", nargs="+", type=int, default=[3072])
    ap.add_argument("--budget-ratio", type=float, default=0.0, help="budget = context x this")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--variants", nargs="+", default=["dense", "ds", "two_level:16", "two_level:32"])
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", action="store_true", help="also draw OUT's .png beside it")
    ap.add_argument("--merge", nargs="+", default=None, metavar="FILE",
                    help="no run: merge these results files (runs at other budgets) into --out")
    args = ap.parse_args(argv)
    if args.merge:
        if not args.out:
            ap.error("--merge needs --out")
        merge_study_files(args.merge, args.out, args.plot)
        return 0

    from transformers import AttentionInterface, AutoModelForCausalLM
    from sglang_ext.selection.calibrate import load_label_config

    with open(os.path.join(args.model_dir, "config.json")) as f:
        cfg = json.load(f)
    label_config = args.label_config or os.path.join(args.model_dir, "sparse_labels.json")
    channels = load_label_config(label_config, num_layers=cfg["num_hidden_layers"],
                                 num_kv_heads=cfg["num_key_value_heads"],
                                 head_dim=cfg["head_dim"])[..., :args.label_channels]
    hook = StudyAttention(channels)
    AttentionInterface.register(ATTN_NAME, hook)
    tok = T.load_tokenizer(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32,
                                                 attn_implementation=ATTN_NAME).eval()
    variants = [parse_variant(v) for v in args.variants]
    hook.variants = variants
    if any(v.labels != "channels" for v in variants):
        hook.bases = calibrate_bases(model, tok)
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    samples = T.make_samples(args.tasks, args.contexts, args.samples, tok)
    hits: dict = {}
    t0 = time.time()
    for s in tqdm(samples, desc="samples"):
        budget = int(s.context * args.budget_ratio) if args.budget_ratio else args.budget
        hook.budget = budget
        hook.sink, hook.window = shrunk_sink_window(budget)
        from transformers import DynamicCache
        ids = tok(s.prompt, add_special_tokens=False)["input_ids"]
        cache = DynamicCache()
        out = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
        cache.batch_repeat_interleave(len(variants))
        nxt = out.logits[:, -1].argmax(-1).repeat(len(variants))
        gen = [[int(nxt[0])] for _ in variants]
        for _ in range(s.max_new_tokens - 1):
            out = model(input_ids=nxt[:, None], past_key_values=cache, use_cache=True)
            logits = out.logits[:, -1].float()
            nxt = logits.argmax(-1)
            for b in range(len(variants)):
                gen[b].append(int(nxt[b]))
        for b, v in enumerate(variants):
            text = tok.decode([t for t in gen[b] if t not in eos])
            hits.setdefault((s.task, s.context, budget, v.name), []).append(T.score(s, text))
    rows = []
    for (task, ctx, budget, name), xs in hits.items():
        lo, hi = wilson(sum(xs), len(xs))
        rows.append({"task": task, "context": ctx, "budget": budget,
                     "budget_share": args.budget_ratio or None, "variant": name,
                     "score": 100 * sum(xs) / len(xs), "n": len(xs), "ci_low": lo, "ci_high": hi})
    for r in rows:
        print(f"{r['task']:12s} {r['context']:5d} b{r['budget']:<5d} {r['variant']:28s} "
              f"{r['score']:5.1f} [{r['ci_low']:.0f},{r['ci_high']:.0f}] n={r['n']}")
    print(f"{time.time() - t0:.0f} s")
    if args.out:
        model = os.path.basename(os.path.abspath(args.model_dir))
        write_results(args.out, rows, {"commit": git_commit(), "machine": "cpu", "model": model,
                                       "args": vars(args)})
        if args.plot:
            plot(rows, os.path.splitext(args.out)[0] + ".png", f"{model}, CPU harness,")
    return 0


if __name__ == "__main__":
    sys.exit(main())
