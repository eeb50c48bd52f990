"""KV pool sizing without the CPU tier (patches/kv_cache_configurator.py): the batched decode's
page summaries and label cache are allocated after SGLang's KV pool, so the pool's token count
shrinks by their share of the per-token bytes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.kv_cache_configurator import _PoolSizes

from sglang_ext.config import build_config
from sglang_ext.patches.kv_cache_configurator import (
    _around_build_mla_kv_pool,
    _around_derive_pool_sizes,
    side_buffer_share,
)
from sglang_ext.patches.server_args import attach_config


def test_side_buffer_share():
    labels = dict(label_config=__file__)  # any readable file: only its presence matters here
    two_level = build_config(method="two_level", block_size=32, label_channels=16, **labels)
    # bf16, D = Dv = 128: summaries 2*128/32 = 8 values, labels 16, KV 256 values per token
    assert side_buffer_share(two_level, 128, 128, 2) == pytest.approx(24 / 256)
    assert side_buffer_share(build_config(method="two_level", block_size=32), 128, 128, 2) \
        == pytest.approx(8 / 256)  # no label config: no label cache
    assert side_buffer_share(build_config(method="quest", block_size=16, **labels), 128, 128, 2) \
        == pytest.approx(16 / 256)  # quest scores no tokens
    # an 8-bit KV keeps float32 summaries: 8 values x 4 bytes, labels 16 x 1 byte, KV 256 bytes
    assert side_buffer_share(two_level, 128, 128, 1) == pytest.approx((32 + 16) / 256)
    # fp8 labels: one byte per channel beside bf16 KV (16 + 16 bytes of 512)
    fp8 = build_config(method="two_level", block_size=32, label_channels=16,
                       label_dtype="fp8_e4m3", **labels)
    assert side_buffer_share(fp8, 128, 128, 2) == pytest.approx((16 + 16) / 512)
    # and fp8 summaries: 8 values x 1 byte
    fp8s = build_config(method="two_level", block_size=32, label_channels=16,
                        label_dtype="fp8_e4m3", summary_dtype="fp8_e4m3", **labels)
    assert side_buffer_share(fp8s, 128, 128, 2) == pytest.approx((8 + 16) / 512)


def _configurator(device: str, max_total_tokens=None, tier: str = "off", model_config=None):
    server_args = SimpleNamespace(
        attention_backend="sglang_ext", decode_attention_backend=None,
        prefill_attention_backend=None, max_total_tokens=max_total_tokens, device=device,
        page_size=32)
    attach_config(server_args, build_config(method="two_level", block_size=32,
                                            label_channels=16, label_config=__file__, tier=tier))
    return SimpleNamespace(server_args=server_args, is_hybrid_swa=False,
                           model_config=model_config or SimpleNamespace(
                               head_dim=128, v_head_dim=128, get_total_num_kv_heads=lambda: 8),
                           kv_cache_dtype=torch.bfloat16)


def _sizes(tokens: int) -> _PoolSizes:
    return _PoolSizes(max_total_num_tokens=tokens, max_running_requests=64,
                      full_max_total_num_tokens=None, swa_max_total_num_tokens=None,
                      c4_max_total_num_tokens=0, c128_max_total_num_tokens=0,
                      c4_state_pool_size=0, c128_state_pool_size=0, c4_state_dtype=None,
                      c128_state_dtype=None)


def test_pool_shrinks_by_the_side_buffers_on_cuda_only():
    profiled = 1_000_000

    def original(self, *, config):
        return _sizes(profiled)

    sizes = _around_derive_pool_sizes(original, _configurator("cuda"), config=None)
    expected = int(profiled / (1 + 24 / 256)) // 32 * 32
    assert sizes.max_total_num_tokens == expected and expected % 32 == 0
    assert sizes.max_running_requests == 64
    # the reference (CPU) decode keeps no side buffers; an explicit --max-total-tokens wins
    for configurator in (_configurator("cpu"), _configurator("cuda", max_total_tokens=4096)):
        sizes = _around_derive_pool_sizes(original, configurator, config=None)
        assert sizes.max_total_num_tokens == profiled


def test_mla_pool_shrinks_by_its_latent_row_share():
    """An MLA pool stores one row of R + P values per token (V is its latent view): page
    summaries are 2 (R + P) / block values per token, the label cache r, against R + P."""
    from sglang.srt.configs.model_config import AttentionArch

    mla = SimpleNamespace(attention_arch=AttentionArch.MLA, kv_lora_rank=512, qk_rope_head_dim=64,
                          head_dim=256, v_head_dim=128)  # head_dims of the MHA-path prefill
    profiled = 1_000_000
    sizes = _around_derive_pool_sizes(lambda self, *, config: _sizes(profiled),
                                      _configurator("cuda", model_config=mla), config=None)
    share = (2 * 576 / 32 + 16) / 576
    assert sizes.max_total_num_tokens == int(profiled / (1 + share)) // 32 * 32


MLA_RANK, MLA_ROPE, MLA_LAYERS, MLA_BLOCK, MLA_PROFILED = 32, 16, 2, 16, 40_000


def _mla_tier_configurator(device: str, **config: object) -> SimpleNamespace:
    """A small MLA model's configurator with the tier on (``config``: more SparseConfig)."""
    from sglang.srt.configs.model_config import AttentionArch

    mla = SimpleNamespace(attention_arch=AttentionArch.MLA, kv_lora_rank=MLA_RANK,
                          qk_rope_head_dim=MLA_ROPE, head_dim=40, v_head_dim=16, context_len=512)
    server_args = SimpleNamespace(
        attention_backend="sglang_ext", decode_attention_backend=None,
        prefill_attention_backend=None, max_total_tokens=None, device=device,
        page_size=MLA_BLOCK, max_prefill_tokens=256, chunked_prefill_size=256,
        enable_memory_saver=False)
    attach_config(server_args, build_config(block_size=MLA_BLOCK, tier="async", budget=256,
                                            **config))
    return SimpleNamespace(
        server_args=server_args, is_hybrid_swa=False, model_config=mla,
        kv_cache_dtype=torch.bfloat16, device=device,
        layer_info=SimpleNamespace(num_effective_layers=MLA_LAYERS, start_layer=0,
                                   end_layer=MLA_LAYERS))


