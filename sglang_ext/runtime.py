"""This process's sglang_ext state, in one explicit object.

SGLang calls our hooks as free functions in each of its processes (the launcher, the
tokenizer manager, the scheduler); what one hook learns and a later one needs (the parsed config,
the CPU tier's layout and pool, the scheduler's chunk-prefilled request) lives here rather than
in module globals. Side tables that belong to an SGLang object (e.g. per-row request settings
under the request-to-token pool) are keyed by that object in a ``WeakKeyDictionary``, so they
go with it and nothing is set on SGLang's objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional
from weakref import WeakKeyDictionary


@dataclass
class ProcessState:
    # patches/server_args.py: the config the CLI parsed (main process) or the scheduler's
    config: Optional[Any] = None
    impl: Optional[str] = None  # the decode implementation the launched server runs
    mla: bool = False  # whether the launched server's model has an MLA (latent) KV pool
    # patches/kv_cache_configurator.py: the CPU tier's layout, planned before the pool is built
    tier_layout: Optional[Any] = None
    # memory_tier/tiered_pool.py: the tier's pool once the backend has bound it
    tier_pool: Optional[Any] = None
    # patches/scheduler.py: the chunk-prefilled request, during get_new_batch_prefill
    chunked_req: Any = None
    # plugin.py: whether the hooks are registered in this process
    plugin_registered: bool = False
    # called with each sparse attention backend once it is built (benchmark hooks)
    backend_listeners: list[Callable[[Any], None]] = field(default_factory=list)
    # per SGLang object (weakly): side tables such as attention/request_overrides.py's
    side_tables: WeakKeyDictionary = field(default_factory=WeakKeyDictionary)

    def side_table(self, owner: Any, factory: Callable[[], Any]) -> Any:
        """``owner``'s side table, made by ``factory`` the first time."""
        table = self.side_tables.get(owner)
        if table is None:
            table = self.side_tables[owner] = factory()
        return table

    def backend_built(self, backend: Any) -> None:
        for listener in self.backend_listeners:
            listener(backend)


_STATE = ProcessState()


def state() -> ProcessState:
    """This process's state."""
    return _STATE
