"""Expert parallelism: each MoE layer's routed experts split whole over the ranks of a
tensor-parallel group, tokens moved to them and back by all-to-all (DeepEP's dispatch and
combine, in the low-latency kernels' per-expert layout).

`apply_tp(model, group, ep=N)` (runtime.model.tp) swaps every `MoE` block for an
`ExpertParallelMoE`. With tp ranks and ep dividing tp, `moe_tp = tp // ep` ranks form one EP
group (SGLang's order: rank r is in EP group `r // moe_tp`); EP group g holds routed experts
`[g*E/ep, (g+1)*E/ep)`, each sliced over its `moe_tp` ranks along the intermediate dim as TP
slices a dense MLP (whole experts when ep == tp). The router is replicated. The shared experts
follow the TP rules: sliced over all tp ranks, run on every token.

One layer's forward on rank r, the tokens the same on every rank (TP attention):

1. r takes its share of the tokens (`torch.tensor_split` into tp parts) and routes them.
2. Dispatch: every (token, chosen expert) copy goes to each rank holding a slice of that
   expert, and only there: at most top-k copies of a token leave (times moe_tp). A first
   all-to-all of counts tells every rank how many rows of each of its experts come from each
   rank; the second moves the hidden states, grouped by destination rank, then expert.
3. Each rank runs its experts (slices) on the rows it received.
4. Combine: the outputs go back by the reverse all-to-all; r weights each copy by its router
   weight and sums them into its tokens' rows of a `[T, hidden]` block, zero elsewhere, and adds
   its shared-expert partial.
5. The TP all-reduce after the block (the one every MLP has) then sums the ranks' blocks: the
   routed rows (each token's from the rank that dispatched it, the rest zeros) and the shared
   partial sums, in one collective.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.distributed import TPGroup
from runtime.model.config import ModelConfig
from runtime.model.layers import MoE


def check_ep(config: ModelConfig, tp_size: int, ep_size: int) -> None:
    """Raise ValueError, naming the field, unless `config`'s routed experts split `ep_size`
    ways inside a tensor-parallel group of `tp_size`."""
    if ep_size < 1 or tp_size % ep_size:
        raise ValueError(f"ep={ep_size} must be >= 1 and divide tp={tp_size}")
    if ep_size == 1:
        return
    if not config.num_experts:
        raise ValueError(f"ep={ep_size} splits routed experts; model {config.name!r} has none")
    if config.num_experts % ep_size:
        raise ValueError(f"model {config.name!r} cannot run with ep={ep_size}: "
                         f"num_experts={config.num_experts} must divide by ep")


def expert_range(config: ModelConfig, tp_size: int, ep_size: int, rank: int) -> range:
    """The routed experts rank `rank` holds (whole, or a slice of each when ep < tp)."""
    check_ep(config, tp_size, ep_size)
    per_group = config.num_experts // ep_size
    group = rank // (tp_size // ep_size)
    return range(group * per_group, (group + 1) * per_group)


class ExpertParallelMoE(nn.Module):
    """One MoE block under expert parallelism (module docstring). Built from the full `MoE`
    block, keeping only this rank's experts; `apply_tp` slices them and the shared experts."""

    route = MoE.route  # the same routing: it reads gate, top_k, normalize and scaling

    def __init__(self, moe: MoE, config: ModelConfig, group: TPGroup, ep_size: int) -> None:
        super().__init__()
        held = expert_range(config, group.size, ep_size, group.rank)
        self.gate = moe.gate
        self.top_k, self.normalize, self.scaling = moe.top_k, moe.normalize, moe.scaling
        self.experts = nn.ModuleList(moe.experts[e] for e in held)
        self.shared_experts = moe.shared_experts
        self.group = group
        self.moe_tp = group.size // ep_size
        self.experts_per_group = len(held)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group, per, moe_tp = self.group, self.experts_per_group, self.moe_tp
        mine = torch.tensor_split(torch.arange(x.shape[0], device=x.device), group.size)[
            group.rank]
        experts, weights = self.route(x[mine])
        # Each copy once per rank holding a slice of its expert, keyed by (that rank, the local
        # expert): the rank is (the expert's EP group) * moe_tp + slice, the local expert e % per.
        expert = experts.flatten().repeat_interleave(moe_tp)
        dest = (expert // per) * moe_tp + torch.arange(moe_tp, device=x.device).repeat(
            experts.numel())
        key = dest * per + expert % per
        copy = torch.argsort(key, stable=True) // moe_tp  # the (token, slot) of each sent row
        token = copy // self.top_k
        send = torch.bincount(key, minlength=group.size * per).view(group.size, per)
        recv = group.all_to_all(send, [1] * group.size, [1] * group.size)
        send_rows, recv_rows = send.sum(1).tolist(), recv.sum(1).tolist()
        received = group.all_to_all(x[mine][token], send_rows, recv_rows)
        local = torch.arange(per, device=x.device).repeat(group.size).repeat_interleave(
            recv.flatten())
        out_rows = torch.empty_like(received)
        for e, mlp in enumerate(self.experts):
            rows = (local == e).nonzero(as_tuple=True)[0]
            if rows.numel():
                out_rows[rows] = mlp(received[rows])
        back = group.all_to_all(out_rows, recv_rows, send_rows)
        out = torch.zeros_like(x, dtype=torch.float32)
        out.index_add_(0, mine[token], back.float() * weights.flatten()[copy, None])
        if self.shared_experts is not None:
            out += self.shared_experts(x).float()
        return out.to(x.dtype)
