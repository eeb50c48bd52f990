"""The CPU tier on SGLang's MLA pool (TieredMLAKVPool: one latent row of R + P values per token
and layer, V its [:R] view), driven through the backend the way a DeepSeek-V2 layer drives it
(tests/test_backend_mla.py describes that contract):

* host round trip: latent rows written through to the host store (one buffer per layer, no V)
  and gathered back by block into the device pool are bit-exact, V view included, with the
  Triton scatter/gather kernels and with the store's plain-torch CPU path;
* greedy decode of a tiny MLA "model" (per-token latent rows and absorbed queries from
  embedding tables, logits from the attention outputs) emits the same tokens, with bit-equal
  attention outputs at every step and layer, whether the backend runs on the tiered pool
  (prompt KV homed on the host, only sink/ring pages and working sets on the device) or on a
  plain MLA pool holding everything: under both schedules with a budget >= the context, under
  ``sync`` with a smaller one (the same rules as tests/test_tier_decode_steps.py for MHA);
* finish and abort (before or after the first decode step) free every working-area page and
  mapping (``check_idle``).

Everything runs on the CPU (the kernels in Triton's interpreter) at small shapes; the ``gpu``
cases repeat the greedy comparison on CUDA at DeepSeek-V2-Lite's layer shapes (16 heads on one
512 + 64 latent row, 32-token pages), where the async schedule's side stream, the pinned host
store and the compiled kernels run.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from sglang_ext.attention.request_overrides import selection_params
from sglang_ext.attention.sparse_backend import SparseDecodeBackend
from sglang_ext.config import build_config, dense_middle_blocks
from sglang_ext.kernels.host_gather import gather_host_blocks
from sglang_ext.kernels.host_scatter import scatter_to_host, scatter_to_host_ref
from sglang_ext.kernels.sparse_decode import selection_sizes
from sglang_ext.memory_tier.host_store import HostKVStore
from sglang_ext.memory_tier.tiered_pool import TieredMLAKVPool, plan_layout

from fake_backend import DecodeMode, FakeReqToTokenPool
from test_backend_mla import ExtendMode, MhaPrefillDelegate

gpu = pytest.mark.gpu


@dataclass(frozen=True)
class MlaShape:
    hq: int = 4
    rank: int = 32  # kv_lora_rank R
    rope: int = 16  # qk_rope_head_dim P
    qk_nope: int = 24
    v_head: int = 16
    page: int = 4
    sink: int = 4
    window: int = 8
    layers: int = 2
    vocab: int = 64
    device: str = "cpu"

    @property
    def dims(self) -> int:
        return self.rank + self.rope


SMALL = MlaShape()
# DeepSeek-V2-Lite's attention layer; the server's sink / window at its 32-token pages.
DEEPSEEK_V2_LITE_GPU = MlaShape(hq=16, rank=512, rope=64, qk_nope=128, v_head=128, page=32,
                                sink=32, window=64, layers=3, vocab=256, device="cuda")
# The small shape's names, for the round-trip test below.
RANK, DIMS, PAGE, LAYERS = SMALL.rank, SMALL.dims, SMALL.page, SMALL.layers
POISON = 77.0


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Tiny tensor ops in Triton's interpreter: two threads on two cores only contend (as for
    the kernel tests, tests/conftest.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class TierDecodeMode(DecodeMode):
    def is_decode(self) -> bool:
        return True


def _mla_pool(size: int, dtype: torch.dtype, sh: MlaShape = SMALL, **tier):
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    cls = TieredMLAKVPool if tier else MLATokenToKVPool
    args = dict(page_size=sh.page, dtype=dtype, kv_lora_rank=sh.rank, qk_rope_head_dim=sh.rope,
                layer_num=sh.layers, device=sh.device, enable_memory_saver=False)
    return cls(**args, **tier) if tier else cls(size, **args)


# ------------------------------------------------------------------ host round trip


def test_latent_rows_round_trip_host_to_working_set_bit_exact():
    gen = torch.Generator().manual_seed(0)
    pages, dtype = 6, torch.bfloat16
    rows = torch.randn(pages * PAGE, 1, DIMS, generator=gen).to(dtype)
    loc = torch.randperm(pages * PAGE, generator=gen).int()
    loc[3] = -1  # skipped
    # the kernels (what the GPU runs): scatter to the head-major host buffer, gather back
    host = torch.full((1, pages * PAGE, DIMS), 3.0, dtype=dtype)
    host_ref = host.clone()
    scatter_to_host(rows, host, loc)
    scatter_to_host_ref(rows, host_ref, loc)
    assert torch.equal(host, host_ref)
    dev = torch.full(((pages + 1) * PAGE, 1, DIMS), POISON, dtype=dtype)
    dst = torch.randperm(pages, generator=gen).int() + 1  # device page 0: padding
    gather_host_blocks(host, dev, torch.zeros(pages, dtype=torch.int32),
                       torch.arange(pages, dtype=torch.int32), dst, PAGE)
    for i, slot in enumerate(loc.tolist()):
        if slot >= 0:
            row = int(dst[slot // PAGE]) * PAGE + slot % PAGE
            assert torch.equal(dev[row], rows[i])
    assert (dev[:PAGE] == POISON).all()
    # the store (one latent buffer per layer, no V), its CPU path, into an MLA pool's buffer
    store = HostKVStore(LAYERS, 1, DIMS, 0, pages * PAGE, PAGE, dtype)
    assert store.v is None and store.nbytes == LAYERS * pages * PAGE * DIMS * 2
    store.write(1, loc, rows)
    back, no_v = store.read_tokens(1, loc[loc >= 0])
    assert no_v is None and torch.equal(back, rows[loc >= 0])
    kv = torch.full(((pages + 1) * PAGE, 1, DIMS), POISON, dtype=dtype)
    store.load(1, torch.zeros(2, dtype=torch.int32), torch.tensor([2, -1], dtype=torch.int32),
               torch.tensor([5, 1], dtype=torch.int32), kv, kv[..., :RANK])
    assert torch.equal(kv[5 * PAGE:6 * PAGE], store.k[1][:, 2 * PAGE:3 * PAGE].transpose(0, 1))
    assert torch.equal(kv[5 * PAGE:6 * PAGE, :, :RANK], host_view(store, 1, 2)[..., :RANK])
    assert (kv[PAGE:2 * PAGE] == POISON).all()  # the skipped entry


def host_view(store: HostKVStore, layer: int, page: int) -> torch.Tensor:
    return store.k[layer][:, page * PAGE:(page + 1) * PAGE].transpose(0, 1)


# ------------------------------------------------------- greedy decode, tier on vs off


class TinyMlaModel:
    """Per layer: token -> latent row ``[1, R + P]`` and absorbed query ``[Hq, R + P]`` (as
    ``kv_a_proj`` / ``W_UK`` would give); logits = sum over layers of the latent outputs times
    a fixed matrix. Enough to make each next token depend on every layer's attention."""

    def __init__(self, dtype: torch.dtype, sh: MlaShape = SMALL) -> None:
        gen = torch.Generator().manual_seed(1)
        # Unit-variance rows make large-head-dim logits sharp enough to give a near one-hot
        # attention; scaled so the softmax stays spread over many tokens at any shape.
        scale = (16 / sh.dims) ** 0.25
        self.latent = (scale * torch.randn(sh.layers, sh.vocab, 1, sh.dims, generator=gen)).to(
            device=sh.device, dtype=dtype)
        self.query = (scale * torch.randn(sh.layers, sh.vocab, sh.hq, sh.dims,
                                          generator=gen)).to(device=sh.device, dtype=dtype)
        self.head = torch.randn(sh.hq * sh.rank, sh.vocab, generator=gen).to(sh.device)


