"""The backend on SGLang's MLA KV pool (MLATokenToKVPool), driven the way a DeepSeek-V2 layer
drives it (selection/mla.py describes the contract; no server, no model):

* prefill of prompts without a cached prefix: the model writes the latent rows itself
  (``set_mla_kv_buffer`` on CUDA, ``set_kv_buffer`` of the whole row elsewhere), then calls
  ``forward_extend`` with the per-head MHA q/k/v and ``save_kv_cache=False`` (that attention is
  the dense delegate's, stubbed here: SGLang's torch_native cannot run it);
* decode steps: ``forward_decode(q = absorbed query [B, Hq, R + P], k = latent row [B, 1, R + P],
  v = its latent part [B, 1, R])`` on the attn_mqa layer, which stores ``k``.

Each step's output must equal SGLang's own MLA decode on the same pool (torch_native's SDPA
over get_key_buffer / get_value_buffer) when the budget covers the context, and the MLA
reference selection + attention (selection/mla.py) when it does not; the batched path's page
summaries and label cache must hold the latent rows actually stored. On the CPU the batched
kernels run in Triton's interpreter at small shapes; the ``gpu`` case uses DeepSeek-V2-Lite's
layer shapes.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from sglang_ext.attention.sparse_backend import SparseDecodeBackend
from sglang_ext.config import build_config
from sglang_ext.selection.calibrate import FORMAT as LABELS_FORMAT
from sglang_ext.selection.mla import mla_sparse_decode

from fake_backend import DecodeMode, ExtendMode, FakeReqToTokenPool

SMALL = dict(hq=4, rank=32, rope=16, qk_nope=24, v_head=16, page=4)
DEEPSEEK_V2_LITE = dict(hq=16, rank=512, rope=64, qk_nope=128, v_head=128, page=32)
STEPS = 4  # decode steps after the prefill


class MhaPrefillDelegate:
    """SGLang's dense backend for the MHA-path prefill: only how it is called matters here."""

    def __init__(self, v_head: int) -> None:
        self.v_head = v_head
        self.calls = 0

    def init_forward_metadata(self, forward_batch) -> None:
        """Nothing to plan: forward_extend below only records the call and returns zeros."""

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        assert not save_kv_cache  # the latent rows were written by the model
        self.calls += 1
        return q.new_zeros(q.shape[0], layer.tp_q_head_num * self.v_head)


def _label_config(path, channels: list[int], dims: int) -> str:
    path.write_text(json.dumps({
        "format": LABELS_FORMAT, "model": {"num_layers": 1, "num_kv_heads": 1, "head_dim": dims},
        "label_channels": len(channels), "channels": [[channels]]}))
    return str(path)


