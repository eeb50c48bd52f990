"""Training NOSA's eviction heads (sglang_ext/selection/train_eviction.py) on a tiny random
Llama: deterministic for a fixed seed, only the heads change, and the trained objective goes
down on a fixed batch."""

from __future__ import annotations

import pytest
import torch

from sglang_ext.selection.eviction_head import EvictionHeads
from sglang_ext.selection.train_eviction import TrainConfig, capture_windows, evaluate, train

CFG = TrainConfig(steps=3, seq_len=160, windows=2, batch=2, positions=4, budget=32, block_size=4,
                  sink=4, window=8, locality_blocks=2, lr=0.05, seed=0)


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=512)
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(1)
    windows = [torch.randint(0, 128, (CFG.seq_len,), generator=gen) for _ in range(CFG.windows)]
    frozen = {k: v.clone() for k, v in model.state_dict().items()}
    data = capture_windows(model, windows)
    for k, v in model.state_dict().items():
        assert torch.equal(v, frozen[k])  # the base model is not touched
    return data


def _heads(seed: int = 0) -> EvictionHeads:
    return EvictionHeads(2, 2, 16, generator=torch.Generator().manual_seed(seed))


def test_capture_matches_the_model_shapes(tiny):
    assert len(tiny) == 2 and len(tiny[0]) == 2
    qkv = tiny[0][1]
    assert qkv.q.shape == (4, CFG.seq_len, 16)
    assert qkv.k.shape == qkv.v.shape == (CFG.seq_len, 2, 16)


def test_training_is_deterministic_for_a_fixed_seed(tiny):
    runs = []
    for _ in range(2):
        heads = _heads()
        curve = train(heads, tiny, CFG, progress=False)
        runs.append((curve, heads.state_dict()))
    (c1, w1), (c2, w2) = runs
    assert c1 == c2 and len(c1) == CFG.steps
    for k in w1:
        assert torch.equal(w1[k], w2[k])
    assert not torch.equal(w1["weight"], _heads().weight.detach())  # the heads did learn
    other = _heads()
    c3 = train(other, tiny, TrainConfig(**{**CFG.__dict__, "seed": 1}), progress=False)
    assert c3 != c1  # another seed samples other positions


def test_loss_goes_down_on_a_fixed_batch(tiny):
    cfg = TrainConfig(**{**CFG.__dict__, "steps": 8})
    curve = train(_heads(), tiny, cfg, progress=False, fixed_batch=True)
    soft = [e["soft_loss"] for e in curve]
    assert soft[-1] < 0.9 * soft[0], soft
    assert all(0 <= e["hard_loss"] for e in curve)


def test_evaluation_compares_the_selections_at_one_budget(tiny):
    got = evaluate(_heads(), tiny[:1], CFG, steps=4)
    assert set(got) == {"two_level", "locality_attention", "locality_key_norm", "locality_learned"}
    # a budget of 32 of 160 tokens is not exact; γ is a share
    assert all(v["error"] > 0 and 0 <= v["gamma_min"] <= v["gamma"] <= 1 for v in got.values())
