"""Optional features of the decode step, one module each, each a ``DecodeFeature``
(attention/decode_plan.py) that the decoder builds only when the configuration enables it:

* ``guard``: the accuracy guard (``--sparse-guard-every``);
* ``locality``: NOSA's locality constraint (``--sparse-locality-blocks``);
* ``async_filter``: AsyncTLS's block filter one step ahead (``--sparse-block-filter async``);
* ``tier``: the CPU tier's driver (``--sparse-tier``);
* ``cooperative``: Fluxion's CPU-GPU cooperative attention (``--sparse-cooperative on``).

Fluxion's output-aware scoring and head policy run in the reference decode only
(selection/reference.py); on the batched decode they will be one more module here.
"""
