"""Rotary position embeddings (RoPE), with Llama 3.1 frequency scaling."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class RoPEScalingArgs:
    """Llama 3.1 RoPE frequency scaling (HF ``rope_scaling`` with ``rope_type="llama3"``).

    Frequencies whose wavelength is shorter than ``original_max_position_embeddings /
    high_freq_factor`` are kept; those longer than ``original_max_position_embeddings /
    low_freq_factor`` are divided by ``scale_factor``; the band in between is interpolated.
    """

    scale_factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def rope_frequencies(
    head_dim: int, theta: float, device: torch.device | None = None
) -> torch.Tensor:
    """Unscaled RoPE frequencies ``theta ** (-2i / head_dim)``, float32, shape ``[head_dim // 2]``."""
    exponents = torch.arange(0, head_dim, 2, device=device)[: head_dim // 2].float() / head_dim
    return 1.0 / (theta**exponents)


def apply_rope_scaling(freqs: torch.Tensor, scaling: RoPEScalingArgs) -> torch.Tensor:
    """Apply Llama 3.1 frequency scaling to ``freqs`` (returns a new tensor)."""
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        raise ValueError(
            "rope_scaling.high_freq_factor must be greater than low_freq_factor "
            f"(got {scaling.high_freq_factor} <= {scaling.low_freq_factor})"
        )
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / freqs
    # long wavelengths (low frequencies): divide by the scale factor
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / scaling.scale_factor, freqs)
    # medium band: interpolate between scaled and original frequencies
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * freqs / scaling.scale_factor + smooth * freqs
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def precompute_freqs_cis(
    head_dim: int,
    end: int,
    theta: float = 10000.0,
    scaling: RoPEScalingArgs | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Complex RoPE table ``exp(i * t * freq)``: complex64, shape ``[end, head_dim // 2]``."""
    freqs = rope_frequencies(head_dim, theta, device=device)
    if scaling is not None:
        freqs = apply_rope_scaling(freqs, scaling)
    t = torch.arange(end, device=freqs.device, dtype=torch.float32)
    angles = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``xq``/``xk`` (``[B, S, H, head_dim]``) by the first ``S`` rows of ``freqs_cis``.

    The rotation is computed in float32 and the results are cast back to the inputs' dtypes.
    """
    seqlen = xq.shape[1]
    if freqs_cis.shape[0] < seqlen:
        raise ValueError(
            f"sequence length {seqlen} exceeds the RoPE table ({freqs_cis.shape[0]} positions); "
            "raise the model's max_seq_len (it is set from training.seq_len)"
        )
    freqs = freqs_cis[:seqlen].view(1, seqlen, 1, freqs_cis.shape[-1])
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    xq_out = torch.view_as_real(xq_ * freqs).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)
