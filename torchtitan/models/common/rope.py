"""Rotary position embeddings (RoPE), with Llama 3.1 and YaRN frequency scaling, in two
pairings: interleaved ``(2i, 2i+1)`` (:func:`apply_rotary_emb`) and HF's rotate-half
``(i, i + head_dim/2)`` (:func:`apply_rotary_emb_half`)."""

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


@dataclass
class YaRNScalingArgs:
    """YaRN RoPE scaling (HF ``rope_type="yarn"``, DeepSeek-V2/V3), as transformers computes it.

    Frequencies rotating more than ``beta_fast`` times over ``original_max_position_embeddings``
    positions are kept, those rotating fewer than ``beta_slow`` times are divided by ``factor``,
    with a linear ramp between (bounds floored/ceiled when ``truncate``). ``attention_factor``
    multiplies the rotation (HF scales cos/sin by it), i.e. the rotated part of q.k by its square.
    """

    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 when ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_frequencies(
    head_dim: int, theta: float, scaling: YaRNScalingArgs, device: torch.device | None = None
) -> torch.Tensor:
    """YaRN-scaled RoPE frequencies, float32 ``[head_dim // 2]`` (bit-identical to HF's)."""
    if scaling.factor <= 0:
        raise ValueError(f"YaRN factor={scaling.factor} must be positive")

    def correction_dim(rotations: float) -> float:
        length = scaling.original_max_position_embeddings
        return head_dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = (torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)
    keep = (1 - ramp.clamp(0, 1)).to(device)  # 1: keep the frequency, 0: divide by factor
    pos = theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    return 1.0 / (scaling.factor * pos) * (1 - keep) + 1.0 / pos * keep


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
    scaling: RoPEScalingArgs | YaRNScalingArgs | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Complex RoPE table ``exp(i * t * freq)``: complex64, shape ``[end, head_dim // 2]``
    (magnitude ``attention_factor`` with YaRN scaling, else 1)."""
    magnitude = 1.0
    if isinstance(scaling, YaRNScalingArgs):
        freqs = yarn_frequencies(head_dim, theta, scaling, device=device)
        magnitude = scaling.attention_factor
    else:
        freqs = rope_frequencies(head_dim, theta, device=device)
        if scaling is not None:
            freqs = apply_rope_scaling(freqs, scaling)
    t = torch.arange(end, device=freqs.device, dtype=torch.float32)
    angles = torch.outer(t, freqs).float()
    return torch.polar(torch.full_like(angles, magnitude), angles)


def _first_rows(freqs_cis: torch.Tensor, seqlen: int) -> torch.Tensor:
    """The table's first ``seqlen`` rows; one clear error when it is shorter."""
    if freqs_cis.shape[0] < seqlen:
        raise ValueError(
            f"sequence length {seqlen} exceeds the RoPE table ({freqs_cis.shape[0]} positions); "
            "raise the model's max_seq_len (it is set from training.seq_len)"
        )
    return freqs_cis[:seqlen]


def _cos_sin(freqs_cis: torch.Tensor, seqlen: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The real and imaginary parts (magnitude x cos, magnitude x sin) of the first ``seqlen``
    rows of the table, as float32 ``[1, seqlen, 1, head_dim/2]`` views. ``freqs_cis`` is the
    complex table ``[>=seqlen, head_dim/2]`` (what the decoder passes its blocks: FSDP's mixed
    precision would cast a real one to bfloat16 on its way in) or its real view
    ``[>=seqlen, head_dim/2, 2]``. Compiled, only this view of the small table touches a
    complex tensor; q and k are rotated in real arithmetic, which inductor fuses (it cannot
    generate code for complex ops: they would run eagerly on float32 copies of q and k)."""
    table = _first_rows(freqs_cis, seqlen)
    if table.is_complex():
        table = torch.view_as_real(table)  # [seqlen, head_dim/2, (re, im)]
    return table[None, :, None, :, 0], table[None, :, None, :, 1]


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``xq``/``xk`` (``[B, S, H, head_dim]``) by the first ``S`` rows of ``freqs_cis``:
    each pair ``(x[2i], x[2i+1])`` as the complex number ``x[2i] + i x[2i+1]`` times
    ``freqs_cis[s, i]``, computed in float32 and cast back to the inputs' dtypes.

    Eagerly that is one complex product per tensor (one kernel); under ``torch.compile`` the
    same float32 products and sums written out in real arithmetic (:func:`rotate_pairs_real`),
    which inductor fuses with the code around it. Both give the same bits.
    """
    if torch.compiler.is_compiling():
        return rotate_pairs_real(xq, xk, freqs_cis)
    table = _first_rows(freqs_cis, xq.shape[1])
    freqs = (table if table.is_complex() else torch.view_as_complex(table)).unsqueeze(0).unsqueeze(2)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
        return torch.view_as_real(pairs * freqs).flatten(3).type_as(x)

    return rotate(xq), rotate(xk)


def rotate_pairs_real(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_rotary_emb` in real arithmetic: ``(re*cos - im*sin, re*sin + im*cos)``."""
    cos, sin = _cos_sin(freqs_cis, xq.shape[1])

    def rotate(x: torch.Tensor) -> torch.Tensor:
        pairs = x.float().unflatten(-1, (-1, 2))
        re, im = pairs[..., 0], pairs[..., 1]
        return torch.stack((re * cos - im * sin, re * sin + im * cos), dim=-1).flatten(3).type_as(x)

    return rotate(xq), rotate(xk)


def apply_rotary_emb_half(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE in HF's rotate-half layout on ``[B, S, H, head_dim]`` tensors: ``x * cos +
    rotate_half(x) * sin`` with the angles (and magnitude) of the first ``S`` rows of the
    complex table ``freqs_cis`` ``[>=S, head_dim/2]``. Computed in float32, cast back to the
    inputs' dtypes."""
    cos, sin = _cos_sin(freqs_cis, xq.shape[1])
    cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).type_as(x)

    return rotate(xq), rotate(xk)
