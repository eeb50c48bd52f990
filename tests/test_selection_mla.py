"""The MLA sparse decode reference (sglang_ext/selection/mla.py) against written-out oracles
and against SGLang's own MLA decode on its MLA KV pool.

Small MLA shapes: latent R = 32 plus RoPE P = 16 per row, Hq = 8 heads sharing the one latent
head, so the per-head loops of the oracles stay cheap on a CPU.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from sglang_ext.selection import SelectionParams, block_minmax
from sglang_ext.selection.mla import (
    mla_block_scores,
    mla_dense_decode,
    mla_select_token_mask,
    mla_sparse_decode,
    mla_sparse_decode_with_lse,
    mla_token_scores,
    mla_values,
)

HQ, R, P = 8, 32, 16
# DeepSeek-V2's softmax scale (qk_nope + qk_rope)^-0.5, deliberately not (R + P)^-0.5
SCALING = (128 + 64) ** -0.5


def _gen(*case: object) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))


def _rows(gen: torch.Generator, length: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(absorbed q [Hq, R + P], latent rows [L, 1, R + P]) of one decode step."""
    q = torch.randn(HQ, R + P, generator=gen) * 2
    keys = torch.randn(length, 1, R + P, generator=gen)
    return q.to(dtype), keys.to(dtype)


def _params(method: str, budget: int, bs: int = 8) -> SelectionParams:
    return SelectionParams(method, budget, bs, candidate_blocks=6, sink=4, window=8)


@pytest.mark.parametrize("method", ["quest", "ds", "two_level"])
def test_budget_covering_context_is_dense_mla(method):
    """budget >= context: exactly softmax(q·K^T·scaling)·K[:, :R]."""
    for length in (1, 37, 96):
        q, keys = _rows(_gen("dense", method, length), length)
        out = mla_sparse_decode(q, keys, _params(method, 96), SCALING, R)
        torch.testing.assert_close(out, mla_dense_decode(q, keys, SCALING, R), rtol=1e-5, atol=1e-6)
        assert out.shape == (HQ, R)


def test_values_are_a_view_of_the_latent_part():
    keys = torch.randn(5, 1, R + P)
    v = mla_values(keys, R)
    assert v.data_ptr() == keys.data_ptr() and v.shape == (5, 1, R) and v.stride() == keys.stride()


def test_block_bound_covers_every_head_and_token():
    """The block score is at least max over heads of q_h·k for every token of the block (the
    max aggregation keeps Quest's guarantee for the head that needs the token most)."""
    q, keys = _rows(_gen("bound"), 61)
    bs = 8
    scores = mla_block_scores(q, *block_minmax(keys, bs))  # [1, NB]
    logits = q.double() @ keys[:, 0].double().T  # [Hq, L]
    per_token = logits.amax(dim=0)
    for j in range(scores.shape[1]):
        block_max = per_token[j * bs : (j + 1) * bs].max()
        assert scores[0, j] >= block_max - 1e-4
    # and it is the max over heads of each head's own bound, written out
    kmin, kmax = block_minmax(keys, bs)
    per_head = (q.clamp(min=0) @ kmax[:, 0].T + q.clamp(max=0) @ kmin[:, 0].T)  # [Hq, NB]
    torch.testing.assert_close(scores[0], per_head.amax(dim=0))


def test_token_scores_labels_and_exact():
    q, keys = _rows(_gen("tokens"), 40)
    exact = mla_token_scores(q, keys, None)
    torch.testing.assert_close(exact[0], (q @ keys[:, 0].T).amax(dim=0))
    channels = torch.tensor([[0, 5, R - 1, R, R + P - 1]])  # latent and RoPE dims alike
    labelled = mla_token_scores(q, keys, channels)
    torch.testing.assert_close(labelled[0], (q[:, channels[0]] @ keys[:, 0, channels[0]].T).amax(dim=0))


@pytest.mark.parametrize("method", ["quest", "ds", "two_level"])
def test_sparse_output_is_attention_over_the_selected_rows(method):
    """budget < context: one token set for all heads, softmax over it only, V = latent part."""
    length = 160
    q, keys = _rows(_gen("sparse", method), length)
    params = _params(method, 48)
    mask = mla_select_token_mask(q, keys, params, R)
    assert mask.shape == (1, length)
    assert int(mask.sum()) <= params.budget
    assert mask[0, : params.sink].all() and mask[0, length - params.window :].all()
    sel = mask[0].nonzero().flatten()
    out, lse = mla_sparse_decode_with_lse(q, keys, params, SCALING, R)
    expect = mla_dense_decode(q, keys[sel], SCALING, R)
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-6)
    logits = q.double() @ keys[sel, 0].double().T * SCALING
    torch.testing.assert_close(lse.double(), torch.logsumexp(logits, dim=-1), rtol=1e-5, atol=1e-5)


def test_rejects_non_mla_shapes():
    q, keys = _rows(_gen("shapes"), 20)
    with pytest.raises(ValueError):
        mla_select_token_mask(q, keys.expand(-1, 2, -1), _params("quest", 16), R)
    with pytest.raises(ValueError):
        mla_select_token_mask(q[:, :R], keys, _params("quest", 16), R)


def test_equals_sglang_mla_decode_on_its_pool():
    """budget >= context on SGLang's MLATokenToKVPool (bf16): the same outputs as SGLang's
    torch_native decode, which reads get_key_buffer / get_value_buffer (the strided latent
    view) with one kv head, the way its MLA backends see the pool."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    page, lens = 4, [1, 23, 64]
    pool = MLATokenToKVPool(size=128, page_size=page, dtype=torch.bfloat16, kv_lora_rank=R,
                            qk_rope_head_dim=P, layer_num=1, device="cpu",
                            enable_memory_saver=False)
    gen = _gen("sglang-pool")
    req_to_token = torch.zeros(len(lens) + 1, 64, dtype=torch.int32)
    free = (torch.randperm(128 - page, generator=gen) + page).int()  # slots past the padding page
    start = 0
    for i, n in enumerate(lens):
        req_to_token[i + 1, :n] = free[start : start + n]
        start += n
    k_buf, v_buf = pool.get_key_buffer(0), pool.get_value_buffer(0)
    assert k_buf.shape[1:] == (1, R + P) and v_buf.data_ptr() == k_buf.data_ptr()
    k_buf.copy_(torch.randn(k_buf.shape, generator=gen).to(k_buf.dtype))
    q = (torch.randn(len(lens), HQ, R + P, generator=gen) * 2).to(torch.bfloat16)
    out = torch.empty(len(lens), HQ, R, dtype=torch.bfloat16)
    TorchNativeAttnBackend._run_sdpa_forward_decode(
        None, q, out, k_buf, v_buf, req_to_token, torch.arange(1, len(lens) + 1),
        torch.tensor(lens), scaling=SCALING, enable_gqa=True)
    for i, n in enumerate(lens):
        keys = k_buf[req_to_token[i + 1, :n].long()]
        ours = mla_sparse_decode(q[i], keys, _params("two_level", 64), SCALING, R)
        torch.testing.assert_close(ours.float(), out[i].float(), rtol=1e-2, atol=1e-2)