class Side:
    """One backend over one pool (tiered or plain), fed the same tokens."""

    def __init__(self, *, tier: str, impl: str, budget: int, dtype: torch.dtype,
                 lens: list[int], steps: int, gpu_tokens: int, sh: MlaShape = SMALL) -> None:
        self.sh = sh
        page = sh.page
        max_context = -(-(max(lens) + steps + page) // page) * page
        self.rows = list(range(1, len(lens) + 1))
        self.table = torch.zeros(len(lens) + 1, max_context, dtype=torch.int32)
        candidates = dense_middle_blocks(budget, sh.sink, sh.window, page)
        cfg = build_config(method="two_level", budget=budget, block_size=page, sink=sh.sink,
                           window=sh.window, candidate_blocks=max(candidates, 1), impl=impl,
                           tier=tier)
        pages_per_row = max_context // page
        logical = (len(lens) * pages_per_row + 2) * page
        if tier == "off":
            self.pool = _mla_pool(logical, dtype, sh)
        else:
            k_blocks = selection_sizes(selection_params(cfg)).k_blocks
            layout = plan_layout(
                device_tokens=0, host_tokens=logical - gpu_tokens, page_size=page,
                max_running_requests=len(lens), max_prefill_tokens=sum(lens),
                num_slots=max(k_blocks, 1), sink=sh.sink, window=sh.window,
                side_tokens_per_token=2 / page, gpu_tokens=gpu_tokens)
            self.pool = _mla_pool(0, dtype, sh, layout=layout, mode=tier)
        # Each request owns whole logical pages, scattered (page 0 is the padding page): with
        # gpu_tokens > PAGE some are homed on the GPU and the rest on the host.
        gen = torch.Generator().manual_seed(2)
        perm = torch.randperm(logical // page - 1, generator=gen) + 1
        offs = torch.arange(max_context) % page
        for i, row in enumerate(self.rows):
            own = perm[i * pages_per_row:(i + 1) * pages_per_row]
            self.table[row] = (own.repeat_interleave(page) * page + offs).int()
        self.table = self.table.to(sh.device)
        from sglang.srt.configs.model_config import AttentionArch

        runner = SimpleNamespace(
            device=sh.device, req_to_token_pool=FakeReqToTokenPool(self.table),
            token_to_kv_pool=self.pool,
            model_config=SimpleNamespace(attention_arch=AttentionArch.MLA, kv_lora_rank=sh.rank,
                                         qk_rope_head_dim=sh.rope, num_hidden_layers=sh.layers,
                                         num_attention_heads=sh.hq),
            server_args=SimpleNamespace(page_size=page, enable_metrics=False), dtype=dtype)
        self.backend = SparseDecodeBackend(runner, cfg)
        self.backend._dense = MhaPrefillDelegate(sh.v_head)
        self.lens = list(lens)
        self.scaling = (sh.qk_nope + sh.rope) ** -0.5
        from sglang.srt.layers.radix_attention import AttentionType

        common = dict(tp_q_head_num=sh.hq, scaling=self.scaling, is_cross_attention=False,
                      attn_type=AttentionType.DECODER, sliding_window_size=-1)
        self.attn_mha = [SimpleNamespace(layer_id=i, tp_k_head_num=sh.hq,
                                         qk_head_dim=sh.qk_nope + sh.rope, v_head_dim=sh.v_head,
                                         **common) for i in range(sh.layers)]
        self.attn_mqa = [SimpleNamespace(layer_id=i, tp_k_head_num=1, qk_head_dim=sh.dims,
                                         v_head_dim=sh.rank, **common)
                         for i in range(sh.layers)]

    def prefill(self, model: TinyMlaModel, prompts: list[list[int]], writer: str) -> None:
        sh, dev = self.sh, self.sh.device
        rows = torch.tensor(self.rows, device=dev)
        loc = torch.cat([self.table[r, :n] for r, n in zip(self.rows, self.lens)]).long()
        tokens = torch.tensor([t for p in prompts for t in p], device=dev)
        seq = torch.tensor(self.lens, device=dev)
        seq_cpu = torch.tensor(self.lens)
        extend = SimpleNamespace(
            forward_mode=ExtendMode(), req_pool_indices=rows, seq_lens=seq, seq_lens_cpu=seq_cpu,
            extend_seq_lens_cpu=list(self.lens), extend_prefix_lens_cpu=[0] * len(self.lens),
            extend_prefix_lens=torch.zeros_like(seq), extend_seq_lens=seq, out_cache_loc=loc,
            encoder_lens=None)
        self.backend.init_forward_metadata(extend)  # the tier plans the extend scratch here
        n = loc.shape[0]
        mha = sh.hq * (sh.qk_nope + sh.rope)
        for layer in range(sh.layers):
            # The model writes the latent rows itself, then runs the MHA-path attention.
            latent = model.latent[layer, tokens]
            if writer == "set_mla_kv_buffer":
                self.pool.set_mla_kv_buffer(self.attn_mha[layer], loc, latent[..., :sh.rank],
                                            latent[..., sh.rank:])
            else:
                self.pool.set_kv_buffer(self.attn_mha[layer], loc, latent, None)
            zeros = dict(device=dev, dtype=latent.dtype)
            self.backend.forward_extend(torch.zeros(n, mha, **zeros), torch.zeros(n, mha, **zeros),
                                        torch.zeros(n, sh.hq * sh.v_head, **zeros),
                                        self.attn_mha[layer],
                                        extend, save_kv_cache=False)

    def decode(self, model: TinyMlaModel, tokens: list[int]) -> tuple[list[int], list]:
        """One step for every request: the tokens it emits and each layer's outputs."""
        sh, dev = self.sh, self.sh.device
        self.lens = [n + 1 for n in self.lens]
        seq = torch.tensor(self.lens, device=dev)
        new_loc = torch.stack([self.table[r, n - 1] for r, n in zip(self.rows, self.lens)]).long()
        batch = SimpleNamespace(forward_mode=TierDecodeMode(), batch_size=len(self.rows),
                                req_pool_indices=torch.tensor(self.rows, device=dev), seq_lens=seq,
                                seq_lens_cpu=torch.tensor(self.lens), out_cache_loc=new_loc)
        self.backend.init_forward_metadata(batch)
        tok = torch.tensor(tokens, device=dev)
        logits = torch.zeros(len(tokens), sh.vocab, device=dev)
        outs = []
        for layer in range(sh.layers):
            k_new = model.latent[layer, tok]
            out = self.backend.forward_decode(model.query[layer, tok], k_new, k_new[..., :sh.rank],
                                              self.attn_mqa[layer], batch)
            outs.append(out)
            logits += out.float() @ model.head
        return logits.argmax(-1).tolist(), outs

    def release(self, row: int) -> None:
        """What ReqToTokenPool.free's hook does at every exit (patches/req_to_token_pool.py)."""
        if isinstance(self.pool, TieredMLAKVPool):
            self.pool.release_row(row, self.table)


def _greedy(*, tier: str, impl: str, budget: int, dtype: torch.dtype, lens: list[int],
            steps: int, writer: str, gpu_tokens: int = PAGE, sh: MlaShape = SMALL) -> None:
    model = TinyMlaModel(dtype, sh)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, sh.vocab, (n,), generator=gen).tolist() for n in lens]
    sides = [Side(tier=t, impl=impl, budget=budget, dtype=dtype, lens=lens, steps=steps,
                  gpu_tokens=gpu_tokens, sh=sh) for t in (tier, "off")]
    for side in sides:
        side.prefill(model, prompts, writer)
    tiered = sides[0].pool
    assert isinstance(tiered, TieredMLAKVPool)
    tokens = [p[-1] for p in prompts]
    emitted = []
    for step in range(steps):
        (got, got_outs), (want, want_outs) = (side.decode(model, tokens) for side in sides)
        for layer, (a, b) in enumerate(zip(got_outs, want_outs)):
            assert torch.equal(a, b), f"step {step} layer {layer}"
        assert got == want
        rows, seqs = sides[0].rows, sides[0].lens
        tiered.verify_mappings(sides[0].table, rows, seqs)  # device copies equal their homes
        tokens = got
        emitted.append(got)
    assert any(n > budget for n in sides[0].lens) or budget >= max(sides[0].lens)
    if impl == "triton" and tiered.layout.host_tokens:
        assert tiered.tier.read_stats()["transferred_blocks"] > 0
    for row in sides[0].rows:
        sides[0].release(row)
    tiered.check_idle()


