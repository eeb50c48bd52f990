"""The CPU tier's pool over an 8-bit KV cache (``--kv-cache-dtype fp8_e4m3``), on the CPU.

SGLang stores an fp8 cache as ``uint8`` bytes (``MHATokenToKVPool.store_dtype``) and reads it back
viewed as fp8. The tier keeps its host copy in fp8 too (one byte per value: host bytes, and the
bytes each transfer moves, are half of bf16's), moves rows as their bytes (writes through, block
loads, the extend scratch) and hands the backend fp8 rows, as SGLang's own pool does. The same
prompt written through a bf16 pool and an fp8 pool: every copy of the fp8 pool holds exactly the
bf16 values rounded to fp8, through prefill (the scratch), start of decoding (sink, ring and
working-set pages loaded from the host) and decode writes; the device copies match their homes
(``verify_mappings``) and nothing leaks.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from sglang_ext.memory_tier.host_store import HostKVStore, as_stored, same_bytes
from sglang_ext.memory_tier.tiered_pool import TieredKVPool, plan_layout

FP8 = torch.float8_e4m3fn
PS, HEADS, DIM, LAYERS = 4, 2, 8, 2
GPU_TOKENS = 64  # a prompt's first pages on the GPU, the rest on the host
PROMPT = 90


def _pool(dtype: torch.dtype) -> tuple[TieredKVPool, torch.Tensor]:
    layout = plan_layout(device_tokens=0, host_tokens=1024, page_size=PS, max_running_requests=2,
                         max_prefill_tokens=PROMPT + PS, num_slots=6, sink=PS, window=2 * PS,
                         side_tokens_per_token=1 / PS, gpu_tokens=GPU_TOKENS)
    pool = TieredKVPool(PS, dtype, HEADS, DIM, LAYERS, "cpu", False, layout=layout, mode="sync")
    req_to_token = torch.zeros((2, 2 * PROMPT), dtype=torch.int32)
    req_to_token[1] = torch.arange(32, 32 + 2 * PROMPT, dtype=torch.int32)  # crosses G
    pool.bind(req_to_token)
    return pool, req_to_token


def _kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, HEADS, DIM, generator=g).to(torch.bfloat16) * 4,
            torch.randn(n, HEADS, DIM, generator=g).to(torch.bfloat16))


def test_as_stored_reinterprets_fp8_bytes_and_casts_the_rest():
    x = torch.randn(5, 3).to(FP8)
    raw = as_stored(x, torch.uint8)
    assert raw.dtype == torch.uint8 and raw.data_ptr() == x.data_ptr()
    assert torch.equal(as_stored(raw, FP8).float(), x.float())
    assert same_bytes(FP8, torch.uint8) and not same_bytes(torch.float16, torch.bfloat16)
    y = torch.randn(4, dtype=torch.float32)
    assert as_stored(y, torch.bfloat16).dtype == torch.bfloat16  # a numeric cast


def test_host_store_moves_fp8_rows_into_uint8_device_buffers():
    store = HostKVStore(1, HEADS, DIM, DIM, 16, PS, FP8)
    k, v = (x.to(FP8) for x in _kv(16, 1))
    store.write(0, torch.arange(16, dtype=torch.int32), k.view(torch.uint8), v)  # stored bytes
    assert store.k[0].dtype == FP8 and store.nbytes == 2 * HEADS * 16 * DIM  # one byte a value
    dev_k = torch.zeros((16, HEADS, DIM), dtype=torch.uint8)
    dev_v = torch.zeros((16, HEADS, DIM), dtype=torch.uint8)
    store.load(0, torch.tensor([0, 1], dtype=torch.int32), torch.tensor([2, 2], dtype=torch.int32),
               torch.tensor([1, 1], dtype=torch.int32), dev_k, dev_v)
    assert torch.equal(dev_k[4:8].view(FP8).float(), k[8:12].float())
    assert torch.equal(dev_v[4:8].view(FP8).float(), v[8:12].float())


def test_an_fp8_pool_holds_the_fp8_rounding_of_what_a_bf16_pool_holds():
    pools = {dt: _pool(dt) for dt in (torch.bfloat16, FP8)}
    (bf, r2t), (f8, _) = pools[torch.bfloat16], pools[FP8]
    assert f8.store_dtype == torch.uint8 and f8.host.k[0].dtype == FP8
    assert f8.tier_page_bytes * 2 == bf.tier_page_bytes  # half the bytes per transfer
    assert f8.host.nbytes * 2 == bf.host.nbytes  # and per host token
    assert f8.request_step_bytes(0) * 2 == bf.request_step_bytes(0)
    loc = r2t[1, :PROMPT].long()
    for pool, _ in pools.values():
        pool.prepare_extend(r2t, [1], [PROMPT], [0])  # host pages: through the scratch
        for layer in range(LAYERS):
            k, v = _kv(PROMPT, layer)
            pool.set_kv_buffer(SimpleNamespace(layer_id=layer), KVWriteLoc(loc, None, None), k, v)
            key_rows = pool.get_key_buffer(layer)  # the scratch, as the extend reads it
            assert key_rows.dtype == pool.dtype
            got = key_rows[pool.written_rows(loc, layer)]
            assert torch.equal(got.float(), k.to(pool.dtype).float())
            assert pool.get_value_buffer(layer).dtype == pool.dtype
    for layer in range(LAYERS):
        for want, got in zip(bf.gather_tokens(layer, loc), f8.gather_tokens(layer, loc)):
            assert got.dtype == FP8
            assert torch.equal(got.float(), want.to(FP8).float())
    for pool, _ in pools.values():
        pool.start_decoding(r2t, 1)  # sink, ring and working-set pages loaded from the host
        pool.verify_mappings(r2t, [1], [PROMPT + 1])
        # a decode token (host-homed: written to its ring page and through to the host)
        pos = PROMPT
        out = r2t[1, pos:pos + 1].long()
        pool.map_decode_tokens(r2t, torch.tensor([1]), torch.tensor([pos + 1]), out)
        for layer in range(LAYERS):
            k, v = _kv(1, 100 + layer)
            pool.set_kv_buffer(SimpleNamespace(layer_id=layer), out, k, v)
            home_k, _ = pool.gather_tokens(layer, out)
            assert torch.equal(home_k.float(), k.to(pool.dtype).float())
        pool.verify_mappings(r2t, [1], [PROMPT + 2])
        pool.release_row(1, r2t)
        pool.check_idle()


def test_fp8_scales_are_applied_once_to_every_copy():
    """A checkpoint's KV scale divides the rows before the fp8 cast (SGLang's set_kv_buffer, in
    place); the device rows and the host copy hold the same scaled values."""
    pool, r2t = _pool(FP8)
    loc = r2t[1, :PROMPT].long()
    pool.prepare_extend(r2t, [1], [PROMPT], [0])
    k, v = _kv(PROMPT, 7)
    want_k, want_v = (k / 2).to(FP8), (v / 4).to(FP8)
    pool.set_kv_buffer(SimpleNamespace(layer_id=0), KVWriteLoc(loc, None, None), k.clone(),
                       v.clone(), 2.0, 4.0)
    got_k, got_v = pool.gather_tokens(0, loc)
    assert torch.equal(got_k.float(), want_k.float())
    assert torch.equal(got_v.float(), want_v.float())
    pool.release_row(1, r2t)


def test_other_stored_dtypes_are_refused_in_one_line():
    """A stored dtype that is neither the KV dtype nor its bytes (or a quantised FP4 cache,
    whose scales the tier does not move) is refused when the pool is built."""
    pool, _ = _pool(torch.bfloat16)
    pool.store_dtype = torch.float16
    with pytest.raises(ValueError, match="does not support a KV cache stored as") as e:
        pool.tier_shape()
    assert "\n" not in str(e.value)
    pool, _ = _pool(FP8)
    pool.quant_method = object()  # not SGLang's UnquantizedKVCacheMethod: a quantised cache
    with pytest.raises(ValueError, match="does not support a KV cache stored as"):
        pool.tier_shape()
