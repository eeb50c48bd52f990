"""Token selection for two-level sparse decode attention (Quest blocks, then DS tokens): its
types and settings in :mod:`params`, the per-request torch oracle in :mod:`reference`."""

from sglang_ext.selection.params import METHODS, SCORINGS, SelectionParams
from sglang_ext.selection.reference import (
    block_minmax,
    label_token_scores,
    merge_attention_states,
    quest_block_scores,
    select_token_mask,
    sparse_attention,
    sparse_attention_with_lse,
    sparse_decode,
)

__all__ = [
    "METHODS",
    "SCORINGS",
    "SelectionParams",
    "block_minmax",
    "label_token_scores",
    "merge_attention_states",
    "quest_block_scores",
    "select_token_mask",
    "sparse_attention",
    "sparse_attention_with_lse",
    "sparse_decode",
]
