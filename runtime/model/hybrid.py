"""Linear-attention layers and the per-request recurrent state they keep (hybrid models).

A `GatedLinearRecurrence` layer (a small Mamba/DeltaNet-style mixer) keeps no KV: per head it
carries a `[key_dim, value_dim]` matrix `S` and the last `conv_kernel - 1` inputs of a causal
depthwise convolution. For each new token, per head:

    u = qkv_proj(x)                          (q, k and v inputs of the head)
    q, k, v = silu(conv(last inputs, u))     (q and k then L2-normalised)
    S = sigmoid(gate_proj(x)) * S + k^T v
    out = q S

The state of every request lives in one `RecurrentState` buffer at the request's state slot
(the core's state-slot pool, `Request.state_indices`). A segment with no cached tokens starts
from zero (a new request, or the recompute of a retracted one), so a slot needs no clearing.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from pdsim.core.config import SchedulerConfig
from runtime.model.attention import AttentionMetadata
from runtime.model.config import ModelConfig

log = logging.getLogger(__name__)


class RecurrentState:
    """`[num_slots, linear layers, heads, state_floats_per_head]` float32, one request per slot.

    A slot's bytes are contiguous, and inside it head `h` of linear layer `i` is the contiguous
    range at `(i * heads + h) * floats * 4`: what a transfer engine needs to move a slot, or a
    TP rank's slice of its heads (runtime/transfer/layout.py `state_descriptors`).
    """

    def __init__(self, config: ModelConfig, *, num_slots: int, tp_size: int = 1,
                 device: str | torch.device = "cpu") -> None:
        if not config.linear_layers:
            raise ValueError(f"model {config.name!r} has no linear_attention layer to keep "
                             "a recurrent state for")
        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots}; must be >= 1")
        if config.linear_num_heads % tp_size:
            raise ValueError(f"linear_num_heads={config.linear_num_heads} does not split over "
                             f"tp_size={tp_size}")
        self.num_slots = num_slots
        self.num_layers = len(config.linear_layers)
        self.heads = config.linear_num_heads // tp_size
        self.floats_per_head = config.state_floats_per_head
        self.tensor = torch.zeros(num_slots, self.num_layers, self.heads, self.floats_per_head,
                                  dtype=torch.float32, device=device)

    def layer_view(self, slot: int, layer: int) -> torch.Tensor:
        """`[heads, state_floats_per_head]` of one slot and linear layer (a view)."""
        return self.tensor[slot, layer]

    # ---- addressing for transfer engines -------------------------------------------------

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()

    def data_len(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def slot_bytes(self) -> int:
        return self.tensor[0].numel() * self.tensor.element_size()


class GatedLinearRecurrence(nn.Module):
    """A linear-attention layer; its parameters are laid out head-major (rows of head `h`
    together) so that a TP split by rows gives each rank whole heads."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.index = config.linear_layers.index(layer)  # its place in `RecurrentState`
        self.heads = config.linear_num_heads
        self.key_dim = config.linear_key_head_dim
        self.value_dim = config.linear_value_head_dim
        self.kernel = config.linear_conv_kernel_dim
        self.channels = 2 * self.key_dim + self.value_dim  # q, k, v inputs of one head
        hidden = config.hidden_size
        self.qkv_proj = nn.Linear(hidden, self.heads * self.channels, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.heads * self.channels, self.kernel))
        self.gate_proj = nn.Linear(hidden, self.heads, bias=False)
        self.o_proj = nn.Linear(self.heads * self.value_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv) -> torch.Tensor:
        """`kv` is the paged cache holding the `RecurrentState` (`kv.state`), or None: each
        segment then starts from zero state and none is kept."""
        tokens = x.shape[0]
        heads, dk, dv, c = self.heads, self.key_dim, self.value_dim, self.channels
        inputs = self.qkv_proj(x).float().view(tokens, heads, c)
        decay = torch.sigmoid(self.gate_proj(x).float())  # [T, heads]
        weight = self.conv_weight.float().view(heads, c, self.kernel)
        state = None if kv is None else kv.state
        if state is not None and len(meta.state_slots) != meta.num_segments:
            raise ValueError(f"a linear_attention layer needs a state slot per segment: "
                             f"{len(meta.state_slots)} for {meta.num_segments} segments")
        out = x.new_empty(tokens, heads, dv, dtype=torch.float32)
        starts = meta.token_starts
        for s, (start, end) in enumerate(zip(starts, starts[1:])):
            n = end - start
            view = None if state is None else state.layer_view(meta.state_slots[s], self.index)
            if view is None or meta.cached_lens[s] == 0:
                matrix = inputs.new_zeros(heads, dk, dv)
                history = inputs.new_zeros(self.kernel - 1, heads, c)
            else:
                matrix = view[:, : dk * dv].reshape(heads, dk, dv).clone()
                history = view[:, dk * dv:].reshape(heads, self.kernel - 1, c).transpose(0, 1)
            seq = torch.cat([history, inputs[start:end]])  # [kernel - 1 + n, heads, c]
            windows = seq.unfold(0, self.kernel, 1)  # [n, heads, c, kernel]
            mixed = F.silu((windows * weight).sum(-1))
            q, k, v = mixed.split([dk, dk, dv], dim=-1)
            q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
            for t in range(n):
                matrix = (decay[start + t, :, None, None] * matrix
                          + k[t, :, :, None] * v[t, :, None, :])
                out[start + t] = torch.einsum("hk,hkv->hv", q[t], matrix)
            if view is not None:
                view[:, : dk * dv] = matrix.reshape(heads, dk * dv)
                view[:, dk * dv:] = seq[n:].transpose(0, 1).reshape(heads, -1)
        return self.o_proj(out.to(x.dtype).reshape(tokens, heads * dv))


def recurrent_state_for(config: ModelConfig, num_slots: int, *, tp_size: int = 1,
                        device: str | torch.device = "cpu") -> RecurrentState | None:
    """The state buffer of `num_slots` slots a model with linear-attention layers needs (set it
    as the paged cache's `state`), None for other models; the slot count must match."""
    if config.linear_layers:
        if num_slots < 1:
            raise ValueError(f"model {config.name!r} keeps a recurrent state per request: "
                             f"state_slots={num_slots}; must be >= 1")
        return RecurrentState(config, num_slots=num_slots, tp_size=tp_size, device=device)
    if num_slots:
        raise ValueError(f"state_slots={num_slots}, but model {config.name!r} keeps no "
                         "recurrent state; allowed: 0")
    return None


def with_state_slots(sched: SchedulerConfig, config: ModelConfig) -> SchedulerConfig:
    """`sched` with the state slots `config` needs: one per request slot (running and, on
    decode, preallocated) for a model with linear-attention layers, else none.

    Such a model cannot take a cached prefix (the state at the prefix's end is not kept), so its
    prefix cache is off (SGLang's radix cache is on by default; this says so in the log)."""
    if not config.linear_layers:
        return sched
    if sched.prefix_cache:
        log.info("model %s keeps a recurrent state per request, which a cached prefix does not "
                 "have: prefix cache off", config.name)
    return replace(sched, prefix_cache=False,
                   state_slots=sched.max_running_requests + sched.pre_alloc_size)
