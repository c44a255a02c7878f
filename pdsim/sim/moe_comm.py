"""What DeepEP moves for one MoE layer, and over which link: pure functions of the shapes.

Under DeepEP (SGLang's `--moe-a2a-backend deepep`, expert parallelism over all `ep` GPUs of an
instance) each GPU sends its own tokens to the GPUs holding their experts (dispatch) and gets
the expert outputs back (combine). Only routed copies move, never the whole batch:

- dispatch: FP8 hidden states plus one float32 scale per 128-element group
  (`hidden + hidden / 128 * 4` bytes a copy);
- combine: BF16 expert outputs (`hidden * 2` bytes a copy).

Which copies move, with uniform routing (each of a token's `top_k` experts on any of the `ep`
GPUs with probability 1/ep) and `g = min(gpus_per_node, ep)` GPUs in the sender's NVLink domain:

- low-latency mode (decode) sends one copy per routed expert: of the `top_k` copies,
  `top_k / ep` stay on the sender, `top_k (g - 1) / ep` cross NVLink and `top_k (ep - g) / ep`
  cross RDMA;
- normal mode (prefill) sends a token once per destination GPU inside the node and once per
  destination node over RDMA (the receiving node forwards it over NVLink, at ~9x the NIC's
  rate, so that leg hides behind the RDMA one and is not counted). A given GPU is hit with
  probability `p = 1 - (1 - 1/ep)^top_k`, a given node with `q = 1 - (1 - g/ep)^top_k`:
  `(g - 1) p` NVLink copies and `(ep / g - 1) q` RDMA copies a token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

A2AMode = Literal["low_latency", "normal"]
FP8_SCALE_GROUP = 128  # elements per float32 scale of the FP8 dispatch
FP8_SCALE_BYTES = 4


def dispatch_bytes_per_copy(hidden_size: int) -> float:
    """One token's FP8 hidden state and its per-128-element float32 scales."""
    return hidden_size + hidden_size / FP8_SCALE_GROUP * FP8_SCALE_BYTES


def combine_bytes_per_copy(hidden_size: int) -> float:
    """One expert output in BF16."""
    return hidden_size * 2.0


@dataclass(frozen=True)
class LinkCopies:
    """Copies of one token that leave its GPU, by link."""

    nvlink: float
    rdma: float


@dataclass(frozen=True)
class LinkBytes:
    """Bytes one GPU sends in one dispatch or one combine, by link."""

    nvlink_bytes: float
    rdma_bytes: float


@dataclass(frozen=True)
class DeepEPTraffic:
    dispatch: LinkBytes
    combine: LinkBytes


def copies_per_token(top_k: int, ep: int, gpus_per_node: int, mode: A2AMode) -> LinkCopies:
    """Expected copies of one token sent off its GPU over NVLink and over RDMA (module doc)."""
    if top_k < 1 or ep < 1 or gpus_per_node < 1:
        raise ValueError(
            f"top_k, ep and gpus_per_node must be >= 1, got {top_k}, {ep}, {gpus_per_node}"
        )
    g = min(gpus_per_node, ep)
    if mode == "low_latency":
        return LinkCopies(nvlink=top_k * (g - 1) / ep, rdma=top_k * (ep - g) / ep)
    if mode == "normal":
        gpu_hit = 1.0 - (1.0 - 1.0 / ep) ** top_k
        node_hit = 1.0 - (1.0 - g / ep) ** top_k
        return LinkCopies(nvlink=(g - 1) * gpu_hit, rdma=(ep / g - 1) * node_hit)
    raise ValueError(f"unknown DeepEP mode {mode!r}; allowed: low_latency, normal")


def deepep_traffic(tokens: float, hidden_size: int, top_k: int, ep: int, gpus_per_node: int,
                   mode: A2AMode) -> DeepEPTraffic:
    """Bytes one GPU sends to dispatch `tokens` of its own and to combine their outputs."""
    c = copies_per_token(top_k, ep, gpus_per_node, mode)
    d, m = dispatch_bytes_per_copy(hidden_size), combine_bytes_per_copy(hidden_size)
    return DeepEPTraffic(
        dispatch=LinkBytes(tokens * c.nvlink * d, tokens * c.rdma * d),
        combine=LinkBytes(tokens * c.nvlink * m, tokens * c.rdma * m),
    )
