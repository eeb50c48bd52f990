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
