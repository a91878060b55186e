"""YaRN RoPE scaling (torchtitan/models/common/rope.py) equals transformers' ``yarn`` rope init."""

from __future__ import annotations

import pytest
import torch

from torchtitan.models.common.rope import (
    YaRNScalingArgs,
    precompute_freqs_cis,
    rope_frequencies,
    yarn_frequencies,
    yarn_get_mscale,
)

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(
    "theta, factor, original, dim, mscale, mscale_all_dim",
    [(10000.0, 40.0, 4096, 64, 1.0, 1.0), (50000.0, 4.0, 16, 16, 0.707, 0.8), (1e4, 8.0, 32, 8, 1.0, 1.0)],
)
def test_yarn_frequencies_bit_identical_to_hf(theta, factor, original, dim, mscale, mscale_all_dim):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.DeepseekV3Config(
        hidden_size=64, num_attention_heads=2, qk_rope_head_dim=dim,
        max_position_embeddings=original * int(factor),
        rope_parameters={"rope_type": "yarn", "rope_theta": theta, "factor": factor,
                         "original_max_position_embeddings": original, "beta_fast": 32,
                         "beta_slow": 1, "mscale": mscale, "mscale_all_dim": mscale_all_dim},
    )
    hf_freqs, hf_attention_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    scaling = YaRNScalingArgs(
        factor=factor, original_max_position_embeddings=original,
        attention_factor=yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim),
    )
    ours = yarn_frequencies(dim, theta, scaling)
    assert torch.equal(ours, hf_freqs)
    assert scaling.attention_factor == pytest.approx(hf_attention_factor, abs=1e-12)
    plain = rope_frequencies(dim, theta)
    assert plain[0] == ours[0] and ours[-1] == pytest.approx(plain[-1] / factor)  # kept / divided
    table = precompute_freqs_cis(dim, 12, theta, scaling)
    assert table.shape == (12, dim // 2) and table.dtype == torch.complex64
    torch.testing.assert_close(table.abs(), torch.full((12, dim // 2), scaling.attention_factor))
