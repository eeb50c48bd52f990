"""kernels/stream_clock.py: stream-ordered timestamps. On the CPU the host clock (call order);
on the GPU a one-thread kernel reading %globaltimer, which must also work when captured in a
CUDA graph and replayed (the decode step's case)."""

import time

import pytest
import torch

from sglang_ext.kernels.stream_clock import StreamClock

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_cpu_clock_accumulates_the_time_since_a_mark():
    clock = StreamClock(3, "cpu")
    for _ in range(2):
        clock.mark(0)
        time.sleep(0.01)
        clock.add_since(0, 2)
    mark, _, total = clock.read()
    assert mark > 0 and 0.02e9 <= total < 1e9
    assert clock.read()[1] == 0  # untouched slot


@pytest.mark.gpu
@needs_cuda
def test_gpu_clock_times_stream_work_eagerly_and_in_a_cuda_graph():
    clock = StreamClock(2, "cuda")
    sleep_cycles = 20_000_000  # ~10 ms

    def timed_sleep():
        clock.mark(0)
        torch.cuda._sleep(sleep_cycles)
        clock.add_since(0, 1)

    timed_sleep()
    torch.cuda.synchronize()
    eager = clock.read()[1]
    assert eager > 1e6, eager  # > 1 ms of GPU time
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        timed_sleep()  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        timed_sleep()
    torch.cuda.synchronize()
    before = clock.read()[1]
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    added = clock.read()[1] - before
    assert 3 * 0.5 * eager < added < 3 * 2.0 * eager, (eager, added)  # each replay: its own sleep