def test_greedy_decode_async_tier_equals_no_tier_budget_above_context():
    """Prompt KV on the host (the GPU homes page 0 only); budget >= context: exact under the
    async schedule too (the working set starts filled, ring blocks are fetched before their
    page is reused: the first request crosses two block boundaries), on the batched kernels;
    the prefill's latent rows come through set_mla_kv_buffer, as DeepSeek-V2 writes them on
    CUDA."""
    _greedy(tier="async", impl="triton", budget=32, dtype=torch.float32, lens=[21, 10], steps=5,
            writer="set_mla_kv_buffer")


def test_greedy_decode_sync_tier_equals_no_tier_small_budget():
    """Budget below the context: sparse two_level selection over blocks fetched into working
    sets; some logical pages homed on the GPU, the rest on the host."""
    _greedy(tier="sync", impl="triton", budget=20, dtype=torch.float32, lens=[25, 12], steps=4,
            writer="set_kv_buffer", gpu_tokens=6 * PAGE)


def test_greedy_decode_reference_tier_equals_no_tier():
    """The reference decode reads host-homed rows straight from host memory (gather_tokens,
    V the latent view), bf16 as SGLang's torch_native runs it."""
    _greedy(tier="sync", impl="reference", budget=64, dtype=torch.bfloat16, lens=[30, 9],
            steps=4, writer="set_kv_buffer")


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_gpu_deepseek_v2_lite_shapes_tier_equals_no_tier_budget_above_context(mode: str) -> None:
    """The CPU tier on CUDA at the mla-e2e server's layer shapes and budget (2048): prompt rows
    written through to the pinned host store by set_mla_kv_buffer, most logical pages homed on
    the host, working sets filled by the compiled gather on the side stream under ``async``;
    three requests, the longest reaching the budget on its last step (its last middle block
    in the recent-window ring). Bit-equal outputs at every step and layer against a plain MLA
    pool holding everything."""
    sh = DEEPSEEK_V2_LITE_GPU
    _greedy(tier=mode, impl="triton", budget=2048, dtype=torch.bfloat16,
            lens=[2008, 1536, 700], steps=40, writer="set_mla_kv_buffer",
            gpu_tokens=8 * sh.page, sh=sh)


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_deepseek_v2_lite_shapes_sync_tier_equals_no_tier_small_budget() -> None:
    """Sparse two_level selection (budget 512 of up to 2.1k tokens) over blocks fetched into the
    working sets on CUDA: the same tokens and outputs as the untiered pool."""
    sh = DEEPSEEK_V2_LITE_GPU
    _greedy(tier="sync", impl="triton", budget=512, dtype=torch.bfloat16,
            lens=[2100, 1300], steps=24, writer="set_mla_kv_buffer", gpu_tokens=8 * sh.page,
            sh=sh)


