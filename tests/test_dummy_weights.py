"""SGLANG_EXT_DUMMY_WEIGHTS=scaled (patches/model_loader.py): dummy weights whose greedy decoding
is decided by the logits, not by tie-breaking, and that are the same on every load."""

from __future__ import annotations

import pytest
import torch
from sglang.srt.model_loader.weight_utils import initialize_dummy_weights

from sglang_ext.patches import model_loader


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int = 4096, hidden: int = 256) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.norm = torch.nn.Parameter(torch.empty(hidden))
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.embed(ids))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        return self.lm_head(h)


def _load(monkeypatch: pytest.MonkeyPatch, mode: str) -> TinyLM:
    monkeypatch.setenv(model_loader.ENV, mode)
    model = TinyLM()
    model_loader._around_initialize_dummy_weights(initialize_dummy_weights, model)
    return model


def _top2_margins(model: TinyLM) -> torch.Tensor:
    logp = torch.log_softmax(model(torch.arange(64)).float(), -1)
    top = logp.topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


def test_sglang_fill_is_a_tie_and_scaled_fill_is_decisive(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = _load(monkeypatch, "sglang")
    scaled = _load(monkeypatch, "scaled")
    assert _top2_margins(plain).max() < 1e-3  # greedy picks by tie-breaking
    assert _top2_margins(scaled).median() > 0.25  # above the greedy checks' tie margin
    w = scaled.proj.weight
    assert abs(w.std().item() * w.shape[1] ** 0.5 - 1.0) < 0.05
    assert abs(scaled.lm_head.weight.std().item() * 256 ** 0.5 - model_loader.LOGIT_GAIN) < 0.4
    assert ((scaled.norm - 1).abs() <= 0.1 + 1e-6).all()


def test_scaled_fill_is_the_same_on_every_load(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = _load(monkeypatch, "scaled"), _load(monkeypatch, "scaled")
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_a_bad_mode_fails_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(model_loader.ENV, "big")
    with pytest.raises(SystemExit, match="SGLANG_EXT_DUMMY_WEIGHTS='big' is not one of"):
        model_loader.setup()


def test_tp_ranks_draw_different_output_projections() -> None:
    # SGLang's fill is the same on every rank's shard; twin tokens of the vocabulary-parallel
    # output projection would tie exactly.
    shards = []
    for rank in range(2):
        model = TinyLM()
        initialize_dummy_weights(model)
        model_loader.rescale_dummy_weights(model, tp_rank=rank)
        shards.append(model)
    assert torch.equal(shards[0].proj.weight, shards[1].proj.weight)
    assert not torch.equal(shards[0].lm_head.weight, shards[1].lm_head.weight)
