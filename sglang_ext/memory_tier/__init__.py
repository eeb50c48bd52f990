"""The CPU KV tier (the AsyncTLS offload engine).

* ``host_store``: every token's K/V in pinned host memory, head-major per layer, written
  through as the pool is written (:mod:`kernels.host_scatter`), read back by block with the
  zero-copy gather (:mod:`kernels.host_gather`);
* ``working_set``: the GPU side: per (request, layer, kv head) page maps and working-set slots,
  the per-step residency update (:mod:`kernels.working_set`, the set difference) and its two
  schedules: ``sync`` (fetch the misses inside the step, exact) and ``async`` (attend with the
  blocks chosen at the previous step while this step's choice is fetched on a side stream);
* ``transfer_budget``: the admission's PCIe term: what a decode step may move and what a
  host-homed request is predicted to move (patches/scheduler.py admits against it).
"""
