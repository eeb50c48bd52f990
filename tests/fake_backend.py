"""Stand-ins for the SGLang objects the backend's decode path touches (no server, no model)."""

from __future__ import annotations

from types import SimpleNamespace

import torch


class FakePool:
    """The KV-pool calls the decode path makes, over plain per-layer tensors ``[slots, Hkv, D]``."""

    start_layer = 0

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        self.k, self.v = k, v
        self.layer_num = self.end_layer = len(k)

    def set_kv_buffer(self, layer, loc_info, k, v) -> None:
        self.k[layer.layer_id][loc_info.loc] = k.view(-1, *self.k[0].shape[1:])
        self.v[layer.layer_id][loc_info.loc] = v.view(-1, *self.v[0].shape[1:])

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v[layer_id]


class DecodeMode:
    def is_decode_or_idle(self) -> bool:
        return True

    def is_idle(self) -> bool:
        return False


class ExtendMode:
    def is_decode_or_idle(self) -> bool:
        return False

    def is_idle(self) -> bool:
        return False

    def is_decode(self) -> bool:
        return False


class FakeReqToTokenPool:
    """SGLang's ReqToTokenPool as the backend reads it: each request row's KV slots by position
    (an object the side tables can key weakly, unlike a SimpleNamespace)."""

    def __init__(self, req_to_token: torch.Tensor) -> None:
        self.req_to_token = req_to_token


class FakeReq(SimpleNamespace):
    """A scheduler request as the admission hooks read it: hashed by identity like SGLang's Req
    (unlike a SimpleNamespace), so the side tables can key it weakly."""

    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        return self is other


class FakePrefillAdder:
    """The part of SGLang's PrefillAdder the tier admission hook touches; its own add_one_req
    admits all. ``free_tokens``: what its allocator reports free (no allocator: None)."""

    def __init__(self, free_tokens: int | None = None) -> None:
        self.can_run_list: list = []
        self.rem_total_token_offset = 0
        if free_tokens is not None:
            self.token_to_kv_pool_allocator = SimpleNamespace(available_size=lambda: free_tokens)

    def add_one_req(self, req, has_chunked_req=False, truncation_align_size=None):
        from sglang.srt.managers.schedule_policy import AddReqResult

        self.can_run_list.append(req)
        return AddReqResult.CONTINUE

    def admit(self, req) -> object:
        """``req`` through the scheduler patch's admission, then this adder."""
        from sglang_ext.patches import scheduler

        return scheduler._around_add_one_req(FakePrefillAdder.add_one_req, self, req,
                                             has_chunked_req=False, truncation_align_size=None)
