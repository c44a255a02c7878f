"""The server defaults SGLang derives from the GPU when a flag is not given.

From sglang/python/sglang/srt/server_args.py (`_handle_gpu_memory_settings`, v0.5): the GPU's
memory picks `--chunked-prefill-size` and `--cuda-graph-max-bs`, and those two, the parallelism
and speculation pick `--mem-fraction-static`, the share of the GPU's memory for weights and KV
pool; the rest is kept for activations and CUDA-graph buffers. Memory is in GiB here (SGLang
compares MiB against the same bounds).
"""

from __future__ import annotations


def chunked_prefill_size(hbm_gib: float) -> int:
    """`--chunked-prefill-size`: 2,048 under 35 GiB (A10, L4), 4,096 under 60 (A100-40G, L40S),
    8,192 under 160 (A100-80G, H100, H20, H200), else 16,384 (B200, GB200)."""
    if hbm_gib < 35:
        return 2048
    if hbm_gib < 60:
        return 4096
    return 8192 if hbm_gib < 160 else 16384


def piecewise_cuda_graph_max_tokens(mla: bool, chunked_prefill_size: int,
                                    rules: str = "v0.5.23") -> int:
    """The most tokens an extend replays as prefill CUDA graphs: the chunk size, or with an MLA
    backend (whose kernel choice changes under the graphs) 2,048 under v0.5.10's
    `--piecewise-cuda-graph-max-tokens` (`_handle_gpu_memory_settings`), at most 8,192 under
    v0.5.23's prefill `max_bs` (`arg_groups/memory_hook.py`)."""
    if not mla:
        return chunked_prefill_size
    return 2048 if rules == "v0.5.10" else min(8192, chunked_prefill_size)


def cuda_graph_max_bs(hbm_gib: float, tp: int) -> int:
    """`--cuda-graph-max-bs`, the largest decode batch per rank replayed as a CUDA graph."""
    if hbm_gib < 20:
        return 8
    if hbm_gib < 35:
        return 24 if tp < 4 else 80
    if hbm_gib < 60:
        return 32 if tp < 4 else 160
    if hbm_gib < 160:
        return 256 if tp < 4 else 512
    return 512


# `_handle_speculative_decoding` (server_args.py, v0.5.10; arg_groups/speculative_hook.py
# `_handle_eagle_family`, v0.5.23): an EAGLE/NEXTN/MTP server launched without
# --max-running-requests runs at most 48 requests, split over the DP ranks
# (`_resolve_max_num_reqs`: max_running_requests // dp_size, capped by the request-pool estimate).
SPECULATIVE_MAX_RUNNING_REQUESTS = 48


def pre_alloc_size(max_running_requests: int) -> int:
    """A PD decode rank's request slots beyond its running batch for requests whose KV is on
    its way (`init_memory_pool`'s `pre_alloc_size`): twice the running batch up to 32
    requests, else SGLANG_DISAGGREGATION_NUM_PRE_ALLOCATE_REQS, 0 by default, so preallocated,
    transferring and running requests share one pool of slots."""
    return 2 * max_running_requests if max_running_requests <= 32 else 0


def mem_fraction_static(hbm_gib: float, *, chunk: int, max_prefill_tokens: int, graph_bs: int,
                        tp: int, pp: int = 1, dp_attention: int = 1,
                        speculative: bool = False) -> float:
    """`--mem-fraction-static`: (memory - reserved) / memory, reserved (MiB) = 512 + 1.5 per
    token of the largest prefill chunk (at least 2,048) + 2 per graph batch slot + 1,024 per
    8 GPUs of tp * pp; with DP attention 3 per graph slot per DP rank (4.5 above 300 slots);
    at least 10 GiB on GPUs over 60 GiB; 2 GiB more for a speculative draft. H100 at tp 1:
    0.836; H200 at tp 8: 0.897, with DP attention 8: 0.770; at DP attention 32 the graphs'
    share leaves 0.365, which is why large-EP launches set the flag (or small graphs)."""
    reserved = 512 + max(chunk if chunk > 0 else max_prefill_tokens, 2048) * 1.5
    reserved += graph_bs * 2 + tp * pp / 8 * 1024
    if dp_attention > 1:
        reserved += graph_bs * dp_attention * (4.5 if graph_bs > 300 else 3)
    mib = hbm_gib * 1024
    if hbm_gib > 60:
        reserved = max(reserved, 10 * 1024)
    if speculative:
        reserved += 2 * 1024
    return round((mib - reserved) / mib, 3)
