"""Offline calibration of Double-Sparsity "label channels" (heavy q·k channels).

Double Sparsity scores every cached token with only ``r`` of the ``D`` channels of each
kv head: ``sum_{d in S} q_d k_d`` approximates ``q·k`` when ``S`` holds the channels that
carry most of ``sum_d |q_d k_d|``. Those channels are a property of the weights, so they
are found once, offline, by running the model over some real text:

    python -m sglang_ext.selection.calibrate --model-path DIR --out FILE.json \
        [--channels 16] [--text PATH] [--max-tokens 2048]

The KV cache stores keys after RoPE, so queries and keys are captured after RoPE too, and
the channel indices refer to that space. The default text is the docstrings of the Python
standard library of the running interpreter: real English prose that exists on every
machine without any download.

The output JSON is read back by :func:`load_label_config`. With ``--basis kpca|qk`` the labels
are instead the leading coordinates of a calibrated basis of each kv head's q/k space
(:mod:`sglang_ext.selection.label_basis`), saved beside the JSON (:func:`load_label_basis`).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import io
import json
import math
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

FORMAT = "sglang_ext.labels/1"
BASIS_FORMAT = "sglang_ext.label_basis/1"
DEFAULT_CHANNELS = 16
DEFAULT_MAX_TOKENS = 2048

# A layer callback receives (layer index, post-RoPE queries [B, Hq, T, D], post-RoPE keys
# [B, Hkv, T, D]), both float32.
QKCallback = Callable[[int, Tensor, Tensor], None]


# --------------------------------------------------------------------------------------
# Calibration text
# --------------------------------------------------------------------------------------


def stdlib_docstring_text(min_chars: int) -> tuple[str, str]:
    """Concatenated docstrings of top-level stdlib modules, in file-name order.

    Returns ``(text, source description)``. Stops once ``min_chars`` characters are
    collected. Docstrings rather than raw source: they are prose, closer to what a chat
    model attends over than code, and ``ast`` gives them without importing any module.
    """
    stdlib = Path(os.path.dirname(os.__file__))
    pieces: list[str] = []
    total = 0
    files = 0
    # Private modules (_pydecimal, _osx_support, ...) sort first and are mostly doctest
    # listings; public modules' docstrings read more like ordinary prose.
    for path in sorted(p for p in stdlib.glob("*.py") if not p.name.startswith("_")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue  # an unreadable module just contributes nothing
        files += 1
        # ast.walk is breadth-first over a deterministic tree, so the order is stable.
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=True)
                if doc and len(doc) >= 40:  # skip one-liners like "Return x."
                    pieces.append(doc)
                    total += len(doc) + 2
        if total >= min_chars:
            break
    version = ".".join(str(v) for v in sys.version_info[:3])
    source = f"python-stdlib-docstrings:{version}:{files} modules"
    return "\n\n".join(pieces), source


def load_text(path: str | None, *, max_tokens: int) -> tuple[str, str]:
    if path is not None:
        return Path(path).read_text(encoding="utf-8"), f"file:{Path(path).name}"
    # English prose runs ~4 characters per token; 8x leaves margin for short tokens.
    return stdlib_docstring_text(min_chars=8 * max_tokens)


# --------------------------------------------------------------------------------------
# Capturing post-RoPE q / k
# --------------------------------------------------------------------------------------


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules of a transformers decoder, ordered by layer index."""
    found = [
        m
        for m in model.modules()
        if hasattr(m, "q_proj") and hasattr(m, "k_proj") and isinstance(getattr(m, "layer_idx", None), int)
    ]
    if not found:
        raise ValueError(f"no attention modules with q_proj/k_proj/layer_idx in {type(model).__name__}")
    found.sort(key=lambda m: m.layer_idx)
    if [m.layer_idx for m in found] != list(range(len(found))):
        raise ValueError("attention modules do not cover layer indices 0..L-1 exactly once")
    return found


def _rotary_fn(attn: nn.Module) -> Callable[..., tuple[Tensor, Tensor]]:
    # Use the attention class's own apply_rotary_pos_emb so model-specific RoPE variants
    # (if any) are honoured; every transformers decoder defines one in its modeling file.
    module = sys.modules.get(type(attn).__module__)
    fn = getattr(module, "apply_rotary_pos_emb", None)
    if fn is None:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as fn
    return fn


