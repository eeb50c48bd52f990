"""SGLANG_EXT_SYNTHETIC_KV=random (sglang_ext/attention/synthetic_kv.py): the KV a decode-only
benchmark decodes over. Every slot of SGLang's own (CPU) pool gets random keys and values, and
the backend's page summaries and label cache must be exactly what the summary and label
references build from those keys as stored, for a bf16 and an fp8 cache, in one chunk or many."""

from types import SimpleNamespace

import pytest
import torch

from cpu_backend import cpu_mha_pool, cpu_sparse_backend
from sglang_ext import runtime
from sglang_ext.attention.synthetic_kv import ENV, fill_synthetic_kv, install, unsupported_reason
from sglang_ext.kernels.block_summary import allocate_block_summaries, update_block_summaries_ref
from sglang_ext.kernels.decode_write import FP8_KV
from sglang_ext.kernels.label_cache import allocate_label_cache, update_label_cache_ref

HQ, HKV, D, LAYERS, PAGE, PAGES = 4, 2, 16, 2, 4, 12
CHANNELS = [[[0, 7, 15], [2, 3, 9]], [[1, 4, 5], [6, 8, 10]]]


@pytest.fixture(autouse=True)
def _own_listeners(monkeypatch):
    """Each test installs the benchmark hook into a process state of its own."""
    monkeypatch.setattr(runtime.state(), "backend_listeners", [])


def _backend(tmp_path, kv_dtype, side_dtype):
    install()  # what the plugin does in every server process
    pool = cpu_mha_pool(kv_dtype, HKV, D, LAYERS, PAGE, PAGES)
    table = torch.zeros(4, 32, dtype=torch.int32)
    return cpu_sparse_backend(tmp_path, pool, table, HQ, CHANNELS, side_dtype)


def _bytes(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _assert_summaries_and_labels_match_keys(backend):
    pool = backend.token_to_kv_pool
    for layer in range(LAYERS):
        keys = pool.get_key_buffer(layer).to(torch.bfloat16)  # as stored
        values = pool.get_value_buffer(layer).float()
        assert keys.float().abs().mean() > 0.5 and values.abs().mean() > 0.5  # not zeros
        loc = torch.arange(keys.shape[0])
        kmin, kmax = allocate_block_summaries(keys.shape[0], HKV, D, PAGE, "cpu",
                                              backend.decoder.summaries.kmin[layer].dtype)
        update_block_summaries_ref(kmin, kmax, keys, loc, PAGE)
        assert torch.equal(_bytes(backend.decoder.summaries.kmin[layer]), _bytes(kmin))
        assert torch.equal(_bytes(backend.decoder.summaries.kmax[layer]), _bytes(kmax))
        labels = allocate_label_cache(keys.shape[0], HKV, 3, "cpu", backend.decoder.labels[layer].dtype)
        update_label_cache_ref(labels, keys, loc, backend.ctx.files.label_channels[layer])
        assert torch.equal(_bytes(backend.decoder.labels[layer]), _bytes(labels))


@pytest.mark.parametrize("kv_dtype,side_dtype", [(torch.bfloat16, "auto"),
                                                 (FP8_KV, "fp8_e4m3")], ids=["bf16", "fp8"])
def test_start_up_fill_builds_summaries_and_labels_of_the_random_keys(
        tmp_path, monkeypatch, kv_dtype, side_dtype):
    monkeypatch.setenv(ENV, "random")
    backend = _backend(tmp_path, kv_dtype, side_dtype)
    _assert_summaries_and_labels_match_keys(backend)
    again = _backend(tmp_path, kv_dtype, side_dtype)  # seeded: every server fills alike
    for layer in range(LAYERS):
        assert torch.equal(_bytes(again.token_to_kv_pool.get_key_buffer(layer)),
                           _bytes(backend.token_to_kv_pool.get_key_buffer(layer)))


def test_a_fill_in_many_chunks_rebuilds_every_page(tmp_path, monkeypatch):
    """Chunks of two pages over a pool whose summaries already hold other keys: each page's
    summary is its own keys' (a chunk starts on a page boundary, which restarts the page)."""
    monkeypatch.setenv(ENV, "random")
    backend = _backend(tmp_path, FP8_KV, "fp8_e4m3")
    assert fill_synthetic_kv(backend, seed=7, chunk_tokens=2 * PAGE + 1) == PAGES * PAGE + PAGE
    _assert_summaries_and_labels_match_keys(backend)


def test_unset_leaves_the_pool_zeroed(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    backend = _backend(tmp_path, torch.bfloat16, "auto")
    assert not backend.token_to_kv_pool.get_key_buffer(0).any()


def test_a_bad_mode_stops_start_up_with_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, "zeros")
    with pytest.raises(SystemExit, match=f"{ENV}='zeros' is not one of off, random"):
        _backend(tmp_path, torch.bfloat16, "auto")


@pytest.mark.parametrize("field,value,why", [("tiered", object(), "CPU tier"),
                                             ("kv_lora_rank", 64, "MLA"),
                                             ("locality_blocks", 2, "locality constraint")])
def test_pools_it_cannot_fill_are_refused(field, value, why):
    ctx = SimpleNamespace(tiered=None, kv_lora_rank=None,
                          config=SimpleNamespace(locality_blocks=0))
    setattr(ctx.config if field == "locality_blocks" else ctx, field, value)
    backend = SimpleNamespace(ctx=ctx)
    assert why in unsupported_reason(backend)
    with pytest.raises(ValueError, match=why):
        fill_synthetic_kv(backend)
