"""Building blocks shared by the GQA and MLA models: RMSNorm, rotary embedding, MLPs."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from runtime.model.config import ModelConfig, RopeScaling


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class RotaryEmbedding:
    """Rotary position embedding over the last `dim` channels, "rotate half" convention (HF Llama).

    `interleaved=True` takes rotation pairs from adjacent channels (DeepSeek checkpoints) and
    returns them de-interleaved, as the HF DeepSeek code does; queries and keys get the same
    permutation, so their dot products are unchanged. Holds no parameters; the cos/sin table is
    built per device on first use.
    """

    def __init__(self, dim: int, max_position: int, theta: float,
                 scaling: RopeScaling | None = None, interleaved: bool = False) -> None:
        if scaling is not None and scaling.kind != "llama3":
            raise NotImplementedError(f"rope scaling {scaling.kind!r} is not implemented")
        self.dim = dim
        self.max_position = max_position
        self.interleaved = interleaved
        steps = torch.arange(0, dim, 2, dtype=torch.float64, device="cpu")  # not the meta device
        inv_freq = 1.0 / theta ** (steps / dim)
        if scaling is not None:
            inv_freq = _llama3_scaled(inv_freq, scaling)
        self.inv_freq = inv_freq
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _table(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._tables:
            pos = torch.arange(self.max_position, dtype=torch.float64, device="cpu")
            angles = torch.outer(pos, self.inv_freq)
            cos, sin = angles.cos().float(), angles.sin().float()
            self._tables[device] = (cos.to(device), sin.to(device))
        return self._tables[device]

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate `x` `[T, heads, dim]` by the angles of `positions` `[T]`."""
        cos, sin = self._table(x.device)
        cos, sin = cos[positions][:, None, :], sin[positions][:, None, :]
        xf = x.float()
        if self.interleaved:
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
        else:
            x1, x2 = xf.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def _llama3_scaled(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1 frequency scaling: slow down long wavelengths, keep short ones, blend between."""
    wavelen = 2 * math.pi / inv_freq
    long_wavelen = s.original_max_position / s.low_freq_factor
    short_wavelen = s.original_max_position / s.high_freq_factor
    blend = (s.original_max_position / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    blended = (1 - blend) * inv_freq / s.factor + blend * inv_freq
    out = torch.where(wavelen > long_wavelen, inv_freq / s.factor, blended)
    return torch.where(wavelen < short_wavelen, inv_freq, out)


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), HF Llama parameter names."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Top-k routed experts plus optional always-on shared experts (DeepSeek-V2 names).

    Softmax routing only; DeepSeek-V3's sigmoid scores with grouped top-k are not implemented.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.moe_scoring != "softmax":
            raise NotImplementedError(f"MoE scoring {config.moe_scoring!r} is not implemented")
        self.top_k = config.experts_per_token
        self.normalize = config.norm_topk_prob
        self.scaling = config.routed_scaling_factor
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            GatedMLP(config.hidden_size, config.moe_intermediate_size)
            for _ in range(config.num_experts))
        self.shared_experts = (
            GatedMLP(config.hidden_size, config.moe_intermediate_size * config.num_shared_experts)
            if config.num_shared_experts else None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts `[T, k]` and their float32 weights `[T, k]`."""
        probs = self.gate(x).float().softmax(-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return experts, weights * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        out = torch.zeros_like(x, dtype=torch.float32)
        for e, expert in enumerate(self.experts):
            rows, rank = (experts == e).nonzero(as_tuple=True)
            if rows.numel():
                out.index_add_(0, rows, expert(x[rows]).float() * weights[rows, rank, None])
        if self.shared_experts is not None:
            out += self.shared_experts(x).float()
        return out.to(x.dtype)
