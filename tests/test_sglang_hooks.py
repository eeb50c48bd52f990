"""The SGLang API this plugin is coupled to, recorded from sglang 0.5.16.

Every target the plugin hooks through SGLang's HookRegistry (``sglang_ext.plugin.hook_targets()``,
the list ``register()`` checks for existence) has its ``str(inspect.signature(...))`` recorded in
``HOOKED``; everything else we subclass, register with or call (public or private) is in
``COUPLED``, and the attributes of SGLang objects our hooks and classes read are in
``ATTRIBUTES``. A test fails, naming the target with its recorded and installed signature, when
SGLang changes one of them: review the hook (and docs/sglang-coupling.md) before re-recording.

To re-record after a deliberate upgrade: ``describe(resolve("module:qualname"))`` prints the
installed form of a target. CPU only, no hooks are applied: a few seconds, mostly SGLang imports.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import re
from typing import Any, Optional

import pytest

from sglang_ext import plugin
from sglang_ext.config import DENSE_BACKENDS

RECORDED_FROM = "0.5.16"

# Targets of plugin.hook_targets() (patches/*.py HOOKS), as "module:qualname". The set of keys
# must equal the plugin's list: a new hook has to be recorded here.
HOOKED: dict[str, str] = {
    # patches/server_args.py
    "sglang.srt.server_args:ServerArgs.add_cli_args":
        "(parser: 'argparse.ArgumentParser')",
    "sglang.srt.server_args:ServerArgs.from_cli_args":
        "(args: 'argparse.Namespace')",
    # patches/attention_registry.py
    "sglang.srt.utils.common:support_triton":
        "(backend: 'str') -> 'bool'",
    # patches/sampling_params.py
    "sglang.srt.sampling.sampling_params:SamplingParams.verify":
        "(self, vocab_size)",
    "sglang.srt.managers.tokenizer_manager:TokenizerManager._create_tokenized_object":
        "(self, obj: 'Union[GenerateReqInput, EmbeddingReqInput]', input_text: 'str', "
        "input_ids: 'Optional[List[int]]', input_embeds: 'Optional[List[List[float]]]' = None, "
        "mm_inputs=None, token_type_ids: 'Optional[List[int]]' = None) "
        "-> 'Union[TokenizedGenerateReqInput, TokenizedEmbeddingReqInput]'",
    # patches/tokenizer_manager.py
    "sglang.srt.managers.tokenizer_manager:TokenizerManager.generate_request":
        "(self, obj: 'Union[GenerateReqInput, EmbeddingReqInput]', "
        "request: 'Optional[fastapi.Request]' = None)",
    "sglang.srt.managers.tokenizer_manager:TokenizerManager._validate_one_request":
        "(self, obj: 'Union[GenerateReqInput, EmbeddingReqInput]', input_ids: 'List[int]') "
        "-> 'None'",
    # patches/req_to_token_pool.py
    "sglang.srt.mem_cache.memory_pool:ReqToTokenPool.alloc":
        "(self, reqs: 'list[Req]') -> 'Optional[List[int]]'",
    "sglang.srt.mem_cache.memory_pool:ReqToTokenPool.free":
        "(self, req: 'Req')",
    "sglang.srt.mem_cache.memory_pool:ReqToTokenPool.write":
        "(self, indices, values)",
    # patches/kv_cache_configurator.py
    "sglang.srt.mem_cache.kv_cache_configurator:KVCacheConfigurator._derive_pool_sizes":
        "(self, *, config: 'MemoryPoolConfig') -> '_PoolSizes'",
    "sglang.srt.mem_cache.kv_cache_configurator:KVCacheConfigurator._build_mha_kv_pool":
        "(self, *, max_total_num_tokens: 'int', mha_pool_class: 'type', quant_method=None) "
        "-> 'KVCache'",
    "sglang.srt.mem_cache.kv_cache_configurator:KVCacheConfigurator._build_mla_kv_pool":
        "(self, *, max_total_num_tokens: 'int') -> 'KVCache'",
    # patches/paged_allocator.py
    "sglang.srt.mem_cache.allocation:get_last_loc":
        "(req_to_token: 'torch.Tensor', req_pool_indices_tensor: 'torch.Tensor', "
        "prefix_lens_tensor: 'torch.Tensor') -> 'torch.Tensor'",
    "sglang.srt.mem_cache.allocator.paged:PagedTokenToKVPoolAllocator.alloc_extend":
        "(self, prefix_lens: 'torch.Tensor', prefix_lens_cpu: 'torch.Tensor', "
        "seq_lens: 'torch.Tensor', seq_lens_cpu: 'torch.Tensor', last_loc: 'torch.Tensor', "
        "extend_num_tokens: 'int', num_new_pages: 'int' = None)",
    "sglang.srt.mem_cache.allocator.paged:PagedTokenToKVPoolAllocator.alloc_decode":
        "(self, seq_lens: 'torch.Tensor', seq_lens_cpu: 'torch.Tensor', last_loc: 'torch.Tensor')",
    # patches/model_loader.py
    "sglang.srt.model_loader.loader:initialize_dummy_weights":
        "(model: torch.nn.modules.module.Module, low: float = -0.001, high: float = 0.001, "
        "seed: int = 1234) -> None",
    # patches/scheduler.py
    "sglang.srt.managers.scheduler:Scheduler.get_next_batch_to_run":
        "(self, running_batch: sglang.srt.managers.schedule_batch.ScheduleBatch, "
        "last_batch: Optional[sglang.srt.managers.schedule_batch.ScheduleBatch]) "
        "-> sglang.srt.managers.schedule_batch.NextBatchPlan",
    "sglang.srt.managers.scheduler:Scheduler.get_new_batch_prefill":
        "(self, running_batch: sglang.srt.managers.schedule_batch.ScheduleBatch) "
        "-> sglang.srt.managers.schedule_batch.NextBatchPlan",
    "sglang.srt.managers.schedule_policy:PrefillAdder.add_one_req":
        "(self, req: 'Req', has_chunked_req: 'bool', truncation_align_size: 'Optional[int]')",
    # patches/cuda_graph.py
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner:DecodeCudaGraphRunner"
    ".can_run_graph":
        "(self, forward_batch: 'ForwardBatch')",
}

# Not HookRegistry targets (plugin.py does not check them at start-up): what we register with,
# subclass, override or call. Enums are described by their member names.
_FORWARD = ("(self, q: 'torch.Tensor', k: 'torch.Tensor', v: 'torch.Tensor', "
            "layer: 'RadixAttention', forward_batch: 'ForwardBatch', save_kv_cache: 'bool' = True, "
            "**kwargs)")
COUPLED: dict[str, str] = {
    # sglang_ext/plugin.py
    "sglang.srt.plugins.hook_registry:HookRegistry.register":
        "(target: str, hook: collections.abc.Callable, hook_type: "
        "sglang.srt.plugins.hook_registry.HookType = <HookType.AFTER: 'after'>, *, "
        "source: sglang.srt.plugins.hook_registry.HookSource | None = None)",
    "sglang.srt.plugins.hook_registry:HookType": "enum BEFORE, AFTER, AROUND, REPLACE",
    # patches/attention_registry.py setup()
    "sglang.srt.layers.attention.attention_registry:register_attention_backend": "(name)",
    "sglang.srt.server_args:add_attention_backend_choices": "(choices)",
    # patches/server_args.py
    "sglang.srt.server_args:ServerArgs.override": "(self, source: 'str', **fields) -> 'None'",
    "sglang.srt.server_args:ServerArgs.get_model_config": "(self)",
    "sglang.srt.server_args:get_global_server_args": "() -> 'ServerArgs'",
    "sglang.srt.configs.model_config:ModelConfig.get_total_num_kv_heads": "(self) -> int",
    # patches/kv_cache_configurator.py (get_parallel through the configurator's own import)
    "sglang.srt.mem_cache.kv_cache_configurator:get_parallel": "() -> 'ParallelContext'",
    "sglang.srt.configs.model_config:ModelConfig.get_num_kv_heads":
        "(self, tensor_parallel_size) -> int",
    # patches/paged_allocator.py (get_num_new_pages is sglang.srt.utils.common's, re-exported)
    "sglang.srt.mem_cache.allocation:get_last_loc_torch":
        "(req_to_token: 'torch.Tensor', req_pool_indices_tensor: 'torch.Tensor', "
        "prefix_lens_tensor: 'torch.Tensor') -> 'torch.Tensor'",
    "sglang.srt.mem_cache.allocator.paged:alloc_extend_naive":
        "(prefix_lens, seq_lens, last_loc, free_pages, out_indices, page_size, device)",
    "sglang.srt.mem_cache.allocator.paged:get_num_new_pages":
        "(seq_lens: 'torch.Tensor', page_size: 'int', prefix_lens: 'Optional[torch.Tensor]' = None, "
        "decode: 'bool' = False) -> 'torch.Tensor'",
    # patches/scheduler.py
    "sglang.srt.managers.schedule_policy:AddReqResult": "enum CONTINUE, NO_TOKEN, OTHER",
    "sglang.srt.mem_cache.allocator.base:BaseTokenToKVPoolAllocator.available_size": "(self)",
    "sglang.srt.mem_cache.radix_cache:RadixCache.evictable_size": "(self)",
    # sglang_ext/attention/sparse_backend.py: SparseDecodeBackend(AttentionBackend) overrides
    "sglang.srt.layers.attention.base_attn_backend:AttentionBackend.__init__":
        "(self, /, *args, **kwargs)",
    "sglang.srt.layers.attention.base_attn_backend:AttentionBackend.init_forward_metadata":
        "(self, forward_batch: 'ForwardBatch')",
    "sglang.srt.layers.attention.base_attn_backend:AttentionBackend"
    ".init_forward_metadata_out_graph":
        "(self, forward_batch: 'ForwardBatch', in_capture: 'bool' = False)",
    "sglang.srt.layers.attention.base_attn_backend:AttentionBackend.init_cuda_graph_state":
        "(self, max_bs: 'int', max_num_tokens: 'int')",
    "sglang.srt.layers.attention.base_attn_backend:AttentionBackend"
    ".get_cuda_graph_seq_len_fill_value": "(self)",
    "sglang.srt.layers.attention.base_attn_backend:AttentionBackend.forward": _FORWARD,
    "sglang.srt.layers.attention.base_attn_backend:AttentionBackend.forward_extend": _FORWARD,
    "sglang.srt.layers.attention.base_attn_backend:AttentionBackend.forward_decode": _FORWARD,
    "sglang.srt.layers.attention.base_attn_backend:AttentionBackend.support_triton": "(self)",
    # ... and what it calls: the dense delegate's factories (via ATTENTION_BACKENDS), a private
    # method of the torch_native delegate, the pool's writes and reads, the batch's mode
    "sglang.srt.layers.attention.attention_registry:create_torch_native_backend": "(runner)",
    "sglang.srt.layers.attention.attention_registry:create_triton_backend": "(runner)",
    "sglang.srt.layers.attention.attention_registry:create_flashinfer_backend": "(runner)",
    "sglang.srt.layers.attention.torch_native_backend:TorchNativeAttnBackend"
    "._run_sdpa_forward_extend":
        "(self, query: 'torch.Tensor', output: 'torch.Tensor', k_cache: 'torch.Tensor', "
        "v_cache: 'torch.Tensor', req_to_token: 'torch.Tensor', req_pool_indices: 'torch.Tensor', "
        "seq_lens: 'torch.Tensor', extend_prefix_lens: 'torch.Tensor', "
        "extend_seq_lens: 'torch.Tensor', encoder_lens: 'Optional[torch.Tensor]' = None, "
        "scaling=None, enable_gqa=False, causal=False, is_cross_attn=False, "
        "sliding_window_size: 'Optional[int]' = None)",
    "sglang.srt.mem_cache.memory_pool:KVWriteLoc":
        "(loc: 'torch.Tensor', swa_loc: 'Optional[torch.Tensor]' = None, "
        "full_loc: 'Optional[torch.Tensor]' = None) -> None",
    "sglang.srt.model_executor.forward_batch_info:ForwardMode.is_idle": "(self)",
    "sglang.srt.model_executor.forward_batch_info:ForwardMode.is_decode_or_idle": "(self)",
    # sglang_ext/memory_tier/tiered_pool.py: TieredKVPool(MHATokenToKVPool) and
    # TieredMLAKVPool(MLATokenToKVPool) override these (and call the private writer)
    "sglang.srt.mem_cache.memory_pool:unwrap_write_loc": "(loc_info)",
    "sglang.srt.mem_cache.memory_pool:MHATokenToKVPool.__init__":
        "(self, size: 'int', page_size: 'int', dtype: 'torch.dtype', head_num: 'int', "
        "head_dim: 'int', layer_num: 'int', device: 'str', enable_memory_saver: 'bool', "
        "v_head_dim: 'Optional[int]' = None, swa_head_num: 'Optional[int]' = None, "
        "swa_head_dim: 'Optional[int]' = None, swa_v_head_dim: 'Optional[int]' = None, "
        "start_layer: 'Optional[int]' = None, end_layer: 'Optional[int]' = None, "
        "enable_alt_stream: 'bool' = True, enable_kv_cache_copy: 'bool' = False, "
        "kv_cache_layout: 'Optional[str]' = None, quant_method=None, "
        "post_capture_active: 'bool' = False)",
    "sglang.srt.mem_cache.memory_pool:MHATokenToKVPool.set_kv_buffer":
        "(self, layer: 'RadixAttention', loc_info, cache_k: 'torch.Tensor', "
        "cache_v: 'torch.Tensor', k_scale: 'Optional[float]' = None, "
        "v_scale: 'Optional[float]' = None, layer_id_override: 'Optional[int]' = None, "
        "dcp_kv_mask: 'Optional[torch.Tensor]' = None)",
    "sglang.srt.mem_cache.memory_pool:MHATokenToKVPool.get_key_buffer": "(self, layer_id: 'int')",
    "sglang.srt.mem_cache.memory_pool:MHATokenToKVPool.get_value_buffer":
        "(self, layer_id: 'int')",
    "sglang.srt.mem_cache.memory_pool:MLATokenToKVPool.__init__":
        "(self, size: 'int', page_size: 'int', dtype: 'torch.dtype', kv_lora_rank: 'int', "
        "qk_rope_head_dim: 'int', layer_num: 'int', device: 'str', enable_memory_saver: 'bool', "
        "start_layer: 'Optional[int]' = None, end_layer: 'Optional[int]' = None, "
        "use_dsa: 'bool' = False, override_kv_cache_dim: 'Optional[int]' = None)",
    "sglang.srt.mem_cache.memory_pool:MLATokenToKVPool.set_kv_buffer":
        "(self, layer: 'RadixAttention', loc_info, cache_k: 'torch.Tensor', "
        "cache_v: 'torch.Tensor')",
    "sglang.srt.mem_cache.memory_pool:MLATokenToKVPool.get_key_buffer": "(self, layer_id: 'int')",
    "sglang.srt.mem_cache.memory_pool:MLATokenToKVPool.get_value_buffer":
        "(self, layer_id: 'int')",
    "sglang.srt.mem_cache.memory_pool:MLATokenToKVPool.set_mla_kv_buffer":
        "(self, layer: 'RadixAttention', loc: 'torch.Tensor', cache_k_nope: 'torch.Tensor', "
        "cache_k_rope: 'torch.Tensor')",
    "sglang.srt.mem_cache.memory_pool:MLATokenToKVPool._write_mla_kv_buffer":
        "(self, dst_buffer: 'torch.Tensor', loc: 'torch.Tensor', cache_k_nope: 'torch.Tensor', "
        "cache_k_rope: 'torch.Tensor') -> 'None'",
    # patches/tokenizer_manager.py
    "sglang.srt.managers.io_struct:GenerateReqInput.contains_mm_input": "(self) -> 'bool'",
    "sglang.srt.managers.io_struct:EmbeddingReqInput.contains_mm_input": "(self) -> 'bool'",
    # sglang_ext/tensor_parallel.py, sglang_ext/selection/mla.py
    "sglang.srt.runtime_context:get_parallel": "() -> 'ParallelContext'",
    "sglang.srt.distributed.parallel_state:get_world_group":
        "() -> sglang.srt.distributed.parallel_state.GroupCoordinator",
    "sglang.srt.configs.model_config:AttentionArch": "enum MLA, MHA",
    # sglang_ext/cpu_shim: SGLang's caller of the stand-in sgl_kernel.assign_req_to_token_pool_cpu
    "sglang.srt.mem_cache.allocation:assign_req_to_token_pool_func":
        "(req_pool_indices: 'torch.Tensor', req_to_token: 'torch.Tensor', "
        "start_offset: 'torch.Tensor', end_offset: 'torch.Tensor', out_cache_loc: 'torch.Tensor', "
        "batch_size: 'int')",
}

# Attributes of SGLang objects that our hooks, backend and pools read (not getattr-with-default
# ones): a dataclass or msgspec field, a class attribute or property, or a `self.NAME = ...`
# assignment in the source of a class in the MRO.
ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "sglang.srt.server_args:ServerArgs": (
        "attention_backend", "decode_attention_backend", "prefill_attention_backend", "device",
        "page_size", "max_total_tokens", "max_prefill_tokens", "chunked_prefill_size",
        "max_running_requests", "kv_cache_dtype", "enable_memory_saver", "enable_metrics",
        "speculative_algorithm", "enable_mixed_chunk", "disable_cuda_graph",
        "enable_hierarchical_cache"),
    "sglang.srt.mem_cache.kv_cache_configurator:KVCacheConfigurator": (
        "server_args", "model_config", "kv_cache_dtype", "layer_info", "device", "is_hybrid_swa"),
    "sglang.srt.mem_cache.kv_cache_configurator:_PoolSizes": (
        "max_total_num_tokens", "max_running_requests"),
    "sglang.srt.model_executor.model_runner_components.layer_setup:ModelLayerInfo": (
        "num_effective_layers", "start_layer", "end_layer"),
    "sglang.srt.runtime_context:ParallelContext": ("attn_tp_size", "attn_tp_rank"),
    "sglang.srt.distributed.parallel_state:GroupCoordinator": ("cpu_group",),
    "sglang.srt.configs.model_config:ModelConfig": (
        "context_len", "num_hidden_layers", "head_dim", "kv_lora_rank", "qk_rope_head_dim",
        "attention_arch", "vocab_size", "hidden_size"),
    "sglang.srt.managers.scheduler:Scheduler": (
        "waiting_queue", "tree_cache", "token_to_kv_pool_allocator", "chunked_req"),
    "sglang.srt.managers.schedule_policy:PrefillAdder": ("can_run_list",),
    "sglang.srt.managers.schedule_batch:Req": (
        "origin_input_ids", "output_ids", "req_pool_idx", "sampling_params"),
    "sglang.srt.sampling.sampling_params:SamplingParams": ("custom_params",),
    "sglang.srt.managers.tokenizer_manager:TokenizerManager": ("model_config",),
    "sglang.srt.managers.io_struct:GenerateReqInput": (
        "text", "input_ids", "input_embeds", "sampling_params", "return_logprob",
        "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "return_sampling_mask",
        "custom_logit_processor", "lora_path", "return_hidden_states", "bootstrap_host",
        "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size"),
    "sglang.srt.managers.io_struct:EmbeddingReqInput": ("input_ids", "input_embeds"),
    "sglang.srt.mem_cache.memory_pool:ReqToTokenPool": ("req_to_token",),
    "sglang.srt.mem_cache.allocator.paged:PagedTokenToKVPoolAllocator": (
        "free_pages", "page_size", "device"),
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner:DecodeCudaGraphRunner": (
        "model_runner",),
    "sglang.srt.model_executor.model_runner:ModelRunner": (
        "device", "server_args", "model_config", "req_to_token_pool", "token_to_kv_pool"),
    "sglang.srt.layers.attention.base_attn_backend:AttentionBackend": ("needs_cpu_seq_lens",),
    "sglang.srt.model_executor.forward_batch_info:ForwardBatch": (
        "forward_mode", "req_pool_indices", "seq_lens", "seq_lens_cpu", "out_cache_loc",
        "extend_seq_lens", "extend_prefix_lens", "extend_seq_lens_cpu", "extend_prefix_lens_cpu",
        "encoder_lens"),
    "sglang.srt.layers.radix_attention:RadixAttention": (
        "layer_id", "tp_q_head_num", "tp_k_head_num", "qk_head_dim", "v_head_dim", "scaling",
        "is_cross_attention", "sliding_window_size", "attn_type", "k_scale_float",
        "v_scale_float"),
    "sglang.srt.mem_cache.memory_pool:MHATokenToKVPool": (
        "k_buffer", "v_buffer", "store_dtype", "dtype", "head_num", "head_dim", "v_head_dim",
        "layer_num", "start_layer", "device", "kv_cache_layout"),
    "sglang.srt.mem_cache.memory_pool:MLATokenToKVPool": (
        "kv_buffer", "kv_lora_rank", "kv_cache_dim", "store_dtype", "dtype", "layer_num",
        "start_layer", "device"),
}


# ------------------------------------------------------------------------------------ helpers

def installed_version() -> str:
    import sglang

    return getattr(sglang, "__version__", "?")


def module_qualname(dotted: str) -> str:
    """A HookRegistry target ("pkg.module.Class.method") as "pkg.module:Class.method": the
    longest importable prefix is the module."""
    parts = dotted.split(".")
    module = parts[0]
    importlib.import_module(module)
    for i in range(1, len(parts)):
        candidate = ".".join(parts[: i + 1])
        try:
            importlib.import_module(candidate)
        except ModuleNotFoundError as e:
            if e.name != candidate:
                raise
            break
        module = candidate
    return f"{module}:{dotted[len(module) + 1:]}"


def resolve(target: str) -> Any:
    module, _, qualname = target.partition(":")
    obj = importlib.import_module(module)
    for attr in qualname.split("."):
        obj = getattr(obj, attr)
    return obj


def describe(obj: Any) -> str:
    """What we record of a target: its signature (through HookRegistry's functools.wraps, were
    the hooks applied in this process), or an enum's member names."""
    if isinstance(obj, type) and issubclass(obj, enum.Enum):
        return "enum " + ", ".join(obj.__members__)
    return str(inspect.signature(obj))


