"""Per-request settings on the batched (Triton) decode (sglang_ext/attention/mixed_settings.py):
rows of one batch with different settings, dense rows included, decode as each request would
alone with its own setting; and which settings the batched decode refuses."""

import dataclasses

import pytest
import torch

from sglang_ext.attention.mixed_settings import (
    MixedSettingsDecode,
    dense_slots,
    group_rows,
    unsupported_override,
)
from sglang_ext.kernels.sparse_decode import DecodeRows, LayerCache, sparse_decode_batched
from sglang_ext.kernels.testing import case_generator, make_paged_batch, random_values
from sglang_ext.selection.reference import SelectionParams, sparse_attention_with_lse

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _settings(bs: int) -> list:
    """The server's default, a smaller budget with the bound filter, the cascade, quest, ds and
    dense."""
    default = SelectionParams("two_level", 40, bs, 8, 4, 8, block_score="label_max")
    return [default,
            dataclasses.replace(default, candidate_blocks=3, prefilter=2),
            dataclasses.replace(default, budget=24, candidate_blocks=4, block_score="bound"),
            dataclasses.replace(default, method="quest", block_score="bound"),
            dataclasses.replace(default, method="ds", block_score="bound"),
            None]


def _check_mixed(hq, hkv, head_dim, bs, lens, dtype, tol):
    gen = case_generator("mixed-settings", hq, hkv, bs, len(lens))
    pb = make_paged_batch(gen, lens, hkv, head_dim, bs, dtype=dtype, device=DEVICE)
    q = random_values(gen, len(lens), hq, head_dim, dtype=dtype, device=DEVICE)
    channels = torch.stack([torch.randperm(head_dim, generator=gen)[:5]
                            for _ in range(hkv)]).to(DEVICE)
    settings = _settings(bs)
    sparsity = [settings[i % len(settings)] for i in range(len(lens))]
    groups = group_rows(sparsity, DEVICE)
    assert len(groups) == min(len(lens), len(settings))
    mixed = MixedSettingsDecode(hq, hkv, head_dim, pb.max_blocks, DEVICE, dtype)
    cache = LayerCache(pb.k_buffer, pb.v_buffer, pb.kmin, pb.kmax, channels=channels)
    out = mixed.decode(groups, q, cache,
                       DecodeRows(pb.req_to_token, pb.req_pool_indices, pb.seq_lens), 0.3)
    for b, params in enumerate(sparsity):
        one = slice(b, b + 1)
        if params is None:  # exact attention over the whole context
            keys = pb.keys(b)
            mask = torch.ones(hkv, keys.shape[0], dtype=torch.bool, device=DEVICE)
            expected = sparse_attention_with_lse(q[b], keys, pb.values(b), mask, 0.3)[0]
        else:  # the same request decoded alone with its setting
            expected = sparse_decode_batched(
                q[one], cache,
                DecodeRows(pb.req_to_token, pb.req_pool_indices[one], pb.seq_lens[one]), params,
                0.3)[0]
        torch.testing.assert_close(out[b].float(), expected.float(), **tol)
    return out


def test_mixed_rows_decode_as_each_alone():
    """Six settings over ten rows (rows interleaved), fp32."""
    lens = [45, 100, 77, 130, 61, 99, 140, 41, 88, 120]
    _check_mixed(6, 2, 32, 8, lens, torch.float32, dict(rtol=1e-4, atol=1e-5))


def test_dense_slots_cover_each_context():
    gen = case_generator("dense-slots")
    pb = make_paged_batch(gen, [5, 17, 9], 2, 16, 4, summary_chunks=0)
    slots = dense_slots(pb.req_to_token, pb.req_pool_indices, pb.seq_lens, 2)
    assert slots.shape == (3, 2, 256)  # padded: few distinct shapes as rows grow
    for b, length in enumerate([5, 17, 9]):
        row = int(pb.req_pool_indices[b])
        assert torch.equal(slots[b, 0, :length], pb.req_to_token[row, :length].int())
        assert (slots[b, :, length:] == -1).all()


def test_batched_decode_refuses_what_it_cannot_serve():
    base = SelectionParams("two_level", 40, 8, 8, 4, 8)
    assert unsupported_override(base, 8) is None
    assert unsupported_override(None, 8) is None  # dense
    assert "block_size" in unsupported_override(dataclasses.replace(base, block_size=16), 8)
    for key, value in (("block_filter", "async"), ("scoring", "output_aware"),
                       ("head_policy", True)):
        why = unsupported_override(dataclasses.replace(base, **{key: value}), 8)
        assert why is not None and key in why


@gpu
@needs_cuda
def test_gpu_mixed_rows_real_shapes():
    """Qwen3-8B heads, 32-token blocks, bf16: mixed rows in one batch against the same
    requests run one setting at a time."""
    lens = [4000, 3000, 5000, 2500, 4500, 3500, 6000, 2200, 4100, 5100]
    _check_mixed(32, 8, 128, 32, lens, torch.bfloat16, dict(rtol=2e-2, atol=2e-2))


def test_triton_servers_take_request_settings_they_can_serve(monkeypatch):
    """At arrival (ValueError = a 400): a triton server takes method / budget / candidate
    blocks / block_score overrides and dense; it refuses, naming why, what the batched decode
    cannot serve and any override beside a server-wide feature that keeps per-row state."""
    from types import SimpleNamespace

    from sglang_ext.config import build_config
    from sglang_ext import runtime
    from sglang_ext.patches import sampling_params

    def arrive(sparse):
        sampling_params._after_verify(None, SimpleNamespace(custom_params={"sparse": sparse}))

    process = runtime.state()
    monkeypatch.setattr(process, "impl", "triton")
    monkeypatch.setattr(process, "mla", False)
    monkeypatch.setattr(process, "config", build_config(budget=256, block_size=32))
    for ok in ({"method": "dense"}, {"method": "quest", "budget": 512},
               {"method": "ds", "budget": 128}, {"candidate_blocks": 40},
               {"block_score": "bound"}, {"method": "two_level", "block_score": "label_max"}):
        arrive(ok)
    for bad, why in (({"block_size": 16}, "block_size 16 differs"),
                     ({"block_filter": "async"}, "block_filter 'async' needs --sparse-impl "
                                                 "reference")):
        with pytest.raises(ValueError, match=why):
            arrive(bad)
    monkeypatch.setattr(process, "config", build_config(budget=256, block_size=32,
                                                        guard_every=8))
    with pytest.raises(ValueError, match="do not combine with --sparse-guard-every"):
        arrive({"method": "dense"})
