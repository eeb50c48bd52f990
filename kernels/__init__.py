"""GPU kernels (Triton) for the sparse decode path, each beside its torch reference.

* ``block_summary``: per-page key min/max (in the KV dtype) maintained as KV is written;
* ``block_scores``: batched Quest block scores from the page summaries;
* ``token_scores``: label-channel token scores inside candidate blocks (fused gather);
* ``topk``: batched masked top-k (a static k, optionally lowered per request);
* ``sparse_attention``: split-KV decode attention over selected slots, with LSE;
* ``sparse_decode``: the whole CUDA-graph-safe pipeline (``sparse_decode_batched``), with the
  CPU tier's hooks (per-head page maps, fetch of the chosen blocks);
* ``working_set``: the tier's residency update (set difference, slot reuse, transfer list);
* ``host_gather`` / ``host_scatter``: zero-copy host->GPU block gather and GPU->host
  write-through for the CPU tier's pinned, head-major KV store;
* ``locality``: NOSA's locality constraint in the batched decode (page eviction scores, the
  eviction rule on a ranked kept set per request row, γ(t) bitmaps), oracle
  ``selection.locality.select_token_mask_locality``;
* ``guard_probe``: the accuracy guard's recall probe (dense LSE of one kv head per layer, on
  probe steps only, CUDA-graph safe);
* ``testing``: random paged batches for the tests and the benchmark's ``--check``.
"""