def _run(tmp_path, *, impl: str, budget: int, writer: str, dtype: torch.dtype, lens: list[int],
         shapes: dict, device: str = "cpu", seed: int = 0) -> None:
    from sglang.srt.configs.model_config import AttentionArch
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    hq, rank, rope, page = shapes["hq"], shapes["rank"], shapes["rope"], shapes["page"]
    dims = rank + rope
    scaling = (shapes["qk_nope"] + rope) ** -0.5  # DeepSeek's scale, not (R + P)^-0.5
    gen = torch.Generator().manual_seed(seed)
    max_context = max(lens) + STEPS
    pages_per_req = -(-max_context // page)
    num_pages = 2 + len(lens) * pages_per_req
    pool = MLATokenToKVPool(size=num_pages * page, page_size=page, dtype=dtype, kv_lora_rank=rank,
                            qk_rope_head_dim=rope, layer_num=1, device=device,
                            enable_memory_saver=False)
    channels = [0, 5, rank - 1, rank, dims - 1]  # latent and RoPE dims alike
    cfg = build_config(method="two_level", budget=budget, block_size=page, sink=4, window=8,
                       impl=impl, label_channels=len(channels),
                       label_config=_label_config(tmp_path / "labels.json", channels,
                                                             dims))
    rows = [3, 1, 6][: len(lens)]  # scattered request rows, never 0
    runner = SimpleNamespace(
        device=device,
        req_to_token_pool=FakeReqToTokenPool(
            torch.zeros(8, max_context, dtype=torch.int32, device=device)),
        token_to_kv_pool=pool,
        model_config=SimpleNamespace(attention_arch=AttentionArch.MLA, kv_lora_rank=rank,
                                     qk_rope_head_dim=rope, num_hidden_layers=1,
                                     num_attention_heads=hq),
        server_args=SimpleNamespace(page_size=page, enable_metrics=False),
        dtype=dtype,
    )
    backend = SparseDecodeBackend(runner, cfg)
    delegate = backend._dense = MhaPrefillDelegate(shapes["v_head"])
    table = runner.req_to_token_pool.req_to_token
    # Each request owns whole pages, scattered (page 0 is SGLang's padding page).
    pages = (torch.randperm(num_pages - 1, generator=gen) + 1)[: len(lens) * pages_per_req]
    for i, row in enumerate(rows):
        own = pages[i * pages_per_req : (i + 1) * pages_per_req]
        slots = (own[:, None] * page + torch.arange(page)).flatten()[:max_context]
        table[row] = slots.int().to(device)
    common = dict(tp_q_head_num=hq, scaling=scaling, layer_id=0, is_cross_attention=False,
                  attn_type=AttentionType.DECODER, sliding_window_size=-1)
    attn_mha = SimpleNamespace(tp_k_head_num=hq, qk_head_dim=shapes["qk_nope"] + rope,
                               v_head_dim=shapes["v_head"], **common)
    attn_mqa = SimpleNamespace(tp_k_head_num=1, qk_head_dim=dims, v_head_dim=rank, **common)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)

    # ---- prefill (MHA path): the model writes the latent rows, then calls attention
    row_idx = torch.tensor(rows, device=device)
    loc = torch.cat([table[row, :n] for row, n in zip(rows, lens)]).long()
    latent = rand(loc.shape[0], 1, dims)
    if writer == "set_mla_kv_buffer":  # SGLang's model on CUDA
        pool.set_mla_kv_buffer(attn_mha, loc, latent[..., :rank], latent[..., rank:])
    else:  # elsewhere: the whole row through set_kv_buffer
        pool.set_kv_buffer(attn_mha, loc, latent, None)
    seq = torch.tensor(lens, device=device)
    extend = SimpleNamespace(
        forward_mode=ExtendMode(), req_pool_indices=row_idx, seq_lens=seq, seq_lens_cpu=seq.cpu(),
        extend_seq_lens_cpu=list(lens), extend_prefix_lens_cpu=[0] * len(lens),
        extend_prefix_lens=torch.zeros_like(seq), extend_seq_lens=seq, out_cache_loc=loc,
        encoder_lens=None)
    backend.init_forward_metadata(extend)
    tokens = loc.shape[0]
    mha_dims = shapes["qk_nope"] + rope
    backend.forward_extend(rand(tokens, hq * mha_dims), rand(tokens, hq * mha_dims),
                           rand(tokens, hq * shapes["v_head"]), attn_mha, extend,
                           save_kv_cache=False)
    assert delegate.calls == 1
    k_buf, v_buf = pool.get_key_buffer(0), pool.get_value_buffer(0)
    if getattr(backend.decoder, "summaries", None) is not None:
        _check_side_buffers(backend, table, rows, lens, k_buf, channels, page)

    # ---- decode steps
    labels = torch.tensor([channels], device=device)
    params = backend.default_params
    for _ in range(STEPS):
        lens = [n + 1 for n in lens]
        seq = torch.tensor(lens, device=device)
        new_loc = torch.stack([table[row, n - 1] for row, n in zip(rows, lens)]).long()
        batch = SimpleNamespace(forward_mode=DecodeMode(), batch_size=len(rows),
                                req_pool_indices=row_idx, seq_lens=seq, seq_lens_cpu=seq.cpu(),
                                out_cache_loc=new_loc)
        backend.init_forward_metadata(batch)
        q = rand(len(rows), hq, dims)
        k_new = rand(len(rows), 1, dims)
        out = backend.forward_decode(q, k_new, k_new[..., :rank], attn_mqa, batch)
        out = out.view(len(rows), hq, rank)
        assert torch.equal(k_buf[new_loc], k_new)  # stored, once, by us
        sglang_out = torch.empty_like(out)
        TorchNativeAttnBackend._run_sdpa_forward_decode(
            None, q, sglang_out, k_buf, v_buf, table, row_idx, seq, scaling=scaling,
            enable_gqa=True)
        tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
        for i, (row, n) in enumerate(zip(rows, lens)):
            if n <= budget:  # dense: SGLang's own MLA decode (bit-identical on the reference)
                if impl == "reference":
                    assert torch.equal(out[i], sglang_out[i]), f"request {i} (L={n})"
                else:
                    torch.testing.assert_close(out[i], sglang_out[i], **tol)
            else:
                keys = k_buf[table[row, :n].long()]
                expected = mla_sparse_decode(q[i], keys, params, scaling, rank, labels)
                torch.testing.assert_close(out[i], expected, **tol)
        if getattr(backend.decoder, "summaries", None) is not None:
            _check_side_buffers(backend, table, rows, lens, k_buf, channels, page)


