"""Per-head policy (Fluxion): which (layer, kv head) pairs are *streaming* heads, whose attention
the sink and the recent window already hold, and which are *retrieval* heads that need sparse
retrieval over the whole context.

Calibration runs the model (Hugging Face, float32, CPU or GPU) over a calibration text and
measures, for every kv head, the mean share of its query heads' attention mass that falls on the
first ``sink`` and the last ``window`` positions, over every query position past
``sink + window`` (earlier ones attend to nothing else). A head whose share reaches
``threshold`` is streaming. The output is a JSON policy the server loads with
``--sparse-head-policy`` (checked against the model's shape at start-up); a request opts in with
``custom_params.sparse.head_policy`` (on by default when the server has a policy). Streaming heads
do no scoring: they attend their sink and window only.

    python -m sglang_ext.selection.head_policy --model-path .models/smollm2 --out policy.json

The result depends only on the model, the text and the settings (no sampling), so calibration is
deterministic.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from sglang_ext.selection.calibrate import (
    load_model,
    load_text,
    model_dims,
    read_versioned_json,
    run_windows,
)

FORMAT = "sglang_ext-head-policy-v1"
DEFAULT_SINK, DEFAULT_WINDOW = 16, 64
DEFAULT_THRESHOLD = 0.9
DEFAULT_MAX_TOKENS = 2048


def sink_window_mass(q: Tensor, k: Tensor, sink: int, window: int) -> Tensor:
    """Per kv head, the summed (over query heads of its group and query positions past
    ``sink + window``) causal-attention mass on positions ``[0, sink)`` and the last ``window``
    positions up to the query: float64 ``[Hkv]``, and the number of (query head, position)
    pairs it sums (for the mean).

    ``q``: ``[B, Hq, T, D]``, ``k``: ``[B, Hkv, T, D]`` (post-RoPE, as the model attends)."""
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    kk = k.repeat_interleave(group, dim=1)
    logits = torch.matmul(q, kk.transpose(-1, -2)) * d ** -0.5  # [B, Hq, T, T]
    pos = torch.arange(t, device=q.device)
    causal = pos[None, :] <= pos[:, None]
    probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
    near = (pos[None, :] < sink) | (pos[None, :] > pos[:, None] - window)
    mass = (probs * (near & causal)).sum(dim=-1)  # [B, Hq, T]
    first = sink + window
    per_head = mass[:, :, first:].sum(dim=(0, 2), dtype=torch.float64)  # [Hq]
    return per_head.view(hkv, group).sum(dim=1), b * group * max(t - first, 0)


@torch.inference_mode()
def head_streaming_share(model: nn.Module, input_ids: Tensor, *, seq_len: int, sink: int,
                         window: int, progress: bool = True) -> Tensor:
    """Mean sink + window share of every (layer, kv head): float64 ``[L, Hkv]``."""
    dims = model_dims(model)
    total = torch.zeros(dims["num_layers"], dims["num_kv_heads"], dtype=torch.float64)
    count = [0] * dims["num_layers"]
    windows = [input_ids[i:i + seq_len] for i in range(0, input_ids.numel(), seq_len)]
    windows = [w for w in windows if w.numel() > sink + window]
    if not windows:
        raise ValueError(f"calibration text shorter than sink + window ({sink + window} tokens)")

    def accumulate(layer: int, q: Tensor, k: Tensor) -> None:
        mass, n = sink_window_mass(q, k, sink, window)
        total[layer] += mass
        count[layer] += n

    run_windows(model, windows, accumulate, desc="head policy", progress=progress)
    return total / torch.tensor(count, dtype=torch.float64)[:, None]


def calibrate_policy(model: nn.Module, tokenizer: Any, text: str, *, source: str,
                     sink: int = DEFAULT_SINK, window: int = DEFAULT_WINDOW,
                     threshold: float = DEFAULT_THRESHOLD, max_tokens: int = DEFAULT_MAX_TOKENS,
                     progress: bool = True) -> dict[str, Any]:
    """The policy payload (see the module docstring)."""
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"--threshold must be in (0, 1], got {threshold}")
    ids = tokenizer(text, add_special_tokens=False, truncation=True, max_length=max_tokens).input_ids
    share = head_streaming_share(model, torch.tensor(ids, dtype=torch.long), seq_len=max_tokens,
                                 sink=sink, window=window, progress=progress)
    dims = model_dims(model)
    return {
        "format": FORMAT,
        "model": {k: dims[k] for k in ("num_layers", "num_kv_heads", "head_dim")},
        "sink": sink, "window": window, "threshold": threshold,
        "streaming": (share >= threshold).tolist(),
        "sink_window_share": [[round(float(x), 6) for x in row] for row in share],
        "calibration": {"source": source, "tokens": len(ids),
                        "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()},
    }


def load_head_policy(path: str | os.PathLike[str], *, num_layers: int, num_kv_heads: int) -> Tensor:
    """Bool ``[L, Hkv]`` (True: streaming) from a policy file; ``ValueError`` with a one-line
    message naming the file and the mismatch when it is malformed or for another model."""
    where = f"head policy {os.fspath(path)}"
    payload = read_versioned_json(path, where, FORMAT)
    model = payload.get("model") or {}
    got = (model.get("num_layers"), model.get("num_kv_heads"))
    if got != (num_layers, num_kv_heads):
        raise ValueError(f"{where} is for {got[0]} layers/{got[1]} kv heads, the model has "
                         f"{num_layers}/{num_kv_heads}")
    rows = payload.get("streaming")
    if not (isinstance(rows, list) and len(rows) == num_layers
            and all(isinstance(r, list) and len(r) == num_kv_heads
                    and all(isinstance(x, bool) for x in r) for r in rows)):
        raise ValueError(f"{where}: 'streaming' must be {num_layers} lists of {num_kv_heads} "
                         f"booleans")
    return torch.tensor(rows, dtype=torch.bool)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True, help="a Hugging Face model folder")
    p.add_argument("--out", required=True, help="where to write the policy JSON")
    p.add_argument("--text", default=None,
                   help="calibration text file (default: the Python standard library's "
                        "docstrings, as the label calibration uses)")
    p.add_argument("--sink", type=int, default=DEFAULT_SINK)
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    p.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                   help="a head whose sink + window share reaches this is streaming")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.sink < 0 or args.window < 1:
        p.error("need --sink >= 0 and --window >= 1")
    torch.manual_seed(0)
    model, tokenizer = load_model(args.model_path)
    text, source = load_text(args.text, max_tokens=args.max_tokens)
    try:
        payload = calibrate_policy(model, tokenizer, text, source=source, sink=args.sink,
                                   window=args.window, threshold=args.threshold,
                                   max_tokens=args.max_tokens, progress=not args.no_progress)
    except ValueError as e:
        print(f"head_policy: {e}", file=sys.stderr)
        return 2
    Path(args.out).write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    streaming = sum(sum(r) for r in payload["streaming"])
    total = sum(len(r) for r in payload["streaming"])
    print(f"{streaming} of {total} kv heads are streaming (sink {args.sink}, window "
          f"{args.window}, threshold {args.threshold}) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