def signature_problem(target: str, recorded: str) -> Optional[str]:
    """None if ``target`` still resolves with the ``recorded`` description, else one message
    naming the target, the recorded and the installed form."""
    header = f"SGLang API change at {target} (recorded from sglang {RECORDED_FROM}, " \
             f"installed {installed_version()})"
    try:
        obj = resolve(target)
    except (ImportError, AttributeError) as e:
        return f"{header}: it disappeared ({type(e).__name__}: {e})\n  recorded: {recorded}"
    try:
        now = describe(obj)
    except (TypeError, ValueError) as e:
        now = f"<no signature: {e}>"
    if now == recorded:
        return None
    return f"{header}: the signature changed\n  recorded:  {recorded}\n  installed: {now}"


def _assigned_in_source(cls: type, name: str) -> bool:
    pattern = re.compile(rf"\bself\.{re.escape(name)}\s*(?::[^=\n]+)?=(?!=)")
    for klass in cls.__mro__:
        if klass is object:
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if pattern.search(source):
            return True
    return False


def has_attribute(cls: type, name: str) -> bool:
    if dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}:
        return True
    if name in getattr(cls, "__struct_fields__", ()):  # msgspec.Struct
        return True
    if any(name in vars(klass) for klass in cls.__mro__):
        return True
    return _assigned_in_source(cls, name)