def _check_side_buffers(backend, table, rows, lens, k_buf, channels, page) -> None:
    """Every page's min/max and every token's label channels are those of the latent rows
    stored in the pool (not of the MHA keys the prefill passed)."""
    kmin, kmax = backend.decoder.summaries.kmin[0], backend.decoder.summaries.kmax[0]
    for row, n in zip(rows, lens):
        slots = table[row, :n].long()
        for start in range(0, n, page):
            rows_here = k_buf[slots[start : start + page]]
            p = int(slots[start]) // page
            assert torch.equal(kmin[p], rows_here.amin(0)) and torch.equal(kmax[p], rows_here.amax(0))
        assert torch.equal(backend.decoder.labels[0][slots], k_buf[slots][..., channels])


@pytest.mark.parametrize("impl, budget, writer, dtype", [
    ("reference", 512, "set_kv_buffer", torch.bfloat16),
    ("reference", 24, "set_mla_kv_buffer", torch.float32),
    ("triton", 512, "set_mla_kv_buffer", torch.float32),
    ("triton", 24, "set_kv_buffer", torch.float32),
])
def test_mla_pool_prefill_then_decode(tmp_path, impl, budget, writer, dtype):
    _run(tmp_path, impl=impl, budget=budget, writer=writer, dtype=dtype, lens=[13, 40, 70],
         shapes=SMALL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("budget", [8192, 512])
def test_mla_pool_prefill_then_decode_gpu(tmp_path, budget):
    """DeepSeek-V2-Lite's layer (16 heads, 512 + 64, bf16, page 32) on the batched kernels."""
    _run(tmp_path, impl="triton", budget=budget, writer="set_mla_kv_buffer", dtype=torch.bfloat16,
         lens=[100, 2000, 5000], shapes=DEEPSEEK_V2_LITE, device="cuda")


def test_backend_refuses_what_mla_lacks(tmp_path):
    """sgl.Engine builds the backend without our start-up checks: it refuses too."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    pool = MLATokenToKVPool(size=64, page_size=4, dtype=torch.float32, kv_lora_rank=32,
                            qk_rope_head_dim=16, layer_num=1, device="cpu",
                            enable_memory_saver=False)
    runner = SimpleNamespace(device="cpu", token_to_kv_pool=pool, req_to_token_pool=None)
    cfg = build_config(method="two_level", scoring="output_aware", impl="reference")
    with pytest.raises(ValueError, match=r"--sparse-scoring output_aware does not support MLA"):
        SparseDecodeBackend(runner, cfg)
