"""Tests for sglang_ext.models.convert_gguf against transformers' own GGUF import.

transformers can read the GGUF directly (``from_pretrained(dir, gguf_file=...)``); that is an
independent implementation of the same dequantize / un-permute / rename steps, so agreeing
with it on weights, logits and tokenization is strong evidence that our folder is right.

Run from the repository root: ``python -m pytest tests/test_convert_gguf.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

import pytest
import torch

from sglang_ext.models import convert_gguf
from sglang_ext.models.convert_gguf import convert, default_gguf_path, is_complete

CHAT_END = "<|im_end|>"

# Short, but covers the tokenizer's awkward corners: digit runs (SmolLM2 splits every
# digit), decimals, non-ASCII letters, CJK, emoji, mixed whitespace, code, and special
# tokens written inline.
TOKENIZER_SAMPLES = [
    "Hello world!",
    "In 2024, 1234567 people paid $3.14159 each (≈ 10^6).",
    "naïve café, Straße, Ελληνικά, 日本語のテキスト, 🤖🚀 emoji",
    "  leading spaces\n\ttabs\r\nand   runs   of spaces  ",
    "def f(x):\n    return x**2 + 0x1F  # comment",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
]
CHAT = [
    {"role": "user", "content": "What is 17 * 23? Answer with just the number."},
    {"role": "assistant", "content": "391"},
    {"role": "user", "content": "Merci beaucoup ! Et 2+2 ?"},
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return default_gguf_path()


@pytest.fixture(scope="module")
def model_dir(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A converted folder: $SGLANG_EXT_MODEL_DIR when it already holds a complete
    conversion of this GGUF (saves a few seconds), otherwise a fresh one in a tmp dir."""
    env_dir = os.environ.get("SGLANG_EXT_MODEL_DIR")
    if env_dir and is_complete(Path(env_dir), gguf_path):
        return Path(env_dir)
    out = tmp_path_factory.mktemp("smollm2_hf")
    summary = convert(gguf_path, out, progress=False)
    assert not summary["skipped"]
    return out