def test_tier_leaves_room_for_the_label_cache_of_host_tokens(monkeypatch):
    """Under the tier the batched decode's label cache covers the host-homed tokens too: their
    labels (r values a token) come out of the GPU-homed part, beside their page summaries. The
    CPU reference decode keeps no label cache."""
    from sglang_ext import runtime

    monkeypatch.setattr(runtime.state(), "tier_layout", None)
    labels = dict(method="two_level", label_channels=16, label_config=__file__, tier_host_gb=0.01)
    layouts = {}
    for device in ("cpu", "cuda"):
        _around_derive_pool_sizes(lambda self, *, config: _sizes(MLA_PROFILED),
                                  _mla_tier_configurator(device, **labels), config=None)
        layouts[device] = runtime.state().tier_layout
    row = MLA_RANK + MLA_ROPE
    r = (2 * row / MLA_BLOCK + 16) / row  # summaries + labels per latent row
    cuda = layouts["cuda"]
    assert cuda.host_tokens == layouts["cpu"].host_tokens > 0
    assert cuda.gpu_tokens < layouts["cpu"].gpu_tokens
    assert cuda.gpu_tokens <= (MLA_PROFILED * (1 + r) - cuda.work_tokens
                               - cuda.host_tokens * r) / (1 + r)


def test_tier_sizes_mla_by_the_latent_row_and_builds_the_tiered_mla_pool(monkeypatch):
    """With --sparse-tier on an MLA model, host tokens are counted in latent rows (R + P values
    per layer, one head on every rank, no V), the summaries' device share is 2 (R + P) / block
    per row, and the _build_mla_kv_pool hook builds TieredMLAKVPool over the layout's G + W
    device rows (SGLang's factory builds MLATokenToKVPool itself: no pool class to pass)."""
    from sglang_ext.memory_tier.tiered_pool import TieredMLAKVPool
    from sglang_ext import runtime

    # the process's layout, restored afterwards
    monkeypatch.setattr(runtime.state(), "tier_layout", None)
    host_gb = 0.001
    configurator = _mla_tier_configurator("cpu", method="quest", tier_host_gb=host_gb)
    sizes = _around_derive_pool_sizes(lambda self, *, config: _sizes(MLA_PROFILED), configurator,
                                      config=None)
    layout = runtime.state().tier_layout
    rank, rope, layers, block, profiled = MLA_RANK, MLA_ROPE, MLA_LAYERS, MLA_BLOCK, MLA_PROFILED
    row_bytes = layers * (rank + rope) * 2  # one latent row per layer, bf16
    assert layout.host_tokens == int(host_gb * 1e9) // row_bytes // block * block
    assert sizes.max_total_num_tokens == layout.gpu_tokens + layout.host_tokens
    r = 2 / block  # summaries (min + max of R + P dims per block) per (R + P)-value row
    assert layout.gpu_tokens <= (profiled * (1 + r) - layout.work_tokens - layout.host_tokens * r) / (1 + r)

    def plain(self, *, max_total_num_tokens):  # the hook must not build the plain pool
        raise AssertionError("built the untiered MLA pool")

    pool = _around_build_mla_kv_pool(plain, configurator,
                                           max_total_num_tokens=sizes.max_total_num_tokens)
    assert isinstance(pool, TieredMLAKVPool) and pool.logical_size == sizes.max_total_num_tokens
    assert pool.kv_buffer[0].shape == (layout.device_tokens + block, 1, rank + rope)
    assert pool.host.v is None and pool.host.k[0].shape == (1, layout.host_tokens, rank + rope)
