"""Working-set residency update (kernels/working_set.py): the kernel equals the Python oracle
step for step on random selection sequences, and the working set behaves as the CPU tier needs:
after every step each wanted block is mapped to a page that really holds it, only the set
difference is transferred, shared (window/sink) pages count as hits and are never unmapped, and
rows outside the tier are untouched."""

import pytest
import torch

from sglang_ext.kernels.testing import case_generator
from sglang_ext.kernels.working_set import update_working_set, update_working_set_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class TierState:
    """One layer's working-set tables for a few requests, with logical pages scattered."""

    def __init__(self, gen, rows, num_kv_heads, max_blocks, num_cand, block_size, tiered_rows):
        self.block_size = block_size
        self.ws_map = torch.full((rows, num_kv_heads, max_blocks), -1, dtype=torch.int32)
        self.slot_block = torch.full((rows, num_kv_heads, num_cand), -1, dtype=torch.int32)
        # Distinct device pages per (row, slot); pages >= 1000 belong to the working sets.
        self.slot_pages = (1000 + torch.randperm(rows * num_cand, generator=gen)).to(
            torch.int32).reshape(rows, num_cand)
        self.tiered = torch.zeros(rows, dtype=torch.int32)
        self.tiered[tiered_rows] = 1
        # Logical pages of each request's blocks: a random permutation (never the identity).
        pages = torch.randperm(rows * max_blocks, generator=gen).reshape(rows, max_blocks)
        offs = torch.arange(block_size)
        self.req_to_token = (pages[:, :, None] * block_size + offs).reshape(rows, -1).to(torch.int32)

    def clone(self):
        other = object.__new__(TierState)
        other.__dict__ = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in self.__dict__.items()}
        return other

    def to(self, device):
        for k, v in self.__dict__.items():
            if torch.is_tensor(v):
                setattr(self, k, v.to(device))
        return self