def attribute_problem(target: str, names: tuple[str, ...]) -> Optional[str]:
    try:
        cls = resolve(target)
    except (ImportError, AttributeError) as e:
        return f"SGLang class {target} disappeared ({type(e).__name__}: {e})"
    missing = [name for name in names if not has_attribute(cls, name)]
    if not missing:
        return None
    return (f"SGLang API change at {target} (recorded from sglang {RECORDED_FROM}, installed "
            f"{installed_version()}): no longer defines {', '.join(missing)}")


def _hook_files() -> dict[str, str]:
    """Each HookRegistry target's patches/ module (plugin's own list of patch modules)."""
    return {module_qualname(target): module.__name__.rpartition(".")[2]
            for module in plugin._patch_modules() for target, _, _ in module.HOOKS}


# -------------------------------------------------------------------------------------- tests

def test_every_plugin_hook_is_recorded() -> None:
    targets = [module_qualname(t) for t in plugin.hook_targets()]
    assert len(targets) == len(set(targets)), f"a target is hooked twice: {sorted(targets)}"
    unrecorded = sorted(set(targets) - set(HOOKED))
    stale = sorted(set(HOOKED) - set(targets))
    assert not unrecorded, (
        "hooked by the plugin but not recorded in HOOKED (record describe(resolve(target))): "
        + ", ".join(f"{t} = {describe(resolve(t))!r}" for t in unrecorded))
    assert not stale, f"recorded in HOOKED but no longer hooked by the plugin: {stale}"


