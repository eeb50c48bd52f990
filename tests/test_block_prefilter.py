"""The block filter's cascade (``prefilter``, ``--sparse-block-prefilter``): the bound keeps
``prefilter x candidate_blocks`` pages, the label maximum ranks only those. The oracle, the
batched reference against it, validation, the flag and the per-request key. No server."""

from __future__ import annotations

import argparse
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from sglang_ext.config import ConfigError, add_cli_args, build_config, from_namespace
from sglang_ext.selection import SelectionParams, select_token_mask, sparse_decode
from sglang_ext.selection.reference import (
    BatchedSparseDecode,
    block_minmax,
    label_token_scores,
    quest_block_scores,
)

D, DV, SM_SCALE = 32, 16, 32 ** -0.5
HQ, HKV = 6, 2
BS = 8
# two_level, budget 48 (sink 4, window 8: 36 selected), 5 candidate blocks of 8 tokens
LABEL_MAX = SelectionParams("two_level", 48, BS, 5, 4, 8, block_score="label_max")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _case(seed: int, length: int):
    gen = _gen(seed)
    q = torch.randn(HQ, D, generator=gen)
    # keys whose spread differs from block to block, so that the bound and the label maximum
    # rank pages differently
    spread = torch.rand(length // BS + 1, generator=gen).repeat_interleave(BS)[:length]
    keys = torch.randn(length, HKV, D, generator=gen) * (0.3 + 3 * spread)[:, None, None]
    values = torch.randn(length, HKV, DV, generator=gen)
    channels = torch.stack([torch.randperm(D, generator=gen)[:8] for _ in range(HKV)])
    return q, keys, values, channels


def _blocks_used(mask: torch.Tensor, lo: int, hi: int) -> list[set[int]]:
    """Per kv head, the blocks (absolute index) holding a selected middle position."""
    return [{(lo + int(p)) // BS for p in mask[h, lo:hi].nonzero().flatten()}
            for h in range(mask.shape[0])]


def _bound_top(q, keys, params, lo, hi, k) -> list[set[int]]:
    """Per kv head, the bound's ``k`` best candidate blocks (absolute index)."""
    first, last = lo // BS, (hi - 1) // BS
    bound = quest_block_scores(q, *block_minmax(keys[first * BS:(last + 1) * BS], BS))
    return [{first + int(i) for i in bound[h].topk(k).indices} for h in range(bound.shape[0])]


def test_cascade_equals_label_max_when_the_prefilter_keeps_every_candidate():
    for seed, length in ((0, 200), (1, 163), (2, 97)):
        q, keys, _, channels = _case(seed, length)
        lo, hi = LABEL_MAX.sink, length - LABEL_MAX.window
        num_cand = (hi - 1) // BS - lo // BS + 1
        factor = -(-num_cand // LABEL_MAX.candidate_blocks)  # F x C >= the candidate blocks
        for f in (max(2, factor), factor + 3):
            cascade = dataclasses.replace(LABEL_MAX, prefilter=f)
            assert torch.equal(select_token_mask(q, keys, cascade, channels),
                               select_token_mask(q, keys, LABEL_MAX, channels)), (seed, f)


@pytest.mark.parametrize("prefilter", [2, 3])
def test_cascade_keeps_only_pages_of_the_bounds_best(prefilter):
    differs = False
    for seed in range(6):
        length = 400
        q, keys, _, channels = _case(10 + seed, length)
        lo, hi = LABEL_MAX.sink, length - LABEL_MAX.window
        cascade = dataclasses.replace(LABEL_MAX, prefilter=prefilter)
        allowed = _bound_top(q, keys, cascade, lo, hi, prefilter * cascade.candidate_blocks)
        mask = select_token_mask(q, keys, cascade, channels)
        for h, used in enumerate(_blocks_used(mask, lo, hi)):
            assert used and used <= allowed[h], (seed, h, sorted(used - allowed[h]))
        # the kept pages are the label maximum's best among the survivors
        scores = label_token_scores(q, keys[lo:hi], channels)
        for h, used in enumerate(_blocks_used(mask, lo, hi)):
            best = {}
            for p in range(lo, hi):
                b = p // BS
                best[b] = max(best.get(b, float("-inf")), float(scores[h, p - lo]))
            ranked = sorted(allowed[h], key=lambda b: -best[b])[: cascade.candidate_blocks]
            assert used <= set(ranked), (seed, h)
        plain = _blocks_used(select_token_mask(q, keys, LABEL_MAX, channels), lo, hi)
        differs |= any(not used <= allowed[h] for h, used in enumerate(plain))
    assert differs, "label_max alone stayed inside the bound's best: the test shows nothing"


def _pool(lengths, seed):
    cases = [_case(seed + i, n) for i, n in enumerate(lengths)]
    keys = [c[1] for c in cases]
    values = [c[2] for c in cases]
    rows = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    start = 0
    for i, n in enumerate(lengths):
        rows[i, :n] = torch.arange(start, start + n)
        start += n
    q = torch.stack([c[0] for c in cases])
    return q, keys, values, torch.cat(keys), torch.cat(values), rows, cases[0][3]


def test_batched_reference_selects_the_cascade_as_the_oracle(monkeypatch):
    """BatchedSparseDecode (the CPU server's decode) picks each row's tokens as
    select_token_mask does alone, cascade rows beside label_max, bound, quest and ds rows."""
    lengths = [400, 333, 261, 380, 290, 350]
    q, keys, values, pool_k, pool_v, rows, channels = _pool(lengths, 100)
    bound = dataclasses.replace(LABEL_MAX, block_score="bound")
    params = [dataclasses.replace(LABEL_MAX, prefilter=2), LABEL_MAX,
              dataclasses.replace(LABEL_MAX, prefilter=3, rerank=2), bound,
              SelectionParams("quest", 48, BS, 0, 4, 8), SelectionParams("ds", 48, BS, 0, 4, 8)]
    masks = []
    original = BatchedSparseDecode._attend

    def attend(q_, mask, *rest):
        masks.append(mask.clone())
        return original(q_, mask, *rest)

    monkeypatch.setattr(BatchedSparseDecode, "_attend", staticmethod(attend))
    out = BatchedSparseDecode(rows, lengths, params, split_families=False).decode(
        q, pool_k, pool_v, SM_SCALE, channels)
    assert len(masks) == 1
    for i, n in enumerate(lengths):
        expected = select_token_mask(q[i], keys[i], params[i], channels)
        assert torch.equal(masks[0][i, :, :n], expected), i
        torch.testing.assert_close(
            out[i], sparse_decode(q[i], keys[i], values[i], params[i], SM_SCALE, channels),
            rtol=1e-5, atol=1e-5)
    # the cascade rows select differently from label_max on the same request (else the
    # comparison above would not tell a decode that ignores the prefilter)
    assert any(not torch.equal(select_token_mask(q[i], keys[i], params[i], channels),
                               select_token_mask(q[i], keys[i], LABEL_MAX, channels))
               for i in (0, 2))


@pytest.mark.parametrize("values", [
    dict(prefilter=1), dict(prefilter=-2),
    dict(prefilter=4, block_score="bound"),
    dict(prefilter=4, method="ds", block_score="bound", candidate_blocks=0),
    dict(prefilter=4, method="quest", block_score="bound"),
])
def test_selection_params_refuse_a_bad_prefilter(values):
    with pytest.raises(ValueError, match="prefilter") as e:
        dataclasses.replace(LABEL_MAX, **values)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("values", [
    dict(prefilter=1), dict(prefilter=-1), dict(prefilter="four"),
    dict(prefilter=4, block_score="bound"),
    dict(prefilter=4, method="ds"),
    dict(prefilter=4, method="quest"),
    dict(prefilter=4, block_filter="async"),  # auto resolves to the bound there
    dict(prefilter=4, tier="sync"),
])
def test_bad_prefilter_flags_stop_startup_with_one_line(values):
    with pytest.raises(ConfigError, match="--sparse-block-prefilter") as e:
        build_config(**values)
    assert "\n" not in str(e.value)


def test_the_flag_reaches_the_selection():
    from sglang_ext.attention.request_overrides import selection_params

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    assert "--sparse-block-prefilter" in parser.format_help()
    cfg = from_namespace(parser.parse_args(["--sparse-block-prefilter", "4"]))
    assert cfg.prefilter == 4 and cfg.effective_block_score == "label_max"
    params = selection_params(cfg)
    assert params.prefilter == 4 and params.block_score == "label_max"
    assert params.candidate_blocks == build_config().effective_candidate_blocks  # unchanged
    assert selection_params(build_config(prefilter=2, block_score="label_max",
                                         rerank=4)).prefilter == 2
    assert build_config().prefilter == 0 and selection_params(build_config()).prefilter == 0


def _cuda_server_args():
    args = SimpleNamespace(speculative_algorithm=None, enable_mixed_chunk=False, device="cuda",
                           disable_cuda_graph=False, page_size=None, max_running_requests=None)
    args.override = lambda who, **changes: vars(args).update(changes)
    return args


@pytest.mark.parametrize("impl", ["triton", "auto", "reference"])  # auto: triton on CUDA
def test_every_decode_starts_with_the_cascade(impl):
    """The kernels run the cascade (kernels/sparse_decode.py, _cascade_candidates): no
    start-up refusal on any implementation."""
    from sglang_ext.patches.server_args import _force_compatible_settings

    _force_compatible_settings(_cuda_server_args(), build_config(impl=impl, prefilter=4))


def test_mla_models_refuse_the_cascade():
    from sglang_ext.selection.mla import mla_unsupported

    assert [flag for _, flag in mla_unsupported(build_config(prefilter=4))] == [
        "--sparse-block-prefilter"]


def test_per_request_prefilter():
    from sglang_ext.attention.request_overrides import parse_override

    base = build_config()
    assert parse_override({"sparse": {"prefilter": 4}}, base).prefilter == 4
    both = parse_override({"sparse": {"prefilter": 2, "rerank": 4}}, base)
    assert (both.prefilter, both.rerank, both.block_score) == (2, 4, "label_max")
    for bad in ({"prefilter": "4"}, {"prefilter": True}, {"prefilter": 1},
                {"prefilter": 4, "block_score": "bound"}, {"prefilter": 4, "method": "ds"}):
        with pytest.raises(ValueError, match="prefilter"):
            parse_override({"sparse": bad}, base)
    server = build_config(prefilter=4)
    assert parse_override(None, server).prefilter == 4
    assert parse_override({"sparse": {"budget": 1024}}, server).prefilter == 4
    # the server's cascade narrows label_max: a request without it loses the cascade
    for other in ({"method": "quest"}, {"method": "ds"}, {"block_score": "bound"},
                  {"block_filter": "async"}):
        assert parse_override({"sparse": other}, server).prefilter == 0, other


def test_triton_servers_take_a_requests_prefilter(monkeypatch):
    """The batched decode serves a request's cascade (mixed_settings), and a bad factor is
    still a 400 (ValueError at arrival)."""
    from sglang_ext import runtime
    from sglang_ext.attention.mixed_settings import unsupported_override
    from sglang_ext.patches import sampling_params

    assert unsupported_override(dataclasses.replace(LABEL_MAX, prefilter=4), BS) is None
    process = runtime.state()
    monkeypatch.setattr(process, "impl", "triton")
    monkeypatch.setattr(process, "mla", False)
    monkeypatch.setattr(process, "config", build_config(budget=256, block_size=32))
    sampling_params._after_verify(None, SimpleNamespace(custom_params={"sparse": {"prefilter": 4}}))
    with pytest.raises(ValueError, match="prefilter"):
        sampling_params._after_verify(
            None, SimpleNamespace(custom_params={"sparse": {"prefilter": 1}}))


def test_accuracy_suite_methods_send_the_cascade():
    from benchmarks.accuracy import runner
    from sglang_ext.attention.request_overrides import parse_override

    settings = runner.sparse_settings(["two_level_prefilter4", "two_level_prefilter4_rerank4",
                                       "two_level_prefilter2_rerank4"], [128], 32)
    got = {s.method: parse_override(s.custom_params, build_config(impl="reference"))
           for s in settings if s.method != runner.DENSE}
    assert got["two_level_prefilter4"].prefilter == 4
    assert got["two_level_prefilter4"].rerank == 0
    assert (got["two_level_prefilter4_rerank4"].prefilter,
            got["two_level_prefilter4_rerank4"].rerank) == (4, 4)
    assert (got["two_level_prefilter2_rerank4"].prefilter,
            got["two_level_prefilter2_rerank4"].rerank) == (2, 4)
    assert all(p.block_score == "label_max" for p in got.values())
