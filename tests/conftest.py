"""Shared test set-up.

Without CUDA the Triton kernels run in Triton's CPU interpreter, which must be switched on before
triton is first imported in the process: this conftest is imported before any test module (some
of which import SGLang, which imports triton), so it is the one place that can do it.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_SINGLE_THREADED = ("test_kernels_", "test_selection_reference", "test_bench_operator")


@pytest.fixture(autouse=True, scope="module")
def _single_thread(request):
    """The tiny tensor ops of the kernel and selection tests run ~50x slower when two threads
    compete for this machine's two cores."""
    if not request.module.__name__.rpartition(".")[2].startswith(_SINGLE_THREADED):
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--shard", default=None, metavar="K/N",
                     help="run the K-th of N interleaved slices of the collected tests (1-based): "
                          "the GPU suite in calls that each fit the device's 10-minute limit")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    shard = config.getoption("--shard")
    if not shard:
        return
    try:
        k, n = (int(x) for x in shard.split("/"))
        if not 1 <= k <= n:
            raise ValueError
    except ValueError:
        raise pytest.UsageError(f"--shard must be K/N with 1 <= K <= N (got {shard!r})") from None
    config.hook.pytest_deselected(items=[t for i, t in enumerate(items) if i % n != k - 1])
    items[:] = items[k - 1::n]
