"""The DeepSeek-V2-Lite-shaped config (benchmarks/models/deepseek-v2-lite-shape, config only, for
dummy weights) is accepted by SGLang 0.5.16's config loader as an MLA model with the real
model's attention shapes, and its architecture resolves to SGLang's DeepSeek-V2 model class."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest

CONFIG_DIR = Path(__file__).resolve().parent.parent / "benchmarks" / "models" / "deepseek-v2-lite-shape"


def test_sglang_loads_it_as_an_mla_model():
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig
    from sglang.srt.models.registry import ModelRegistry

    mc = ModelConfig(str(CONFIG_DIR), trust_remote_code=False, dtype="bfloat16")
    assert mc.attention_arch == AttentionArch.MLA
    assert (mc.kv_lora_rank, mc.qk_rope_head_dim, mc.qk_nope_head_dim, mc.v_head_dim) == (512, 64, 128, 128)
    assert (mc.num_attention_heads, mc.num_hidden_layers) == (16, 27)
    hf = mc.hf_config
    assert (hf.hidden_size, hf.vocab_size, hf.n_routed_experts, hf.num_experts_per_tok,
            hf.n_shared_experts, hf.first_k_dense_replace) == (2048, 102400, 64, 6, 2, 1)
    # the softmax scale the MLA layer uses (selection/mla.py): 192^-0.5 times YaRN's mscale^2
    mscale = 0.1 * 0.707 * math.log(40) + 1.0
    assert math.isclose(mc.scaling, (128 + 64) ** -0.5 * mscale**2, rel_tol=1e-6)
    model_cls, arch = ModelRegistry.resolve_model_cls(hf.architectures)
    assert arch == "DeepseekV2ForCausalLM" and model_cls.__name__ == "DeepseekV2ForCausalLM"


@pytest.fixture(scope="module")
def mla_config():
    from sglang.srt.configs.model_config import ModelConfig

    return ModelConfig(str(CONFIG_DIR), trust_remote_code=False, dtype="bfloat16")


def _server_args(model_config, device: str = "cuda") -> SimpleNamespace:
    return SimpleNamespace(get_model_config=lambda: model_config, device=device)


def test_kv_layout_is_the_latent_row(mla_config):
    """Label files, summaries and pool sizing see one kv head of R + P dims storing no separate
    V, not the MHA-path prefill's 16 heads of 256 dims ModelConfig reports."""
    from sglang_ext.selection.mla import KVLayout, kv_layout

    assert (mla_config.get_total_num_kv_heads(), mla_config.head_dim) == (16, 256)
    assert kv_layout(mla_config) == KVLayout(num_kv_heads=1, head_dim=576, stored_v_dims=0)


def test_startup_takes_mla_models_with_what_works(mla_config):
    from sglang_ext.config import build_config
    from sglang_ext.patches.server_args import check_mla_model

    for values in ({}, {"method": "quest", "budget": 1024}, {"method": "ds"},
                   {"impl": "reference"}, {"tier": "async"}, {"tier": "sync", "method": "quest"}):
        check_mla_model(_server_args(mla_config), build_config(**values))


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp4_e2m1"])
def test_startup_refuses_the_tier_on_quantised_mla_rows_in_one_line(mla_config, kv_cache_dtype):
    """The tier's MLA pool moves 16-bit latent rows (8-bit ones are stored as bytes, FP4 ones
    come from a pool factory the tier does not hook)."""
    from sglang_ext.config import build_config
    from sglang_ext.patches.server_args import check_mla_model

    args = _server_args(mla_config)
    args.kv_cache_dtype = kv_cache_dtype
    check_mla_model(args, build_config())  # without the tier: fine
    with pytest.raises(SystemExit) as e:
        check_mla_model(args, build_config(tier="async"))
    message = str(e.value)
    assert message.startswith("sglang_ext: --sparse-tier does not support MLA models with "
                              f"--kv-cache-dtype {kv_cache_dtype}") and "\n" not in message


@pytest.mark.parametrize("values, flag", [
    ({"guard_every": 8}, "--sparse-guard-every"),
    ({"scoring": "output_aware"}, "--sparse-scoring output_aware"),
    ({"head_policy": __file__}, "--sparse-head-policy"),
    ({"eviction_head": __file__}, "--sparse-eviction-head"),
    ({"locality_blocks": 2}, "--sparse-locality-blocks"),
    ({"summary_dtype": "fp8_e4m3"}, "--sparse-summary-dtype fp8_e4m3"),
])
def test_startup_refuses_what_mla_lacks_in_one_line(mla_config, values, flag):
    from sglang_ext.config import build_config
    from sglang_ext.patches.server_args import check_mla_model

    with pytest.raises(SystemExit) as e:
        check_mla_model(_server_args(mla_config), build_config(**values))
    message = str(e.value)
    assert message.startswith(f"sglang_ext: {flag} does not support MLA models") and "\n" not in message


def test_startup_refuses_mla_models_on_cpu_and_takes_mha_models(mla_config):
    """On a CPU no dense backend runs an MLA model's (MHA-path) prefill; MHA models pass."""
    from sglang_ext.config import build_config
    from sglang_ext.patches.server_args import check_mla_model

    with pytest.raises(SystemExit, match=r"^sglang_ext: MLA models .* need a CUDA device"):
        check_mla_model(_server_args(mla_config, "cpu"), build_config())
    mha = SimpleNamespace(attention_arch=type(mla_config.attention_arch).MHA)
    check_mla_model(_server_args(mha, "cpu"), build_config(tier="async"))


def test_label_config_is_checked_against_the_latent_row(mla_config, tmp_path):
    import json

    from sglang_ext.config import build_config
    from sglang_ext.patches.server_args import _check_label_config
    from sglang_ext.selection.calibrate import FORMAT

    def labels(heads: int, dims: int) -> str:
        path = tmp_path / f"labels-{heads}-{dims}.json"
        path.write_text(json.dumps({
            "format": FORMAT, "model": {"num_layers": 27, "num_kv_heads": heads, "head_dim": dims},
            "label_channels": 2, "channels": [[[0, dims - 1]] * heads] * 27}))
        return str(path)

    _check_label_config(_server_args(mla_config), build_config(
        label_config=labels(1, 576), label_channels=2))
    with pytest.raises(SystemExit, match=r"^sglang_ext: --sparse-label-config: .* model has 27/1/576$"):
        _check_label_config(_server_args(mla_config), build_config(
            label_config=labels(16, 256), label_channels=2))


def test_requests_asking_for_what_mla_lacks_get_a_400(monkeypatch):
    """Per-request settings are checked at arrival like the flags (ValueError = a 400)."""
    from sglang_ext.config import build_config
    from sglang_ext import runtime
    from sglang_ext.patches import sampling_params

    process = runtime.state()
    monkeypatch.setattr(process, "config", build_config(budget=256))
    monkeypatch.setattr(process, "impl", "reference")
    monkeypatch.setattr(process, "mla", True)
    ok = SimpleNamespace(custom_params={"sparse": {"method": "quest", "budget": 512}})
    sampling_params._after_verify(None, ok)
    sampling_params._after_verify(None, SimpleNamespace(custom_params={"sparse": {"method": "dense"}}))
    for override, key in (({"scoring": "output_aware"}, "scoring"),
                          ({"locality_blocks": 2}, "locality_blocks")):
        with pytest.raises(ValueError, match=rf"custom_params.sparse.{key} .* does not support MLA"):
            sampling_params._after_verify(None, SimpleNamespace(custom_params={"sparse": override}))