# ------------------------------------------------------------------- finish / abort


def test_finish_and_abort_free_every_slot():
    """A request aborted after its prefill (tracked, never decoded: no working set yet), one
    aborted mid-decode and one that finishes: each exit gives its pages back; none is left
    after."""
    model = TinyMlaModel(torch.float32)
    lens = [22, 17, 9]
    side = Side(tier="async", impl="triton", budget=24, dtype=torch.float32, lens=lens, steps=3,
                gpu_tokens=PAGE)
    pool = side.pool
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, SMALL.vocab, (n,), generator=gen).tolist() for n in lens]
    total = pool.work.num_pages
    side.prefill(model, prompts, "set_mla_kv_buffer")
    # the prompts are on their homes: the working area holds nothing until a row decodes
    assert pool.work.available == total and set(pool.pending_rows()) == set(side.rows)
    # abort the third request before it ever decodes
    side.release(side.rows[2])
    assert side.rows[2] not in pool.rows
    side.rows, side.lens = side.rows[:2], side.lens[:2]
    tokens = [p[-1] for p in prompts[:2]]
    for _ in range(2):
        tokens, _ = side.decode(model, tokens)
    assert set(pool.rows) == set(side.rows) and not pool.pending_rows()
    assert pool.work.available == total - 2 * pool.pages_per_request
    free = pool.work.available
    side.release(side.rows[1])  # abort mid-decode
    assert pool.work.available > free and side.rows[1] not in pool.rows
    side.rows, side.lens = side.rows[:1], side.lens[:1]
    side.decode(model, tokens[:1])
    side.release(side.rows[0])  # finish
    pool.check_idle()
    # (row 0 keeps the CUDA-graph padding entry bind() maps to the padding page)
    assert pool.work.available == total and not bool((pool.tier.page_maps[1:] >= 0).any())
