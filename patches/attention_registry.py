"""Attention backend registry: the ``sglang_ext`` backend name and its factory."""

from __future__ import annotations

from typing import Any, Callable

from sglang_ext.config import BACKEND_NAME


def _create_backend(model_runner: Any) -> Any:
    from sglang_ext.attention.sparse_backend import SparseDecodeBackend
    from sglang_ext.patches.server_args import config_of

    return SparseDecodeBackend(model_runner, config_of(model_runner.server_args))


def setup() -> None:
    from sglang.srt.layers.attention.attention_registry import register_attention_backend
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    # argparse holds this very list as `choices`, so extending it in place is enough for
    # --attention-backend, --decode-attention-backend and --prefill-attention-backend.
    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    register_attention_backend(BACKEND_NAME)(_create_backend)


def _around_support_triton(original: Callable[[str], bool], backend: str) -> bool:
    # SGLang keeps a hard-coded list of backends that must not launch Triton helpers; on a
    # CPU-only machine ours must be on it (Triton has no active driver there).
    if backend == BACKEND_NAME:
        import torch

        return torch.cuda.is_available()
    return original(backend)


HOOKS = (
    ("sglang.srt.utils.common.support_triton", _around_support_triton, "AROUND"),
)
