"""Fluxion in the reference selection: output-aware token ranking with the layer's budget shared
among kv heads, the per-head policy (calibration, file checks, streaming heads), per-request
switches, and the exact log-sum-exp merge that cooperative attention relies on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sglang_ext.attention.request_overrides import parse_override
from sglang_ext.config import build_config
from sglang_ext.selection.head_policy import (
    FORMAT,
    calibrate_policy,
    load_head_policy,
    sink_window_mass,
)
from sglang_ext.selection.reference import (
    SelectionParams,
    merge_attention_states,
    output_aware_token_mask,
    select_token_mask,
    sparse_attention_with_lse,
)

HKV, GROUP, D = 3, 3, 16


def _case(seed: int, length: int = 300):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(HKV * GROUP, D, generator=gen)
    keys = torch.randn(length, HKV, D, generator=gen)
    values = torch.randn(length, HKV, D, generator=gen) * torch.rand(length, HKV, 1, generator=gen) * 3
    return q, keys, values


@pytest.mark.parametrize("seed", range(5))
def test_output_aware_never_exceeds_the_layers_budget(seed: int) -> None:
    q, keys, values = _case(seed)
    params = SelectionParams("two_level", 96, 8, 20, 8, 16, scoring="output_aware")
    mask = select_token_mask(q, keys, params, values=values)
    n_sel = params.budget - params.sink - params.window
    middle = mask[:, params.sink:keys.shape[0] - params.window]
    assert int(middle.sum()) <= n_sel * HKV
    # every head still attends its sink and window
    assert mask[:, :params.sink].all() and mask[:, keys.shape[0] - params.window:].all()
    # the budget moves between heads (random heads differ in how spread their attention is)
    per_head = middle.sum(dim=1)
    assert int(per_head.sum()) == n_sel * HKV
    assert len(set(per_head.tolist())) > 1


def test_output_aware_prefers_tokens_with_large_values_and_concentrated_heads_give_way() -> None:
    # head 0: one dominant token; head 1: flat scores. Budget 2 tokens per head, 4 in all.
    scores = torch.tensor([[20.0, 0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    norms = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0], [1.0, 5.0, 1.0, 4.0, 1.0]])
    mask = output_aware_token_mask(scores, norms, total=4, sm_scale=1.0)
    assert mask[0].tolist() == [True, False, False, False, False]
    assert mask[1].tolist() == [True, True, False, True, False]
    # -inf scores (outside the kept blocks) are never chosen
    scores[1, 1] = float("-inf")
    assert not output_aware_token_mask(scores, norms, total=10, sm_scale=1.0)[1, 1]


def test_streaming_heads_attend_sink_and_window_and_retrieval_heads_share_the_rest() -> None:
    q, keys, values = _case(7)
    params = SelectionParams("two_level", 96, 8, 20, 8, 16, head_policy=True)
    streaming = torch.tensor([True, False, True])
    mask = select_token_mask(q, keys, params, streaming=streaming)
    lo, hi = params.sink, keys.shape[0] - params.window
    assert not mask[0, lo:hi].any() and not mask[2, lo:hi].any()
    n_sel = params.budget - params.sink - params.window
    assert int(mask[1, lo:hi].sum()) == n_sel * HKV  # the one retrieval head takes the layer's
    # without the flag in the params the policy is ignored
    off = SelectionParams("two_level", 96, 8, 20, 8, 16)
    assert torch.equal(select_token_mask(q, keys, off, streaming=streaming),
                       select_token_mask(q, keys, off))


def test_lse_merge_of_two_parts_equals_attention_over_their_union() -> None:
    q, keys, values = _case(3, length=64)
    part = torch.zeros(HKV, 64, dtype=torch.bool)
    part[:, :40] = True  # e.g. tokens on the GPU ...
    other = ~part  # ... and the misses a CPU computes from host memory
    oa, la = sparse_attention_with_lse(q, keys, values, part, 0.25)
    ob, lb = sparse_attention_with_lse(q, keys, values, other, 0.25)
    merged, lse = merge_attention_states(oa, la, ob, lb)
    full, lfull = sparse_attention_with_lse(q, keys, values, part | other, 0.25)
    torch.testing.assert_close(merged, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, lfull, rtol=1e-5, atol=1e-5)


def test_sink_window_mass_matches_a_direct_count() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 12, 8, generator=gen)
    k = torch.randn(1, 2, 12, 8, generator=gen)
    mass, n = sink_window_mass(q, k, sink=2, window=3)
    expect = torch.zeros(2, dtype=torch.float64)
    for h in range(4):
        for t in range(5, 12):
            w = torch.softmax((q[0, h, t] @ k[0, h // 2, :t + 1].T) * 8 ** -0.5, dim=-1)
            expect[h // 2] += float(w[:2].sum() + w[t - 2:t + 1].sum())
    torch.testing.assert_close(mass, expect, rtol=1e-5, atol=1e-6)
    assert n == 2 * 7  # per kv head: 2 query heads x 7 positions


def _policy(tmp_path: Path, layers: int, heads: int, **changes) -> Path:
    payload = {"format": FORMAT, "model": {"num_layers": layers, "num_kv_heads": heads},
               "streaming": [[h == 0 for h in range(heads)] for _ in range(layers)], **changes}
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(payload))
    return path


def test_policy_files_are_checked_against_the_model(tmp_path: Path) -> None:
    good = load_head_policy(_policy(tmp_path, 4, 3), num_layers=4, num_kv_heads=3)
    assert good.dtype == torch.bool and good[:, 0].all() and not good[:, 1:].any()
    with pytest.raises(ValueError, match="is for 4 layers/3 kv heads, the model has 30/3"):
        load_head_policy(_policy(tmp_path, 4, 3), num_layers=30, num_kv_heads=3)
    with pytest.raises(ValueError, match="booleans"):
        load_head_policy(_policy(tmp_path, 2, 3, streaming=[[1, 0, 0], [0, 0, 0]]),
                         num_layers=2, num_kv_heads=3)
    with pytest.raises(ValueError, match="format"):
        load_head_policy(_policy(tmp_path, 2, 3, format="labels"), num_layers=2, num_kv_heads=3)


def test_requests_switch_scoring_and_policy(tmp_path: Path) -> None:
    path = _policy(tmp_path, 4, 3)
    base = build_config(head_policy=str(path), budget=256)
    assert parse_override(None, base).head_policy  # the server's policy applies by default
    assert not parse_override({"sparse": {"head_policy": False}}, base).head_policy
    got = parse_override({"sparse": {"scoring": "output_aware"}}, base)
    assert got.scoring == "output_aware" and got.method == "two_level"
    with pytest.raises(ValueError, match="head_policy needs a server"):
        parse_override({"sparse": {"head_policy": True}}, build_config())
    with pytest.raises(ValueError, match="true or false"):
        parse_override({"sparse": {"head_policy": "yes"}}, base)
    with pytest.raises(ValueError, match="--sparse-scoring"):
        parse_override({"sparse": {"scoring": "output_aware", "method": "quest"}}, base)
    # a server scoring output-aware still serves quest requests (scoring falls back)
    oa = build_config(scoring="output_aware")
    assert parse_override({"sparse": {"method": "quest"}}, oa).scoring == "score"


class _TinyTokenizer:
    def __call__(self, text, **kwargs):
        class Out:
            input_ids = [ord(c) % 64 for c in text][: kwargs.get("max_length", len(text))]
        return Out()


def test_calibration_is_deterministic_for_a_fixed_text() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    text = "the quick brown fox jumps over the lazy dog. " * 8
    runs = [calibrate_policy(model, _TinyTokenizer(), text, source="test", sink=4, window=8,
                             threshold=0.5, max_tokens=128, progress=False) for _ in range(2)]
    assert json.dumps(runs[0]) == json.dumps(runs[1])
    assert runs[0]["model"] == {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8}
    shares = torch.tensor(runs[0]["sink_window_share"])
    assert shares.shape == (2, 2) and ((shares > 0) & (shares <= 1)).all()
    assert runs[0]["streaming"] == (shares >= 0.5).tolist()
