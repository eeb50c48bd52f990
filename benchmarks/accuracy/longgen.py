"""Long-generation fidelity: how far sparse decoding drifts from dense over many decoded tokens.

1. The model (SmolLM2-135M, float32 on the CPU, Hugging Face's Llama code) reads a prompt — a
   window of the standard library's docstrings and a request to explain it at length — and
   generates ``--tokens`` tokens with full attention, sampled at ``--temperature`` (a seeded
   generator; end-of-sequence suppressed, so the text has the asked length). Greedy text from a
   model this small soon loops on itself (>90 % repeated 4-grams over 1k tokens), which would
   make the re-reading trivially easy; sampled text does not. This is the reference text; dense
   also records, at each position, its log-likelihood of the text's next token and its greedy
   (top-1) prediction.
2. **Teacher-forced**: each (method, budget[, guard]) re-reads that same text one decode step at
   a time (the prompt is prefilled densely, as the server does) and we record, per window of
   ``--window`` positions, the mean log-likelihood gap to dense (``nll_gap``, nats per token,
   > 0 = worse) and the share of positions where its top-1 prediction equals dense's
   (``top1_agree``).
3. **Free-running**: dense and each setting generate ``--tokens`` tokens greedily from the
   prompt; we record the first position where a setting departs from dense's text and its
   repetition rate (share of repeated 4-grams), next to dense's.

Decode steps attend through :mod:`sglang_ext.selection` (the server's reference decode): the
same selection functions and, with ``--guard-every``, the same guard
(:class:`~sglang_ext.selection.guard.RequestGuard`), registered as a Hugging Face attention
function. Output: ``benchmarks/results/accuracy/longgen_smollm2.json`` (rows ``method``, ``budget``,
``guard``, ``position``, ``nll_gap``, ``top1_agree``; ``summary`` rows with the drift onset,
divergence and repetition) and a plot beside it.

    .venv/bin/python -m benchmarks.accuracy.longgen --quick      # ~1 min, make test runs it
    .venv/bin/python -m benchmarks.accuracy.longgen              # 1,024 tokens, the full grid
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from benchmarks.results_io import git_commit, write_results
from sglang_ext.selection import SelectionParams, select_token_mask, sparse_attention
from sglang_ext.selection.guard import GuardPolicy, RequestGuard, selection_recall

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_MODEL = os.path.join(REPO, ".models", "smollm2")
DEFAULT_OUT = os.path.join(REPO, "benchmarks", "results", "accuracy", "longgen_smollm2.json")
ATTN_NAME = "sglang_ext_longgen"
DENSE = "dense"


@dataclass(frozen=True)
class Setting:
    method: str
    budget: int
    guard: bool

    @property
    def label(self) -> str:
        return DENSE if self.method == DENSE else \
            f"{self.method}@{self.budget}" + ("+guard" if self.guard else "")


class Entry:
    """One sequence of a batch: its selection params (None: dense) and guard."""

    def __init__(self, params: Optional[SelectionParams], policy: Optional[GuardPolicy],
                 num_kv_heads: int) -> None:
        self.params = params
        self.guard = None if policy is None or params is None else \
            RequestGuard(policy, params, num_kv_heads)
        self.step_params: Optional[SelectionParams] = None
        self.guard_events: list[tuple[int, float, int, int]] = []  # (step, recall, old, new)


class DecodeAttention:
    """The model's attention: dense SDPA for the prompt (several query tokens); at decode steps
    (one query token per sequence) each sequence of the batch attends to the tokens its
    :class:`Entry` selects, with its guard when set. Sequences of one batch share the weights'
    reads (the CPU's bottleneck for this model) and nothing else."""

    def __init__(self, num_layers: int, channels: Optional[torch.Tensor]) -> None:
        self.num_layers = num_layers
        self.channels = channels  # [layers, Hkv, r] or None
        self.entries: list[Entry] = []
        self.step = 0

    def reset(self, entries: list[Entry]) -> None:
        self.entries = entries
        self.step = 0

    def __call__(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                 dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
        if query.shape[2] != 1:  # the prompt: dense, causal
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            return sdpa_attention_forward(module, query, key, value, attention_mask,
                                          dropout=dropout, scaling=scaling, **kwargs)
        if query.shape[0] != len(self.entries):
            raise ValueError(f"batch {query.shape[0]} != {len(self.entries)} entries")
        layer = module.layer_idx
        channels = None if self.channels is None else self.channels[layer]
        out = query.new_empty(query.shape[0], 1, query.shape[1], value.shape[-1])
        for b, entry in enumerate(self.entries):
            q = query[b, :, 0]  # [Hq, D]
            keys = key[b].transpose(0, 1)  # [L, Hkv, D]
            values = value[b].transpose(0, 1)
            length = keys.shape[0]
            guard = entry.guard
            if layer == 0:
                entry.step_params = guard.begin_step(length) if guard else entry.params
            params = entry.step_params
            if params is None or length <= params.budget:
                mask = torch.ones(keys.shape[1], length, dtype=torch.bool)
            else:
                mask = select_token_mask(q, keys, params, channels)
            out[b, 0] = sparse_attention(q, keys, values, mask, scaling)
            if guard is not None and guard.probe_head is not None:
                guard.add_recall(selection_recall(q, keys, mask, scaling, guard.probe_head))
            if layer == self.num_layers - 1 and guard is not None:
                event = guard.finish_step()
                if event is not None:
                    entry.guard_events.append((self.step, *event))
        if layer == self.num_layers - 1:
            self.step += 1
        return out, None


def load_model(model_dir: str, label_config: Optional[str], label_channels: int):
    """(model, tokenizer, attention hook): float32 Llama with our decode attention."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from benchmarks.accuracy.tasks import load_tokenizer
    from sglang_ext.selection.calibrate import load_label_config

    hf_logging.set_verbosity_error()
    tokenizer = load_tokenizer(model_dir)
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    channels = None
    if label_config:
        channels = load_label_config(label_config, num_layers=cfg["num_hidden_layers"],
                                     num_kv_heads=cfg["num_key_value_heads"],
                                     head_dim=cfg["head_dim"])[..., :label_channels]
    hook = DecodeAttention(cfg["num_hidden_layers"], channels)
    AttentionInterface.register(ATTN_NAME, hook)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation=ATTN_NAME)
    model.eval()
    return model, tokenizer, hook


def build_prompt(tokenizer: Any, prompt_tokens: int, seed: int) -> list[int]:
    """Chat prompt: a window of ~``prompt_tokens`` tokens of docstrings, then a request to
    continue it at length."""
    from benchmarks.accuracy.tasks import Corpus, chat_frame

    corpus = Corpus(tokenizer)
    start = corpus.line_start(random.Random(seed), prompt_tokens)
    body = corpus.window(start, prompt_tokens)
    head, tail = chat_frame(
        tokenizer, "Here is part of a Python library's documentation:\n\n", "\n\nWrite a long, "
        "detailed explanation of what this code does, with examples.", "")
    return tokenizer(head + body + tail, add_special_tokens=False)["input_ids"]


@torch.inference_mode()
def decode(model: Any, hook: DecodeAttention, entries: list[Entry], prompt: list[int],
           num_tokens: int, eos: Sequence[int], forced: Optional[Sequence[int]] = None,
           progress: Any = None, temperature: float = 0.0,
           generator: Optional[torch.Generator] = None,
           share_prefill: bool = False) -> list[dict[str, list]]:
    """One sequence per entry: prefill ``prompt``, then ``num_tokens`` decode steps feeding
    ``forced`` tokens (teacher forcing) or each sequence's own next token (free running: greedy,
    or sampled at ``temperature`` > 0 from ``generator``; EOS never chosen). Per entry:
    ``tokens`` (fed), ``pred`` (greedy prediction at each step) and ``logp`` (log-likelihood of
    the fed token). ``share_prefill``: prefill the prompt once and repeat its cache for every
    entry (the prompt is dense for all of them) instead of prefilling a batch of copies."""
    from transformers import DynamicCache

    batch = len(entries)
    hook.reset(entries)
    cache = DynamicCache()
    if share_prefill:
        out = model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        cache.batch_repeat_interleave(batch)
        out.logits = out.logits[:, -1:].repeat(batch, 1, 1)
    else:
        out = model(input_ids=torch.tensor([prompt] * batch), past_key_values=cache,
                    use_cache=True)
    runs: list[dict[str, list]] = [{"tokens": [], "pred": [], "logp": []} for _ in entries]
    for t in range(num_tokens):
        logits = out.logits[:, -1].float()
        logits[:, list(eos)] = float("-inf")
        logp = torch.log_softmax(logits, dim=-1)
        pred = logp.argmax(dim=-1)
        if forced is not None:
            tok = torch.full_like(pred, int(forced[t]))
        elif temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            tok = torch.multinomial(probs, 1, generator=generator)[:, 0]
        else:
            tok = pred
        picked = logp.gather(1, tok[:, None])[:, 0]
        for b, run in enumerate(runs):
            run["tokens"].append(int(tok[b]))
            run["pred"].append(int(pred[b]))
            run["logp"].append(float(picked[b]))
        if t + 1 < num_tokens:
            out = model(input_ids=tok[:, None], past_key_values=cache, use_cache=True)
        if progress is not None:
            progress.update(1)
    return runs


def repetition_rate(tokens: Sequence[int], n: int = 4) -> float:
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return 0.0 if not grams else 1.0 - len(set(grams)) / len(grams)


def first_divergence(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


def window_rows(setting: Setting, run: dict, dense: dict, window: int) -> list[dict]:
    rows = []
    for start in range(0, len(dense["tokens"]), window):
        sl = slice(start, start + window)
        gaps = [d - s for d, s in zip(dense["logp"][sl], run["logp"][sl])]
        agree = [p == t for p, t in zip(run["pred"][sl], dense["pred"][sl])]
        rows.append({"method": setting.method, "budget": setting.budget,
                     "guard": "on" if setting.guard else "off", "position": start,
                     "nll_gap": sum(gaps) / len(gaps), "top1_agree": sum(agree) / len(agree)})
    return rows


def drift_onset(rows: Sequence[dict], max_gap: float, min_agree: float) -> Optional[int]:
    """The first window position where the gap exceeds ``max_gap`` or the agreement falls under
    ``min_agree`` (None: no drift)."""
    for r in rows:
        if r["nll_gap"] > max_gap or r["top1_agree"] < min_agree:
            return r["position"]
    return None


def settings_grid(methods: Sequence[str], budgets: Sequence[int], guard_every: int,
                  guard_methods: Sequence[str]) -> list[Setting]:
    out = [Setting(m, b, False) for m in methods for b in budgets]
    if guard_every > 0:
        out += [Setting(m, b, True) for m in guard_methods for b in budgets]
    return out


def selection_params(setting: Setting, block_size: int, sink: int, window: int) -> SelectionParams:
    """What the accuracy suite sends for this setting (sink and window shrunk for small budgets),
    resolved as the server resolves a request's settings (automatic candidate blocks)."""
    from benchmarks.accuracy.runner import shrunk_sink_window
    from sglang_ext.attention.request_overrides import selection_params as resolve
    from sglang_ext.config import build_config

    s, w = shrunk_sink_window(setting.budget, sink, window)
    return resolve(build_config(method=setting.method, budget=setting.budget,
                                block_size=block_size, sink=s, window=w))


def render_plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    series: dict[str, list[dict]] = {}
    for r in doc["rows"]:
        label = f"{r['method']}@{r['budget']}" + ("+guard" if r["guard"] == "on" else "")
        series.setdefault(label, []).append(r)
    # one colour family per method, darker for larger budgets; the guard dashed
    families = {"quest": plt.cm.Blues, "ds": plt.cm.Greens, "two_level": plt.cm.Oranges}
    budgets = sorted({r["budget"] for r in doc["rows"]})
    for label, rows in sorted(series.items()):
        xs = [r["position"] for r in rows]
        style = "--" if label.endswith("+guard") else "-"
        cmap = families.get(rows[0]["method"], plt.cm.Greys)
        shade = 0.45 + 0.5 * budgets.index(rows[0]["budget"]) / max(1, len(budgets) - 1)
        color = plt.cm.Purples(shade) if rows[0]["guard"] == "on" else cmap(shade)
        for ax, key in ((axes[0], "nll_gap"), (axes[1], "top1_agree")):
            ax.plot(xs, [r[key] for r in rows], style, marker=".", color=color, label=label)
    axes[0].set_ylabel("NLL gap to dense (nats/token)")
    axes[1].set_ylabel("top-1 agreement with dense")
    for ax in axes:
        ax.set_xlabel("generated position (window start)")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, ncol=2)
    cfg = doc["config"]
    fig.suptitle(f"SmolLM2-135M long generation, {cfg['tokens']} tokens after a "
                 f"{cfg['prompt_tokens']}-token prompt, teacher-forced (commit "
                 f"{str(doc.get('commit'))[:10]})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="small run for make test: 96 tokens, two_level@32 with and without the "
                         "guard, and a budget above the context (must equal dense exactly)")
    ap.add_argument("--model-path", default=DEFAULT_MODEL)
    ap.add_argument("--label-config", default=None,
                    help="label channels (default: the model dir's sparse_labels.json if present)")
    ap.add_argument("--label-channels", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens generated (N)")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="docstring tokens in the prompt")
    ap.add_argument("--methods", nargs="+", default=["quest", "ds", "two_level"])
    ap.add_argument("--budgets", nargs="+", type=int, default=[64, 128, 256])
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--sink", type=int, default=16)
    ap.add_argument("--window-tokens", type=int, default=64, help="recent window of the selection")
    ap.add_argument("--guard-every", type=int, default=8, help="guard rows probe this often (0: none)")
    ap.add_argument("--guard-recall", type=float, default=0.9)
    ap.add_argument("--guard-max-factor", type=int, default=4, help="guard max budget = factor x budget")
    ap.add_argument("--guard-methods", nargs="+", default=["two_level"])
    ap.add_argument("--window", type=int, default=64, help="positions per reported window")
    ap.add_argument("--drift-gap", type=float, default=0.1,
                    help="drift onset: first window with an NLL gap above this (nats/token)")
    ap.add_argument("--drift-agree", type=float, default=0.9,
                    help="... or a top-1 agreement below this")
    ap.add_argument("--free-running", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--temperature", type=float, default=0.8,
                    help="sampling temperature of the reference text (0: greedy)")
    ap.add_argument("--seed", type=int, default=0, help="prompt window and sampling seed")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.prompt_tokens, args.window = 96, 160, 32
        args.methods, args.budgets, args.guard_methods = ["two_level"], [32], ["two_level"]
        args.guard_every = 4
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tokens < 1 or args.window < 1:
        ap.error("--tokens and --window must be >= 1")
    label_config = args.label_config
    if label_config is None:
        candidate = os.path.join(args.model_path, "sparse_labels.json")
        label_config = candidate if os.path.isfile(candidate) else None

    from sglang_ext.progress import progress as progress_bar

    t0 = time.time()
    model, tokenizer, hook = load_model(args.model_path, label_config, args.label_channels)
    num_kv_heads = model.config.num_key_value_heads
    eos = sorted({t for t in (tokenizer.eos_token_id, model.config.eos_token_id) if t is not None})
    prompt = build_prompt(tokenizer, args.prompt_tokens, args.seed)
    settings = settings_grid(args.methods, args.budgets, args.guard_every, args.guard_methods)
    if args.quick:  # the identity check: a budget above the whole context is dense exactly
        settings.append(Setting("two_level", 4096, False))
    # dense text, teacher-forced batch (+ dense greedy, free-running batch)
    phases = 4 if args.free_running else 2
    bar = progress_bar(total=args.tokens * phases, desc="decode steps", unit="step",
                       enabled=sys.stderr.isatty() or bool(os.environ.get("LONGGEN_PROGRESS")))

    params = [selection_params(s, args.block_size, args.sink, args.window_tokens)
              for s in settings]

    def entries() -> list[Entry]:
        return [Entry(p, GuardPolicy(args.guard_every, args.guard_recall, s.budget,
                                     args.guard_max_factor * s.budget) if s.guard else None,
                      num_kv_heads) for s, p in zip(settings, params)]

    bar.set_postfix_str("dense text")
    dense = decode(model, hook, [Entry(None, None, num_kv_heads)], prompt, args.tokens, eos,
                   progress=bar, temperature=args.temperature,
                   generator=torch.Generator().manual_seed(args.seed))[0]
    bar.set_postfix_str("teacher-forced")
    forced_entries = entries()
    forced_runs = decode(model, hook, forced_entries, prompt, args.tokens, eos,
                         forced=dense["tokens"], progress=bar)
    free_runs: list[Optional[dict]] = [None] * len(settings)
    dense_free: Optional[dict] = None
    if args.free_running:
        bar.set_postfix_str("dense greedy")
        dense_free = decode(model, hook, [Entry(None, None, num_kv_heads)], prompt, args.tokens,
                            eos, progress=bar)[0]
        bar.set_postfix_str("free-running")
        free_runs = decode(model, hook, entries(), prompt, args.tokens, eos, progress=bar)
    bar.close()

    rows: list[dict] = []
    summary: list[dict] = []
    dense_rep = repetition_rate(dense_free["tokens"]) if dense_free else None
    for s, p, seq, forced, free in zip(settings, params, forced_entries, forced_runs,
                                       free_runs):
        events = seq.guard_events
        final_budget = seq.guard.budget if seq.guard else s.budget
        srows = window_rows(s, forced, dense, args.window)
        rows += srows
        line = {
            "method": s.method, "budget": s.budget, "guard": "on" if s.guard else "off",
            "sink": p.sink, "window": p.window,
            "mean_nll_gap": sum(r["nll_gap"] for r in srows) / len(srows),
            "mean_top1_agree": sum(r["top1_agree"] for r in srows) / len(srows),
            "drift_onset": drift_onset(srows, args.drift_gap, args.drift_agree),
            "guard_probes": len(events), "guard_raises": sum(1 for e in events if e[3] > e[2]),
            "guard_lowers": sum(1 for e in events if e[3] < e[2]),
            "guard_final_budget": final_budget,
        }
        if free is not None:
            line["first_divergence"] = first_divergence(free["tokens"], dense_free["tokens"])
            line["repetition_rate"] = repetition_rate(free["tokens"])
            line["dense_repetition_rate"] = dense_rep
        summary.append(line)

    doc_meta = {
        "commit": git_commit(),
        "gpu": "none (CPU)",
        "model": os.path.basename(os.path.normpath(args.model_path)),
        "config": {
            "tokens": args.tokens, "prompt_tokens": len(prompt), "window": args.window,
            "block_size": args.block_size, "label_config": label_config and os.path.basename(label_config),
            "label_channels": args.label_channels, "guard_every": args.guard_every,
            "guard_recall": args.guard_recall, "guard_max_factor": args.guard_max_factor,
            "drift_gap": args.drift_gap, "drift_agree": args.drift_agree, "seed": args.seed,
            "quick": args.quick, "wall_seconds": round(time.time() - t0, 1),
            "temperature": args.temperature, "text_repetition_rate": repetition_rate(dense["tokens"]),
            "dense_greedy_repetition_rate": dense_rep,
            "dense_mean_nll": -sum(dense["logp"]) / len(dense["logp"]),
        },
        "summary": summary,
    }
    write_results(args.out, rows, doc_meta)
    plot = os.path.splitext(args.out)[0] + ".png"
    render_plot({**doc_meta, "rows": rows}, plot)
    for e in summary:
        print(f"{e['method']:>9}@{e['budget']:<5} guard {e['guard']:>3}: gap {e['mean_nll_gap']:+.4f} "
              f"agree {e['mean_top1_agree']:.3f} drift@{e['drift_onset']} "
              f"diverge@{e.get('first_divergence')} rep {e.get('repetition_rate', math.nan):.3f} "
              f"(dense {dense_rep if dense_rep is not None else math.nan:.3f}) guard {e['guard_raises']}+/{e['guard_lowers']}- "
              f"final {e['guard_final_budget']}")
    print(f"wrote {args.out} and {plot} in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
