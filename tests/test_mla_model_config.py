"""The DeepSeek-V2-Lite-shaped config (benchmarks/models/deepseek-v2-lite-shape, config only, for
dummy weights) is accepted by SGLang 0.5.16's config loader as an MLA model with the real
model's attention shapes, and its architecture resolves to SGLang's DeepSeek-V2 model class."""

from __future__ import annotations

import math
from pathlib import Path

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


def test_startup_refuses_mla_models_in_one_line():
    """Until the backend decodes MLA pools, an MLA model stops start-up with one line; other
    models pass the check."""
    from types import SimpleNamespace

    import pytest
    from sglang.srt.configs.model_config import ModelConfig

    from sglang_ext.patches.server_args import refuse_mla_models

    mla = ModelConfig(str(CONFIG_DIR), trust_remote_code=False, dtype="bfloat16")
    with pytest.raises(SystemExit, match=r"^sglang_ext: MLA models .* not served"):
        refuse_mla_models(SimpleNamespace(get_model_config=lambda: mla))
    mha = SimpleNamespace(attention_arch=type(mla.attention_arch).MHA)
    refuse_mla_models(SimpleNamespace(get_model_config=lambda: mha))
