"""Fluxion's cooperative attention (``--sparse-cooperative on``, sync tier): CPU workers attend
some of a step's misses straight from host memory while the device attends what it holds, and
the two merge by log-sum-exp (memory_tier/cooperative_decode.py). In the batched decode it
replaces the layer's pipeline (eager: patches/server_args.py keeps CUDA graphs off)."""

from __future__ import annotations

import logging
from typing import Any, Optional

from torch import Tensor

from sglang_ext.attention.decode_plan import DecodeContext, DecodeFeature, LayerStep

logger = logging.getLogger(__name__)


def build_cooperative_tier(ctx: DecodeContext) -> Any:
    from sglang_ext.config import cooperative_worker_threads
    from sglang_ext.memory_tier.cooperative_decode import CooperativeTier

    pool = ctx.tiered
    threads = cooperative_worker_threads(ctx.config)
    logger.info("sglang_ext cooperative attention: %d CPU worker threads", threads)
    return CooperativeTier(pool.host, pool.layout.gpu_tokens, pool.layout.page_size, threads)


class KernelCooperative(DecodeFeature):
    def __init__(self, decoder: Any, cooperative: Any, locality: Optional[Any]) -> None:
        self.decoder = decoder
        self.cooperative = cooperative
        self.locality = locality  # features.locality.KernelLocality, when on

    def decode_layer(self, plan: Any, step: LayerStep) -> Optional[Tensor]:
        state = None if self.locality is None else self.locality.state.layer(step.index)
        out = self.cooperative.attend_kernels(
            self.decoder.ctx.tiered.tier, step.index, step.q, step.cache, plan.rows,
            self.decoder.kernel_params, step.scaling, plan.workspace, state)
        return out.clone()  # the workspace's output buffer is shared by all layers