@pytest.mark.parametrize("target", sorted(HOOKED))
def test_hooked_signature_unchanged(target: str) -> None:
    problem = signature_problem(target, HOOKED[target])
    assert problem is None, f"{problem}\n  hooked in patches/{_hook_files().get(target, '?')}.py"


@pytest.mark.parametrize("target", sorted(COUPLED))
def test_coupled_signature_unchanged(target: str) -> None:
    problem = signature_problem(target, COUPLED[target])
    assert problem is None, problem


@pytest.mark.parametrize("target", sorted(ATTRIBUTES))
def test_attributes_we_read_exist(target: str) -> None:
    problem = attribute_problem(target, ATTRIBUTES[target])
    assert problem is None, problem


def test_dense_delegates_are_registered() -> None:
    """--sparse-dense-backend names are looked up in SGLang's ATTENTION_BACKENDS dict."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    missing = [name for name in DENSE_BACKENDS if name != "auto" and name not in ATTENTION_BACKENDS]
    assert not missing, f"SGLang's ATTENTION_BACKENDS lacks our dense delegates {missing}"


def test_recorded_tables_do_not_overlap() -> None:
    assert not set(HOOKED) & set(COUPLED)


# ------------------------------------------------------------- the comparison can fail at all

def test_changed_signature_is_detected() -> None:
    target = "sglang.srt.mem_cache.memory_pool:ReqToTokenPool.free"
    wrong = "(self, req: 'Req', extra: int = 0)"
    problem = signature_problem(target, wrong)
    assert problem is not None
    assert target in problem and wrong in problem and HOOKED[target] in problem
    assert signature_problem(target, HOOKED[target]) is None


def test_disappeared_target_is_detected() -> None:
    for target in ("sglang.srt.mem_cache.memory_pool:ReqToTokenPool.free_everything",
                   "sglang.srt.no_such_module:anything"):
        problem = signature_problem(target, "(self)")
        assert problem is not None and target in problem and "disappeared" in problem


def test_changed_enum_and_missing_attribute_are_detected() -> None:
    assert signature_problem("sglang.srt.managers.schedule_policy:AddReqResult",
                             "enum CONTINUE, OTHER") is not None
    problem = attribute_problem("sglang.srt.managers.scheduler:Scheduler",
                                ("waiting_queue", "no_such_queue"))
    assert problem is not None and "no_such_queue" in problem and "waiting_queue" not in problem


def test_module_qualname_splits_at_the_module() -> None:
    assert module_qualname("sglang.srt.server_args.ServerArgs.add_cli_args") \
        == "sglang.srt.server_args:ServerArgs.add_cli_args"
    assert module_qualname("sglang.srt.utils.common.support_triton") \
        == "sglang.srt.utils.common:support_triton"
