"""The decode step as plan + run (sglang_ext/attention/decode_plan.py): the hooks a feature gets,
in order, once per step and once per layer; a feature that is off is not built; a feature that
changes nothing leaves every output bit alone; one that computes a layer another way replaces the
pipeline. Also the architecture's budgets: the SGLang adapter stays small and the batched
kernels take typed structs."""

from __future__ import annotations

import inspect
from pathlib import Path
import torch

from cpu_backend import (attention_layer, cpu_mha_pool, cpu_sparse_backend, decode_batch,
                         decode_bf16_steps)
from sglang_ext.attention.decode_plan import DecodeFeature
from sglang_ext.kernels import sparse_decode

REPO = Path(__file__).resolve().parents[1]
HQ, HKV, D, LAYERS, PAGE, PAGES = 4, 2, 16, 2, 4, 40
CHANNELS = [[[0, 7, 15], [2, 3, 9]] for _ in range(LAYERS)]
ROWS, LENS = [1, 3], [37, 50]


class Recorder(DecodeFeature):
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def before_batch(self, forward_batch):
        self.calls.append(("before_batch",))

    def start_layers(self, plan):
        self.calls.append(("start_layers",))

    def layer_inputs(self, plan, step):
        self.calls.append(("layer_inputs", step.index))
        return {}

    def after_layer(self, plan, step, lse):
        self.calls.append(("after_layer", step.index, lse is None))

    def end_layers(self, plan):
        self.calls.append(("end_layers",))


class Replacer(DecodeFeature):
    """Computes every layer itself: zeros."""

    def decode_layer(self, plan, step):
        return step.q.new_zeros(step.q.shape[0], step.q.shape[1], D)


def _backend(tmp_path):
    gen = torch.Generator().manual_seed(3)
    pool = cpu_mha_pool(torch.bfloat16, HKV, D, LAYERS, PAGE, PAGES)
    for i in range(LAYERS):
        for buf in (pool.get_key_buffer(i), pool.get_value_buffer(i)):
            buf.copy_(torch.randn(buf.shape, generator=gen))
    table = torch.zeros(4, 64, dtype=torch.int32)
    for i, row in enumerate(ROWS):
        table[row] = torch.arange(4 + i * 64 // 2, 4 + i * 64 // 2 + 64) % (PAGES * PAGE)
    return cpu_sparse_backend(tmp_path, pool, table, HQ, CHANNELS, "auto"), table


def _decode(backend, table, steps: int = 2) -> list[torch.Tensor]:
    return decode_bf16_steps(backend, table, ROWS, LENS, steps, torch.Generator().manual_seed(5),
                             HQ)


def test_features_that_are_off_are_not_built(tmp_path):
    backend, _ = _backend(tmp_path)
    assert backend.decoder.features == []


def test_a_feature_gets_its_hooks_in_order_and_changes_nothing_it_does_not_touch(tmp_path):
    plain, table = _backend(tmp_path)
    want = _decode(plain, table)
    backend, table = _backend(tmp_path)
    recorder = Recorder()
    backend.decoder.features.append(recorder)
    got = _decode(backend, table)
    step = [("before_batch",), ("start_layers",)]
    for i in range(LAYERS):
        step += [("layer_inputs", i), ("after_layer", i, True)]
    assert recorder.calls == (step + [("end_layers",)]) * 2
    for a, b in zip(want, got):
        assert torch.equal(a, b)


def test_every_run_of_one_plan_starts_and_ends_the_step(tmp_path):
    """SGLang captures a decode CUDA graph by running the step's layers several times from one
    init_forward_metadata (warm-up runs, then the capture): each run must start and end the
    step, or the captured graph lacks the features' per-step work (the tier's fence: "capturing
    stream has unjoined work"; the guard's budgets)."""
    backend, table = _backend(tmp_path)
    recorder = Recorder()
    backend.decoder.features.append(recorder)
    batch = decode_batch(table, ROWS, [n + 1 for n in LENS])
    backend.init_forward_metadata(batch)
    gen = torch.Generator().manual_seed(5)
    outs = []
    for _ in range(3):
        for layer_id in range(LAYERS):
            q, k, v = (torch.randn(len(ROWS), n * D, generator=gen).to(torch.bfloat16)
                       for n in (HQ, HKV, HKV))
            outs.append(backend.forward_decode(q, k.view(-1, HKV, D), v.view(-1, HKV, D),
                                               attention_layer(layer_id, HQ, HKV, D), batch))
    step = [("start_layers",)]
    for i in range(LAYERS):
        step += [("layer_inputs", i), ("after_layer", i, True)]
    assert recorder.calls == [("before_batch",)] + (step + [("end_layers",)]) * 3


def test_a_feature_may_compute_the_layer_itself(tmp_path):
    backend, table = _backend(tmp_path)
    recorder = Recorder()
    backend.decoder.features[:] = [Replacer(), recorder]
    outs = _decode(backend, table, steps=1)
    assert all(not o.any() for o in outs)
    # the pipeline did not run: no layer inputs, no after_layer; the step still starts and ends
    assert recorder.calls == [("before_batch",), ("start_layers",), ("end_layers",)]


def test_the_sglang_adapter_and_the_kernel_signature_stay_small():
    adapter = REPO / "sglang_ext" / "attention" / "sparse_backend.py"
    assert len(adapter.read_text().splitlines()) <= 400
    for fn in (sparse_decode.sparse_decode_batched, sparse_decode.select_slots_batched):
        assert len(inspect.signature(fn).parameters) <= 9, fn.__name__