def _random_cand(gen, batch, num_kv_heads, num_cand, max_blocks, prev=None, keep=0.6):
    """Distinct wanted blocks per (request, head), a few -1; with ``prev`` about ``keep`` of the
    previous step's blocks stay wanted (decode-like locality)."""
    cand = torch.full((batch, num_kv_heads, num_cand), -1, dtype=torch.int32)
    for b in range(batch):
        for g in range(num_kv_heads):
            n = int(torch.randint(num_cand // 2, num_cand + 1, (1,), generator=gen))
            chosen: list[int] = []
            if prev is not None:
                old = [int(x) for x in prev[b, g] if x >= 0]
                chosen = [x for x in old if torch.rand(1, generator=gen).item() < keep][:n]
            rest = [int(x) for x in torch.randperm(max_blocks, generator=gen) if int(x) not in chosen]
            chosen += rest[: n - len(chosen)]
            perm = torch.randperm(num_cand, generator=gen)[:n]
            cand[b, g, perm] = torch.tensor(chosen, dtype=torch.int32)
    return cand


def _run_sequence(device, steps, batch, num_kv_heads, num_cand, max_blocks, seed):
    gen = case_generator("ws", steps, batch, num_kv_heads, num_cand, max_blocks, seed)
    rows = batch + 2
    bs = 4
    tiered_rows = list(range(1, rows - 1))  # row 0 (padding) and the last row stay untiered
    ref = TierState(gen, rows, num_kv_heads, max_blocks, num_cand, bs, tiered_rows)
    # A few blocks live in shared pages (sink/window): mapped, not in any slot.
    shared = {}
    for r in tiered_rows:
        for g in range(num_kv_heads):
            for blk in (0, max_blocks - 1):
                ref.ws_map[r, g, blk] = 7 + blk
                shared[(r, g, blk)] = 7 + blk
    ker = ref.clone().to(device)
    req_pool_indices = torch.tensor(tiered_rows[:batch - 1] + [rows - 1], dtype=torch.int64)
    cand = None
    resident_before = None
    stats = torch.zeros(3, dtype=torch.int64, device=device)
    total_wanted = total_missed = 0
    for _ in range(steps):
        cand = _random_cand(gen, batch, num_kv_heads, num_cand, max_blocks, prev=cand)
        resident_before = ref.ws_map.clone()
        src_r, dst_r = update_working_set_ref(
            cand, req_pool_indices, ref.tiered, ref.ws_map, ref.slot_block, ref.slot_pages,
            ref.req_to_token, bs)
        poison = torch.full_like(cand, 31337).to(device)
        src_k, dst_k = update_working_set(
            cand.to(device), req_pool_indices.to(device), ker.tiered, ker.ws_map,
            ker.slot_block, ker.slot_pages, ker.req_to_token, bs,
            src_pages=poison.clone(), dst_pages=poison.clone(), stats=stats)
        torch.testing.assert_close(src_k.cpu(), src_r, rtol=0, atol=0)
        torch.testing.assert_close(dst_k.cpu(), dst_r, rtol=0, atol=0)
        torch.testing.assert_close(ker.ws_map.cpu(), ref.ws_map, rtol=0, atol=0)
        torch.testing.assert_close(ker.slot_block.cpu(), ref.slot_block, rtol=0, atol=0)

        for b, row in enumerate(req_pool_indices.tolist()):
            if not ref.tiered[row]:
                assert (src_r[b] == -1).all() and (dst_r[b] == -1).all()
                assert (ref.ws_map[row] == -1).all()  # untiered rows are never touched
                continue
            for g in range(num_kv_heads):
                wanted = [int(x) for x in cand[b, g] if x >= 0]
                # Every wanted block is mapped, to its shared page or to a slot holding it.
                for blk in wanted:
                    page = int(ref.ws_map[row, g, blk])
                    assert page >= 0
                    if (row, g, blk) in shared:
                        assert page == shared[(row, g, blk)]
                    else:
                        s = (ref.slot_pages[row] == page).nonzero().item()
                        assert int(ref.slot_block[row, g, s]) == blk
                # Only the difference moved: misses = wanted blocks not resident before.
                moved = [int(x) for x in dst_r[b, g] if x >= 0]
                expected = [blk for blk in wanted if int(resident_before[row, g, blk]) < 0]
                assert len(moved) == len(expected) == len(set(moved))
                for i in range(num_cand):
                    blk = int(cand[b, g, i])
                    if int(src_r[b, g, i]) >= 0:
                        assert int(src_r[b, g, i]) == int(ref.req_to_token[row, blk * bs]) // bs
                total_wanted += len(wanted)
                total_missed += len(expected)
        # Shared pages are never unmapped.
        for (r, g, blk), page in shared.items():
            assert int(ref.ws_map[r, g, blk]) == page
    # host_page_offset 0: every logical page is host-homed
    assert stats.tolist() == [total_wanted, total_missed, total_wanted]


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_wanted_blocks_in_the_ring_get_a_slot_of_their_own(device):
    """A wanted block mapped to a ring page (resident only until the ring reuses the page) is
    a miss: it is fetched into a slot and remapped there; sink pages stay hits."""
    gen = case_generator("ws-ring")
    rows, hkv, num_cand, max_blocks, bs = 3, 2, 4, 12, 4
    ref = TierState(gen, rows, hkv, max_blocks, num_cand, bs, [1, 2])
    ring = torch.full((rows, 3), -1, dtype=torch.int32)
    ring[1] = torch.tensor([500, 501, 502], dtype=torch.int32)  # block j lives in page j % 3
    ring_blocks = torch.full((rows, 3), -1, dtype=torch.int32)
    ring_blocks[1] = torch.tensor([9, 10, -1], dtype=torch.int32)
    for g in range(hkv):
        ref.ws_map[1, g, 0] = 400  # sink page
        ref.ws_map[1, g, 9], ref.ws_map[1, g, 10] = 500, 501  # ring pages
    rpi = torch.tensor([1])
    ker = ref.clone().to(device)

    def step(cand):
        src_r, dst_r = update_working_set_ref(cand, rpi, ref.tiered, ref.ws_map, ref.slot_block,
                                              ref.slot_pages, ref.req_to_token, bs,
                                              ring_pages=ring, ring_blocks=ring_blocks)
        src_k, dst_k = update_working_set(cand.to(device), rpi.to(device), ker.tiered,
                                          ker.ws_map, ker.slot_block, ker.slot_pages,
                                          ker.req_to_token, bs, ring_pages=ring.to(device),
                                          ring_blocks=ring_blocks.to(device))
        for got, want in ((src_k, src_r), (dst_k, dst_r), (ker.ws_map, ref.ws_map),
                          (ker.slot_block, ref.slot_block)):
            torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)
        return dst_r

    dst = step(torch.tensor([[[0, 9, 3, -1], [10, 0, -1, -1]]], dtype=torch.int32))
    slots = set(ref.slot_pages[1].tolist())
    assert int(ref.ws_map[1, 0, 0]) == 400 and int(ref.ws_map[1, 1, 0]) == 400  # sink: a hit
    assert int(ref.ws_map[1, 0, 9]) in slots and int(ref.ws_map[1, 1, 10]) in slots
    assert int(ref.ws_map[1, 1, 9]) == 500  # not wanted by head 1: left in the ring
    assert (dst[0, 0] >= 0).tolist() == [False, True, True, False]
    assert (dst[0, 1] >= 0).tolist() == [True, False, False, False]
    # New blocks take every slot: block 9, still in the ring, goes back to its ring page;
    # block 3 (not in the ring) is unmapped.
    step(torch.tensor([[[4, 5, 6, 7], [4, 5, 6, 7]]], dtype=torch.int32))
    assert int(ref.ws_map[1, 0, 9]) == 500 and int(ref.ws_map[1, 1, 10]) == 501
    assert int(ref.ws_map[1, 0, 3]) == -1


@pytest.mark.parametrize("num_cand,max_blocks", [(5, 9), (16, 40), (33, 70)])
def test_working_set_sequences_match_oracle(num_cand, max_blocks):
    _run_sequence("cpu", steps=4, batch=3, num_kv_heads=2, num_cand=num_cand,
                  max_blocks=max_blocks, seed=0)


def test_first_step_loads_everything_then_only_the_difference():
    gen = case_generator("ws-diff")
    st = TierState(gen, rows=2, num_kv_heads=1, max_blocks=12, num_cand=4, block_size=2,
                   tiered_rows=[1])
    rpi = torch.tensor([1])
    cand = torch.tensor([[[3, 5, -1, 8]]], dtype=torch.int32)
    src, dst = update_working_set(cand, rpi, st.tiered, st.ws_map, st.slot_block,
                                  st.slot_pages, st.req_to_token, 2)
    assert (dst >= 0).sum() == 3
    cand2 = torch.tensor([[[8, 9, 3, -1]]], dtype=torch.int32)  # 8 and 3 stay, 9 is new
    src2, dst2 = update_working_set(cand2, rpi, st.tiered, st.ws_map, st.slot_block,
                                    st.slot_pages, st.req_to_token, 2)
    assert dst2.tolist() == [[[-1, dst2[0, 0, 1].item(), -1, -1]]]
    assert dst2[0, 0, 1] >= 0
    # Block 5 was unwanted: its slot was either reused for 9 or still holds 5 (a free hit).
    assert int(st.ws_map[1, 0, 9]) == int(dst2[0, 0, 1])
    assert int(st.ws_map[1, 0, 3]) >= 0 and int(st.ws_map[1, 0, 8]) >= 0


@gpu
@needs_cuda
@pytest.mark.parametrize("num_cand,max_blocks", [(246, 8192), (128, 2048)])
def test_working_set_gpu_real_shapes(num_cand, max_blocks):
    _run_sequence("cuda", steps=3, batch=4, num_kv_heads=8, num_cand=num_cand,
                  max_blocks=max_blocks, seed=1)


def test_stats_count_host_homed_wanted_blocks_apart():
    """With ``host_page_offset`` G, wanted blocks whose logical page is below G are GPU-homed
    (mapped to themselves, always hits): the third counter counts only the others."""
    gen = case_generator("ws-host-stats")
    rows, hkv, max_blocks, num_cand, bs = 3, 2, 24, 6, 4
    state = TierState(gen, rows, hkv, max_blocks, num_cand, bs, tiered_rows=[1, 2])
    offset = rows * max_blocks // 2  # half the logical pages are GPU-homed
    page_of = state.req_to_token[:, ::bs] // bs  # [rows, max_blocks]
    gpu_homed = page_of < offset
    for r in (1, 2):
        for g in range(hkv):
            blocks = gpu_homed[r].nonzero().flatten()
            state.ws_map[r, g, blocks] = page_of[r, blocks].to(torch.int32)
    cand = _random_cand(gen, 2, hkv, num_cand, max_blocks)
    req_pool_indices = torch.tensor([1, 2])
    ker = state.clone().to(DEVICE)
    stats = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    src, _ = update_working_set(cand.to(DEVICE), req_pool_indices.to(DEVICE), ker.tiered,
                                ker.ws_map, ker.slot_block, ker.slot_pages, ker.req_to_token, bs,
                                stats=stats, host_page_offset=offset)
    valid = cand >= 0
    homes = torch.stack([page_of[r][cand[b].clamp(min=0).long()] for b, r in enumerate([1, 2])])
    host_wanted = int((valid & (homes >= offset)).sum())
    assert 0 < host_wanted < int(valid.sum())
    # every host-homed wanted block misses (empty slots), and nothing GPU-homed moves
    assert stats.tolist() == [int(valid.sum()), host_wanted, host_wanted]
    assert int((src.cpu() >= 0).sum()) == host_wanted
    with pytest.raises(ValueError, match="stats must be int64"):
        update_working_set(cand.to(DEVICE), req_pool_indices.to(DEVICE), ker.tiered, ker.ws_map,
                           ker.slot_block, ker.slot_pages, ker.req_to_token, bs,
                           stats=torch.zeros(2, dtype=torch.int64, device=DEVICE))


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_a_row_without_slot_pages_maps_and_moves_nothing(device):
    """A row still marked tiered whose slot pages are gone (a request released while a step
    that holds it is in flight): no miss is mapped to page -1 and no transfer targets it, in
    the kernel as in the oracle; the other rows are served as usual."""
    gen = case_generator("ws-released")
    rows, heads, num_cand, max_blocks, bs = 4, 2, 5, 16, 4
    ref = TierState(gen, rows, heads, max_blocks, num_cand, bs, [1, 2])
    ref.slot_pages[2] = -1
    ker = ref.clone().to(device)
    cand = _random_cand(gen, 2, heads, num_cand, max_blocks)
    rpi = torch.tensor([1, 2], dtype=torch.int64)
    src_r, dst_r = update_working_set_ref(cand, rpi, ref.tiered, ref.ws_map, ref.slot_block,
                                          ref.slot_pages, ref.req_to_token, bs)
    src_k, dst_k = update_working_set(cand.to(device), rpi.to(device), ker.tiered, ker.ws_map,
                                      ker.slot_block, ker.slot_pages, ker.req_to_token, bs)
    for got, want in ((src_k, src_r), (dst_k, dst_r), (ker.ws_map, ref.ws_map),
                      (ker.slot_block, ref.slot_block)):
        assert torch.equal(got.cpu(), want)
    assert (src_r[1] == -1).all() and (dst_r[1] == -1).all()
    assert (ref.ws_map[2] == -1).all() and (ref.slot_block[2] == -1).all()
    assert (dst_r[0] >= 0).any()  # row 1 still fetched its misses