@pytest.fixture(scope="module")
def _memoized_gguf_metadata():
    """Memoize two slow, deterministic steps of transformers' GGUF import.

    transformers re-reads all GGUF key/values (49k tokens + 49k merges, ~4 s each time on
    2 cores) in AutoConfig and twice in AutoTokenizer, and when mapping tensor names it
    rebuilds gguf's TensorNameMap once per module (~400 times, ~8 s). Serving copies of
    the first result changes nothing but the test's run time. Calls that load tensors go
    to the real function.
    """
    import copy
    import functools

    import gguf

    import transformers.configuration_utils as configuration_utils
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    import transformers.models.auto.tokenization_auto as tokenization_auto
    import transformers.tokenization_utils_tokenizers as tokenization_utils_tokenizers

    original = gguf_utils.load_gguf_checkpoint
    cache: dict[str, dict] = {}

    def load_gguf_checkpoint(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs:
            return original(path, return_tensors=return_tensors, **kwargs)
        key = os.fspath(path)
        if key not in cache:
            cache[key] = original(path)
        return copy.deepcopy(cache[key])

    with pytest.MonkeyPatch.context() as patch:
        for module in (gguf_utils, configuration_utils, tokenization_auto, tokenization_utils_tokenizers):
            patch.setattr(module, "load_gguf_checkpoint", load_gguf_checkpoint)
        # Looked up from the gguf package at call time, so patching the package suffices.
        patch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        yield


@pytest.fixture(scope="module")
def reference_model(gguf_path: Path, _memoized_gguf_metadata) -> torch.nn.Module:
    """The model as transformers' GGUF importer builds it, in fp32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if importlib.util.find_spec("accelerate") is not None:
        return AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        ).eval()

    # from_pretrained(gguf_file=...) refuses to run without accelerate, which this project
    # does not install; its GGUF branch is only these calls, so run them directly.
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(
        str(gguf_path), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32
    )["tensors"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected, unexpected
    # Only the tied LM head may be absent from the GGUF.
    assert set(missing) <= {"lm_head.weight"}, missing
    model.tie_weights()
    return model.eval()


@pytest.fixture(scope="module")
def reference_tokenizer(gguf_path: Path, _memoized_gguf_metadata):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def our_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    # Stored weights are bf16; computing in fp32 isolates the weight rounding from
    # bf16 activation noise.
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def our_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def test_config_values(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["intermediate_size"] == 1536
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert config["rope_theta"] == 100000.0
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    assert config["rms_norm_eps"] == 1e-5
    assert config["vocab_size"] == 49152
    assert config["max_position_embeddings"] == 8192
    assert config["tie_word_embeddings"] is True
    assert config["torch_dtype"] == "bfloat16"

    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"
    assert "lm_head.weight" not in names  # tied: the embedding doubles as the LM head
    assert len(names) == 2 + 30 * 9  # embed + final norm + 9 tensors per layer


def test_idempotent(model_dir: Path, gguf_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    assert convert_gguf.main(["--out", str(model_dir), "--gguf", str(gguf_path)]) == 0
    assert time.perf_counter() - start < 2.0
    assert "already holds a complete conversion" in capsys.readouterr().out
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before

    marker = json.loads((model_dir / convert_gguf.MARKER_NAME).read_text())
    assert marker["source_size"] == gguf_path.stat().st_size
    assert marker["format_version"] == convert_gguf.FORMAT_VERSION


def test_incomplete_folder_is_not_reused(tmp_path: Path, model_dir: Path, gguf_path: Path) -> None:
    # A marker from another source file, another format version, or next to missing
    # files must not count as complete.
    for name in convert_gguf.OUTPUT_FILES:
        (tmp_path / name).write_text("x")
    payload = {"format_version": convert_gguf.FORMAT_VERSION, "source_size": gguf_path.stat().st_size}
    (tmp_path / convert_gguf.MARKER_NAME).write_text(json.dumps(payload))
    assert is_complete(tmp_path, gguf_path)
    (tmp_path / convert_gguf.MARKER_NAME).write_text(json.dumps({**payload, "source_size": 1}))
    assert not is_complete(tmp_path, gguf_path)
    (tmp_path / convert_gguf.MARKER_NAME).write_text(json.dumps({**payload, "format_version": -1}))
    assert not is_complete(tmp_path, gguf_path)
    (tmp_path / convert_gguf.MARKER_NAME).write_text(json.dumps(payload))
    (tmp_path / "model.safetensors").unlink()
    assert not is_complete(tmp_path, gguf_path)


def test_weights_equal_transformers_gguf_import(our_model, reference_model) -> None:
    # Same dequantized values, rounded to bf16 the same way: must match bit for bit. This
    # is where a wrong q/k un-permutation or name mapping would show first.
    ours = our_model.state_dict()
    ref = reference_model.state_dict()
    assert set(ours) == set(ref)
    for name, ref_tensor in ref.items():
        assert ours[name].shape == ref_tensor.shape, name
        assert torch.equal(ours[name], ref_tensor.to(torch.bfloat16).to(torch.float32)), name


def test_logits_match_transformers_gguf_import(our_model, reference_model, our_tokenizer) -> None:
    prompt = our_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    ids = our_tokenizer(prompt, return_tensors="pt").input_ids
    assert ids.shape[1] > 40
    with torch.no_grad():
        ours = our_model(ids).logits[0]
        ref = reference_model(ids).logits[0]
    # Only the bf16 rounding of the weights separates the two (~0.4% relative per weight).
    scale = ref.abs().max()
    assert (ours - ref).abs().max() < 0.02 * scale, ((ours - ref).abs().max(), scale)
    cos = torch.nn.functional.cosine_similarity(ours, ref, dim=-1)
    assert cos.min() > 0.999, cos.min()
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_tokenizer_matches_transformers_gguf_import(our_tokenizer, reference_tokenizer) -> None:
    for text in TOKENIZER_SAMPLES:
        ours = our_tokenizer.encode(text)
        assert ours == reference_tokenizer.encode(text), text
        assert our_tokenizer.decode(ours) == text
    # Digits are single tokens (SmolLM2's pre-tokenizer splits them).
    assert len(our_tokenizer.encode("1234567")) == 7

    ours_chat = our_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    ref_chat = reference_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert ours_chat == ref_chat
    assert ours_chat.startswith("<|im_start|>system\n")
    assert ours_chat.endswith("<|im_start|>assistant\n")
    assert our_tokenizer.encode(ours_chat) == reference_tokenizer.encode(ref_chat)


def test_eos_is_im_end(model_dir: Path, our_tokenizer) -> None:
    im_end = our_tokenizer.convert_tokens_to_ids(CHAT_END)
    assert our_tokenizer.eos_token == CHAT_END
    assert our_tokenizer.pad_token == CHAT_END
    assert our_tokenizer.bos_token == "<|im_start|>"
    assert json.loads((model_dir / "config.json").read_text())["eos_token_id"] == im_end
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == im_end
    # Special tokens are atomic and are dropped by skip_special_tokens.
    ids = our_tokenizer.encode(f"hi{CHAT_END}")
    assert ids[-1] == im_end
    assert our_tokenizer.decode(ids, skip_special_tokens=True) == "hi"
