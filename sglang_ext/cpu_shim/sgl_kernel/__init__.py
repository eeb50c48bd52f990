"""A stand-in for the CUDA-only ``sgl_kernel`` package, for CPU-only machines.

SGLang imports ``sgl_kernel`` at module import time even on its CPU path, but the PyPI build
needs ``libcuda.so.1``. Every name resolves here; the few ops the Llama CPU path really calls
have plain-torch implementations, and any other op raises as soon as it is *called*, so an
unexpected use fails loudly instead of computing garbage.

``scalar_type`` is deliberately absent: SGLang then uses its own pure-Python fallback.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, Callable

import torch

__version__ = "0.0.0+sglang_ext.cpu_shim"
_ABSENT_SUBMODULES = {"scalar_type"}


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new slots (a run of ``out_cache_loc``) into its ``req_to_token`` row."""
    del pool_len  # implied by req_to_token's shape
    offset = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()
    ):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def _unavailable(qualname: str) -> Callable[..., Any]:
    def op(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{qualname} is a CUDA kernel of sgl_kernel; this CPU-only machine has a stand-in "
            "(sglang_ext/cpu_shim) that does not implement it"
        )

    op.__name__ = qualname.rsplit(".", 1)[-1]
    op.__qualname__ = qualname
    return op


class _StubModule(types.ModuleType):
    """A submodule (``sgl_kernel.flash_attn`` …) whose every attribute is an unavailable op."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _unavailable(f"{self.__name__}.{name}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``import sgl_kernel.<anything>`` to a stub module (except the absent ones)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None):  # type: ignore[override]
        if not fullname.startswith(__name__ + "."):
            return None
        if fullname.split(".")[1] in _ABSENT_SUBMODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []  # a package, so deeper submodules resolve too
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def __getattr__(name: str) -> Any:
    if name.startswith("__") or name in _ABSENT_SUBMODULES:
        raise AttributeError(name)
    return _unavailable(f"sgl_kernel.{name}")


if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
    sys.meta_path.append(_StubFinder())
