"""Does a selection keep the needle? The share of dense attention on the answer's tokens that
each selection keeps, on the real model (CPU, float32, through transformers).

    python benchmarks/needle_recall.py --context 2048 --budget-share 16 --block-size 32

For each needle sample the prompt is prefilled densely and the first answer token decoded;
at that decode step, in every layer and query head, dense attention's probability mass on the
tokens of the answer (the pass key, the magic number) is split into what each selection
(``select_token_mask`` with its ``SelectionParams``) attends and what it drops. The recall is
kept mass / dense mass, summed over layers, heads and samples, so the heads that look at the
needle weigh the most. Unlike an answer's correctness it does not depend on the model being
able to answer, and it moves with every needle token a block filter loses.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, Optional, Sequence

import torch
from torch import Tensor
from tqdm import tqdm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.accuracy import tasks as T  # noqa: E402
from benchmarks.accuracy.runner import shrunk_sink_window  # noqa: E402
from sglang_ext.attention.qk_basis import QKBasis  # noqa: E402
from sglang_ext.config import build_config  # noqa: E402
from sglang_ext.selection import SelectionParams, select_token_mask  # noqa: E402

ATTN_NAME = "sglang_ext_needle_recall"


def answer_positions(tokenizer: Any, sample: T.Sample) -> list[int]:
    """Token positions of every occurrence of the answers inside the needles."""
    enc = tokenizer(sample.prompt, add_special_tokens=False, return_offsets_mapping=True)
    spans = []
    for offset, needle in zip(sample.needle_offsets, sample.needles):
        for answer in sample.answers:
            i = needle.find(answer)
            while i >= 0:
                spans.append((offset + i, offset + i + len(answer)))
                i = needle.find(answer, i + 1)
    return [t for t, (a, b) in enumerate(enc["offset_mapping"])
            if any(a < end and b > start for start, end in spans)]


@dataclasses.dataclass
class LabelView:
    """Selections that score with one label file: its channels (None: all) and basis, if any."""
    channels: Optional[Tensor]
    basis: Optional[QKBasis]
    settings: dict[str, SelectionParams]


class NeedleRecallAttention:
    """Dense attention everywhere (the model's outputs stay dense); at a decode step it also
    adds, per selection, the dense mass on ``positions`` that the selection keeps. Several
    label views share one pass of the model (the same samples, one prefill each)."""

    def __init__(self, views: list[LabelView]):
        self.views = views
        self.positions: Optional[Tensor] = None
        self.kept = {name: 0.0 for view in views for name in view.settings}
        self.total = 0.0

    def __call__(self, module: Any, query: Tensor, key: Tensor, value: Tensor,
                 attention_mask: Optional[Tensor], scaling: Optional[float] = None,
                 dropout: float = 0.0, **kwargs: Any):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                     scaling=scaling, **kwargs)
        if query.shape[2] == 1 and self.positions is not None:
            q = query[0, :, 0]  # [Hq, D]
            keys = key[0].transpose(0, 1)  # [L, Hkv, D]
            hq, hkv = q.shape[0], keys.shape[1]
            group = hq // hkv
            probs = torch.softmax(
                torch.einsum("hd,lhd->hl", q.float(), keys.float().repeat_interleave(group, 1))
                * scaling, dim=-1)  # [Hq, L]
            needle = probs[:, self.positions]  # [Hq, n]
            self.total += float(needle.sum())
            for view in self.views:
                channels = None if view.channels is None else view.channels[module.layer_idx]
                vq, vkeys = q, keys
                if view.basis is not None:  # the dense mass above is the same in the basis
                    vq, vkeys = view.basis.rotate(module.layer_idx, q[None], keys)
                    vq = vq[0]
                for name, params in view.settings.items():
                    mask = select_token_mask(vq, vkeys, params, channels)  # [Hkv, L]
                    kept = mask.repeat_interleave(group, 0)[:, self.positions]
                    self.kept[name] += float((needle * kept).sum())
        return out


def recommended_params(context: int, budget_share: int, block_size: int,
                       block_score: str = "auto", candidate_scale: float = 1.0,
                       rerank: int = 0, prefilter: int = 0,
                       rerank_min_tokens: Optional[int] = None) -> SelectionParams:
    """two_level as a server with these flags selects it (sink and window shrunk for small
    budgets as in the accuracy suite); ``candidate_scale`` times the automatic filter;
    ``rerank_min_tokens`` None: the server's default floor."""
    budget = context // budget_share
    sink, window = shrunk_sink_window(budget)
    floor = {} if rerank_min_tokens is None else {"rerank_min_tokens": rerank_min_tokens}
    cfg = build_config(budget=budget, block_size=block_size, sink=sink, window=window,
                       block_score=block_score, rerank=rerank, prefilter=prefilter, **floor)
    return SelectionParams("two_level", cfg.budget, cfg.block_size,
                           max(1, round(candidate_scale * cfg.effective_candidate_blocks)),
                           cfg.sink, cfg.window, block_score=cfg.effective_block_score,
                           rerank=cfg.rerank, prefilter=cfg.prefilter,
                           rerank_min_tokens=cfg.rerank_min_tokens)


@torch.inference_mode()
def needle_recall(model_dir: str, settings: dict[str, SelectionParams], tasks: Sequence[str],
                  context: int, samples: int, label_channels: int = 16,
                  progress: bool = True, label_config: Optional[str] = None,
                  more_labels: Optional[dict[str, dict[str, SelectionParams]]] = None,
                  ) -> dict[str, float]:
    """Recall of each setting over the samples (1.0 = every needle token's mass kept).
    ``label_config``: the label file (default: the model's ``sparse_labels.json``); one with a
    label basis (``calibrate --basis``) has the selections score rotated queries and keys.
    ``more_labels``: other label files, each with its own settings (names unique over all),
    measured in the same pass over the same samples."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    from sglang_ext.selection.calibrate import load_label_basis, load_label_config

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    shape = dict(num_layers=cfg["num_hidden_layers"], num_kv_heads=cfg["num_key_value_heads"],
                 head_dim=cfg["head_dim"])

    def view(path: str, view_settings: dict[str, SelectionParams]) -> LabelView:
        basis = load_label_basis(path, **shape)
        return LabelView(load_label_config(path, **shape)[..., :label_channels],
                         None if basis is None else QKBasis(*basis, "cpu"), view_settings)

    views = [view(label_config or os.path.join(model_dir, "sparse_labels.json"), settings)]
    views += [view(path, more) for path, more in (more_labels or {}).items()]
    names = [name for v in views for name in v.settings]
    if len(set(names)) != len(names):
        raise ValueError(f"setting names repeat across label files: {names}")
    hook = NeedleRecallAttention(views)
    AttentionInterface.register(ATTN_NAME, hook)
    tokenizer = T.load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation=ATTN_NAME).eval()
    from transformers import DynamicCache

    for sample in tqdm(T.make_samples(list(tasks), [context], samples, tokenizer),
                       desc="needle recall", disable=not progress):
        ids = tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
        cache = DynamicCache()
        hook.positions = None
        out = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
        hook.positions = torch.tensor(answer_positions(tokenizer, sample))
        model(input_ids=out.logits[:, -1].argmax(-1, keepdim=True), past_key_values=cache,
              use_cache=True)
    return {name: kept / max(hook.total, 1e-30) for name, kept in hook.kept.items()}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default=os.environ.get("SGLANG_EXT_MODEL_DIR",
                                                         os.path.join(REPO, ".models", "smollm2")))
    p.add_argument("--tasks", nargs="+", default=["passkey", "niah_number"])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--budget-share", type=int, default=16, help="budget = context / this")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--label-config", default=None,
                   help="a label file (default: MODEL_DIR/sparse_labels.json); with a basis "
                        "(calibrate --basis kpca) the selections score in it")
    args = p.parse_args(argv)
    two_level = recommended_params(args.context, args.budget_share, args.block_size)
    settings = {
        "ds": dataclasses.replace(two_level, method="ds", block_score="bound"),
        "label_max": two_level,
        "label_max_x4": recommended_params(args.context, args.budget_share, args.block_size,
                                           candidate_scale=4),
        "bound": recommended_params(args.context, args.budget_share, args.block_size, "bound"),
        "bound_x4": recommended_params(args.context, args.budget_share, args.block_size,
                                       "bound", candidate_scale=4),
        "label_max_rerank4": recommended_params(args.context, args.budget_share,
                                                args.block_size, rerank=4),
        # without the shortlist's floor (--sparse-rerank-min-tokens 0): only small budgets differ
        "label_max_rerank4_no_floor": recommended_params(args.context, args.budget_share,
                                                         args.block_size, rerank=4,
                                                         rerank_min_tokens=0),
        "ds_rerank4": dataclasses.replace(two_level, method="ds", block_score="bound", rerank=4),
        # the block filter's cascade (--sparse-block-prefilter 4)
        "label_max_prefilter4": recommended_params(args.context, args.budget_share,
                                                   args.block_size, prefilter=4),
        "label_max_prefilter4_rerank4": recommended_params(args.context, args.budget_share,
                                                           args.block_size, rerank=4,
                                                           prefilter=4),
    }
    recall = needle_recall(args.model_dir, settings, args.tasks, args.context, args.samples,
                           label_config=args.label_config)
    for name, value in recall.items():
        print(f"{name:18s} {value:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
