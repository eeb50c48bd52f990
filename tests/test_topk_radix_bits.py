"""The two top-k's digit widths in the server: the measured per-stage defaults
(kernels/sparse_decode.py), or SGLANG_EXT_TOPK_RADIX_BITS=BLOCK,TOKEN, checked at start-up."""

import pytest
import torch

from cpu_backend import cpu_mha_pool, cpu_sparse_backend
from sglang_ext.kernels.sparse_decode import BLOCK_TOPK_RADIX_BITS, TOKEN_TOPK_RADIX_BITS

CHANNELS = [[[0, 7, 15], [2, 3, 9]]]


def _workspace(tmp_path):
    pool = cpu_mha_pool(torch.bfloat16, 2, 16, 1, 4, 8)
    backend = cpu_sparse_backend(tmp_path, pool, torch.zeros(4, 32, dtype=torch.int32), 4,
                                 CHANNELS, "auto")
    ws = backend.decoder.workspace(2)
    return ws.block_topk_radix_bits, ws.token_topk_radix_bits


def test_the_defaults_and_the_override_reach_the_workspace(tmp_path, monkeypatch):
    monkeypatch.delenv("SGLANG_EXT_TOPK_RADIX_BITS", raising=False)
    assert _workspace(tmp_path) == (BLOCK_TOPK_RADIX_BITS, TOKEN_TOPK_RADIX_BITS) == (7, 6)
    monkeypatch.setenv("SGLANG_EXT_TOPK_RADIX_BITS", "8,5")
    assert _workspace(tmp_path) == (8, 5)


@pytest.mark.parametrize("bad", ["8", "8,4", "9,8", "a,b", "8,8,8"])
def test_a_bad_override_stops_start_up_in_one_line(tmp_path, monkeypatch, bad):
    monkeypatch.setenv("SGLANG_EXT_TOPK_RADIX_BITS", bad)
    with pytest.raises(SystemExit, match="is not BLOCK,TOKEN digit widths, each in 5..8"):
        _workspace(tmp_path)