@contextmanager
def capture_post_rope_qk(model: nn.Module, callback: QKCallback) -> Iterator[None]:
    """While active, every attention forward calls ``callback(layer, q, k)``.

    Hooks record what the model itself computes: the q/k projection outputs (or, for
    models that normalise per head before RoPE such as Qwen3, the q_norm/k_norm outputs)
    and the (cos, sin) position embeddings handed to the attention module; RoPE is then
    applied exactly as the module does.
    """
    handles = []
    for attn in attention_modules(model):
        state: dict[str, Any] = {}
        rotary = _rotary_fn(attn)
        head_dim = int(attn.head_dim)
        q_src = attn.q_norm if hasattr(attn, "q_norm") else attn.q_proj
        k_src = attn.k_norm if hasattr(attn, "k_norm") else attn.k_proj

        def pre_hook(module, args, kwargs, state=state):
            pos = kwargs.get("position_embeddings")
            if pos is None and len(args) > 1:
                pos = args[1]
            if pos is None:
                raise RuntimeError(f"layer {module.layer_idx}: attention got no position_embeddings")
            state["pos"] = pos

        def save(name: str, state=state):
            def hook(module, args, output):
                state[name] = output

            return hook

        def post_hook(module, args, output, state=state, rotary=rotary, head_dim=head_dim):
            q, k = state.pop("q"), state.pop("k")
            cos, sin = state.pop("pos")
            # [B, T, H*D] or [B, T, H, D] -> [B, H, T, D], the layout RoPE expects.
            q = q.reshape(*q.shape[:2], -1, head_dim).transpose(1, 2).float()
            k = k.reshape(*k.shape[:2], -1, head_dim).transpose(1, 2).float()
            q, k = rotary(q, k, cos.float(), sin.float())
            callback(module.layer_idx, q, k)

        handles.append(attn.register_forward_pre_hook(pre_hook, with_kwargs=True))
        handles.append(q_src.register_forward_hook(save("q")))
        handles.append(k_src.register_forward_hook(save("k")))
        handles.append(attn.register_forward_hook(post_hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


# --------------------------------------------------------------------------------------
# Channel importance
# --------------------------------------------------------------------------------------


def model_dims(model: nn.Module) -> dict[str, int]:
    config = model.config
    num_q = int(config.num_attention_heads)
    return {
        "num_layers": int(config.num_hidden_layers),
        "num_q_heads": num_q,
        "num_kv_heads": int(getattr(config, "num_key_value_heads", None) or num_q),
        "head_dim": int(getattr(config, "head_dim", None) or config.hidden_size // num_q),
    }


def qk_channel_mass(q: Tensor, k: Tensor) -> Tensor:
    """Sum over batch, positions and each group's query heads of ``|q_d k_d|``: ``[Hkv, D]``.

    ``q``: ``[B, Hq, T, D]``, ``k``: ``[B, Hkv, T, D]``; query head ``h`` belongs to kv head
    ``h // (Hq // Hkv)``, so heads ``g*G .. g*G+G-1`` form kv head ``g``'s group.
    """
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads cannot be grouped over {hkv} kv heads")
    grouped = q.reshape(b, hkv, hq // hkv, t, d)
    return (grouped * k.unsqueeze(2)).abs().sum(dim=(0, 2, 3), dtype=torch.float64)


def run_windows(model: nn.Module, windows: list[Tensor], callback: QKCallback, *, desc: str,
                progress: bool) -> None:
    """Run the model over each token window (an independent sequence from position 0), calling
    ``callback(layer, q, k)`` with every layer's post-RoPE q / k, with a progress bar."""
    from sglang_ext.progress import progress as progress_bar

    bar = progress_bar(total=len(windows) * model_dims(model)["num_layers"], desc=desc,
                       unit="layer", enabled=progress)

    def counted(layer: int, q: Tensor, k: Tensor) -> None:
        callback(layer, q, k)
        bar.update(1)

    device = next(model.parameters()).device
    with capture_post_rope_qk(model, counted):
        for window in windows:
            model(input_ids=window.unsqueeze(0).to(device), use_cache=False)
    bar.close()


@torch.inference_mode()
def channel_importance(
    model: nn.Module, input_ids: Tensor, *, seq_len: int, progress: bool = True,
    also: QKCallback | None = None,
) -> tuple[Tensor, int]:
    """Mean ``|q_d k_d|`` per (layer, kv head, channel): float64 ``[L, Hkv, D]``.

    ``input_ids`` is one long 1-D token sequence, run in windows of ``seq_len`` tokens
    (each an independent sequence starting at position 0). Returns the importance and
    the number of positions it averages over. ``also`` sees every layer's q / k too.
    """

    dims = model_dims(model)
    n_layers, hq, hkv, d = dims["num_layers"], dims["num_q_heads"], dims["num_kv_heads"], dims["head_dim"]
    total = torch.zeros(n_layers, hkv, d, dtype=torch.float64)
    windows = [input_ids[i : i + seq_len] for i in range(0, input_ids.numel(), seq_len)]

    def accumulate(layer: int, q: Tensor, k: Tensor) -> None:
        total[layer] += qk_channel_mass(q, k)
        if also is not None:
            also(layer, q, k)

    run_windows(model, windows, accumulate, desc="calibrate", progress=progress)
    positions = input_ids.numel()
    # Each position contributes G = Hq/Hkv query heads per kv head.
    return total / (positions * (hq // hkv)), positions


def top_channels(importance: Tensor, r: int) -> Tensor:
    """Indices of the ``r`` most important channels per (layer, kv head), most important
    first: ``[L, Hkv, r]``. The order lets the server use any prefix of the list
    (``--sparse-label-channels`` ≤ r) without recalibrating.

    A stable descending sort breaks exact ties towards the lower channel index, so the
    result is fully determined by ``importance``.
    """
    d = importance.shape[-1]
    if not 1 <= r <= d:
        raise ValueError(f"--channels must be in 1..{d}, got {r}")
    order = torch.sort(importance, dim=-1, descending=True, stable=True).indices
    return order[..., :r]


# --------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------


def load_model(model_path: str, dtype: str = "float32") -> tuple[nn.Module, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return model, tokenizer


def calibrate(
    model: nn.Module,
    tokenizer: Any,
    text: str,
    *,
    source: str,
    channels: int = DEFAULT_CHANNELS,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    seq_len: int | None = None,
    progress: bool = True,
    basis: str = "none",
) -> tuple[dict[str, Any], tuple[Tensor, Tensor] | None]:
    """Run calibration; returns the label-config payload (see module docstring) and, with a
    ``basis`` (:data:`label_basis.BASES`), that basis ``(Bq, Bk)`` ``[L, Hkv, D, D]``: the
    payload's channels are then its first r coordinates."""
    from sglang_ext.selection.label_basis import BASES, QKMoments, label_basis

    if basis != "none" and basis not in BASES:
        raise ValueError(f"--basis must be none or one of {', '.join(BASES)}, got {basis!r}")
    dims = model_dims(model)
    if not 1 <= channels <= dims["head_dim"]:
        raise ValueError(f"--channels must be in 1..{dims['head_dim']}, got {channels}")
    # Truncating in the tokenizer also keeps it from warning about over-long input.
    ids = tokenizer(text, add_special_tokens=False, truncation=True, max_length=max_tokens).input_ids
    if len(ids) < 2:
        raise ValueError("calibration text is empty after tokenization")
    limit = getattr(model.config, "max_position_embeddings", None) or len(ids)
    seq_len = min(seq_len or max_tokens, limit)
    moments = None if basis == "none" else QKMoments(
        dims["num_layers"], dims["num_kv_heads"], dims["head_dim"])
    importance, positions = channel_importance(
        model, torch.tensor(ids, dtype=torch.long), seq_len=seq_len, progress=progress,
        also=moments,
    )
    chosen = top_channels(importance, channels)
    matrices = None
    if moments is not None:
        matrices = label_basis(*moments.means(), basis)
        chosen = torch.arange(channels).expand(dims["num_layers"], dims["num_kv_heads"], -1)
    payload = {
        "format": FORMAT,
        "model": dims,
        "label_channels": channels,
        "channels": chosen.tolist(),
        "calibration": {
            "source": source,
            "tokens": positions,
            "windows": math.ceil(positions / seq_len),
            "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        },
    }
    return payload, matrices


def dumps_label_config(payload: dict[str, Any]) -> str:
    """JSON with one line per layer for ``channels`` (indent=2 would spend a line per int)."""
    marker = "@@CHANNELS@@"
    head = json.dumps({**payload, "channels": marker}, indent=2)
    rows = ",\n".join("    " + json.dumps(layer, separators=(",", ":")) for layer in payload["channels"])
    return head.replace(f'"{marker}"', "[\n" + rows + "\n  ]") + "\n"


def read_versioned_json(path: str | os.PathLike[str], where: str, fmt: str) -> dict[str, Any]:
    """The JSON object in ``path`` whose ``format`` is ``fmt``; ``ValueError`` (one line, starting
    with ``where``) when it cannot be read, is not JSON or has another format."""
    try:
        payload = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"{where} cannot be read: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise ValueError(f"{where} is not valid JSON: {exc}") from exc
    if not isinstance(payload, dict) or payload.get("format") != fmt:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise ValueError(f"{where} has format {found!r}, expected {fmt!r}")
    return payload


def load_label_config(path: str | os.PathLike[str], *, num_layers: int, num_kv_heads: int, head_dim: int) -> Tensor:
    """Read a label config and return its channels as a long tensor ``[L, Hkv, r]``.

    Raises ``ValueError`` with a one-line message naming the file and the mismatch when the
    file is malformed or was calibrated for a different model shape.
    """
    where = f"label config {os.fspath(path)}"
    payload = read_versioned_json(path, where, FORMAT)

    model = payload.get("model")
    try:
        got = (int(model["num_layers"]), int(model["num_kv_heads"]), int(model["head_dim"]))
    except (TypeError, KeyError, ValueError) as exc:
        raise ValueError(f"{where} lacks model.num_layers/num_kv_heads/head_dim") from exc
    want = (num_layers, num_kv_heads, head_dim)
    if got != want:
        raise ValueError(
            f"{where} is for {got[0]} layers/{got[1]} kv heads/dim {got[2]}, "
            f"model has {want[0]}/{want[1]}/{want[2]}"
        )

    r = payload.get("label_channels")
    if not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= head_dim:
        raise ValueError(f"{where} has label_channels {r!r}, expected an int in 1..{head_dim}")
    try:
        channels = torch.tensor(payload.get("channels"), dtype=torch.long)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{where} has a ragged or non-integer channels array") from exc
    if tuple(channels.shape) != (num_layers, num_kv_heads, r):
        raise ValueError(
            f"{where} channels have shape {list(channels.shape)}, expected [{num_layers}, {num_kv_heads}, {r}]"
        )
    # torch.tensor silently truncates floats to ints; reject them so typos are not masked.
    flat = payload["channels"]
    if any(not isinstance(c, int) or isinstance(c, bool) for layer in flat for head in layer for c in head):
        raise ValueError(f"{where} channels must be integers")
    if channels.min() < 0 or channels.max() >= head_dim:
        raise ValueError(f"{where} has channel indices outside 0..{head_dim - 1}")
    if (channels.sort(dim=-1).values.diff(dim=-1) == 0).any():
        raise ValueError(f"{where} repeats a channel within a kv head")
    return channels


def write_label_basis(path: Path, kind: str, bq: Tensor, bk: Tensor) -> dict[str, str]:
    """Save a label basis (``[L, Hkv, D, D]`` each) and return the label config's ``basis``
    entry: its kind, file name (beside the config) and sha256."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"format": BASIS_FORMAT, "kind": kind, "query": bq.contiguous(),
                "key": bk.contiguous()}, tmp)
    os.replace(tmp, path)
    return {"kind": kind, "file": path.name,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def label_config_has_basis(path: str | os.PathLike[str]) -> bool:
    """Whether a readable label config names a basis (False for an unreadable one: its own
    check reports that)."""
    try:
        payload = read_versioned_json(path, "label config", FORMAT)
    except ValueError:
        return False
    return payload.get("basis") is not None


def load_label_basis(path: str | os.PathLike[str], *, num_layers: int, num_kv_heads: int,
                     head_dim: int) -> tuple[Tensor, Tensor] | None:
    """The label basis ``(Bq, Bk)`` (float32 ``[L, Hkv, D, D]``) a label config names, or None
    when it has channels only. ``ValueError`` in one line for a missing, altered or misshapen
    basis file, or channels that are not its leading coordinates."""
    from sglang_ext.selection.label_basis import BASES

    where = f"label config {os.fspath(path)}"
    payload = read_versioned_json(path, where, FORMAT)
    entry = payload.get("basis")
    if entry is None:
        return None
    if not isinstance(entry, dict) or entry.get("kind") not in BASES \
            or not isinstance(entry.get("file"), str) or "sha256" not in entry:
        raise ValueError(f"{where} has a malformed basis entry (kind in {BASES}, file, sha256)")
    file = Path(path).parent / entry["file"]
    try:
        raw = file.read_bytes()
    except OSError as exc:
        raise ValueError(f"{where} names basis file {file} that cannot be read: "
                         f"{exc.strerror or exc}") from exc
    if hashlib.sha256(raw).hexdigest() != entry["sha256"]:
        raise ValueError(f"{where}: basis file {file} does not match its sha256")
    try:
        saved = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is one bad file
        raise ValueError(f"{where}: basis file {file} cannot be loaded ({exc})") from exc
    want = (num_layers, num_kv_heads, head_dim, head_dim)
    if not isinstance(saved, dict) or saved.get("format") != BASIS_FORMAT or any(
            not isinstance(saved.get(n), Tensor) or tuple(saved[n].shape) != want
            for n in ("query", "key")):
        raise ValueError(f"{where}: basis file {file} must hold query/key tensors of shape "
                         f"{list(want)} ({BASIS_FORMAT})")
    channels = load_label_config(path, num_layers=num_layers, num_kv_heads=num_kv_heads,
                                 head_dim=head_dim)
    if not torch.equal(channels, torch.arange(channels.shape[-1]).expand_as(channels)):
        raise ValueError(f"{where}: with a basis the channels must be its leading coordinates "
                         f"0..r-1")
    return saved["query"].float(), saved["key"].float()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_ext.selection.calibrate",
        description="Pick Double-Sparsity label channels (heavy post-RoPE q·k channels) per layer and kv head.",
    )
    parser.add_argument("--model-path", required=True, help="Hugging Face model folder")
    parser.add_argument("--out", required=True, type=Path, help="output JSON file")
    parser.add_argument("--channels", type=int, default=DEFAULT_CHANNELS, help="label channels r per kv head")
    parser.add_argument("--text", default=None, help="UTF-8 text file (default: stdlib docstrings)")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="calibration tokens")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per forward (default: --max-tokens)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--basis", choices=("none", "kpca", "qk"), default="none",
                        help="score labels in a calibrated basis of each kv head's q/k space "
                             "instead of r channels: kpca (the keys' principal directions) or "
                             "qk (the rank-r form closest to q.k); written beside --out as "
                             "NAME.basis.pt (default: none)")
    args = parser.parse_args(argv)
    if args.max_tokens < 2:
        parser.error("--max-tokens must be at least 2")

    model, tokenizer = load_model(args.model_path, args.dtype)
    text, source = load_text(args.text, max_tokens=args.max_tokens)
    payload, matrices = calibrate(
        model,
        tokenizer,
        text,
        source=source,
        channels=args.channels,
        max_tokens=args.max_tokens,
        seq_len=args.seq_len,
        progress=not args.quiet,
        basis=args.basis,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if matrices is not None:
        payload["basis"] = write_label_basis(args.out.with_suffix(".basis.pt"), args.basis,
                                             *matrices)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(dumps_label_config(payload), encoding="utf-8")
    os.replace(tmp, args.out)
    dims = payload["model"]
    what = f"coordinates of a {args.basis} basis" if matrices is not None else "channels"
    print(
        f"wrote {args.out}: {dims['num_layers']} layers x {dims['num_kv_heads']} kv heads x "
        f"{args.channels}/{dims['head_dim']} {what} from {payload['calibration']['tokens']} "
        f"tokens ({source})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
