"""Stream-ordered timestamps that work inside CUDA graphs: how much of the tier's transfer time
the decode step hides.

CUDA events cannot time work inside a captured graph the way SGLang replays it, so the clock is
a one-thread kernel that reads the GPU's global timer (``%globaltimer``, nanoseconds) when its
stream reaches it: ``mark(slot)`` stores the time, ``add_since(slot, acc)`` adds the time since
``slot`` to the accumulator ``acc``. Both are ordinary kernel launches with static arguments, so
they are captured with the step and replayed every step, and the accumulators are read (one host
sync) only when the counters are. On the CPU (no streams: everything runs in call order) the same
calls use the host clock, which is the reference the CUDA path is tested against.
"""

from __future__ import annotations

import time

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer


# Slot numbers stay runtime values: Triton would otherwise specialise 1 and multiples of 16 into
# separate kernels, each compiled at its first launch, possibly inside a timed span.
@triton.jit(do_not_specialize=["mark", "acc"])
def _clock_kernel(BUF, mark, acc, ACCUMULATE: tl.constexpr):
    now = globaltimer()
    if ACCUMULATE:
        start = tl.load(BUF + mark)
        tl.store(BUF + acc, tl.load(BUF + acc) + tl.maximum(now - start, 0))
    else:
        tl.store(BUF + mark, now)


class StreamClock:
    """``slots`` int64 values on ``device``: marks and nanosecond accumulators."""

    def __init__(self, slots: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.buf = torch.zeros(slots, dtype=torch.int64, device=self.device)
        if self.device.type == "cuda":
            # Compile both kernel variants now: a first launch in the middle of a timed span
            # would stall the stream for the JIT's host time and count it as GPU time.
            self.mark(0)
            self.add_since(0, 0)
            self.buf.zero_()

    def mark(self, slot: int) -> None:
        """Stamp ``slot`` with the time the current stream reaches this call."""
        if self.device.type == "cuda":
            _clock_kernel[(1,)](self.buf, slot, slot, ACCUMULATE=False)
        else:
            self.buf[slot] = time.perf_counter_ns()

    def add_since(self, slot: int, acc: int) -> None:
        """Add the time since ``mark(slot)`` (as the current stream reaches this call) to
        ``acc``."""
        if self.device.type == "cuda":
            _clock_kernel[(1,)](self.buf, slot, acc, ACCUMULATE=True)
        else:
            self.buf[acc] += max(time.perf_counter_ns() - int(self.buf[slot]), 0)

    def read(self) -> list[int]:
        """Every slot's value (a host sync on CUDA)."""
        return self.buf.tolist()
