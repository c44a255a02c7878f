"""Scheduler knobs left out of a config are derived per GPU as SGLang's server_args derives them."""

from __future__ import annotations

import pytest

from pdsim import sglang_defaults
from pdsim.config import ConfigError, parse_experiment
from pdsim.sim.build import build_cluster
from pdsim.sim.cost import Parallelism, pool_sizes
from pdsim.specs import load_hardware_spec, model_preset


def test_chunk_graphs_and_memory_fraction_follow_sglang_by_gpu_memory() -> None:
    chunk = sglang_defaults.chunked_prefill_size
    assert [chunk(gib) for gib in (24, 48, 80, 141, 180)] == [2048, 4096, 8192, 8192, 16384]
    graphs = sglang_defaults.cuda_graph_max_bs
    assert [graphs(gib, 1) for gib in (16, 24, 48, 80, 180)] == [8, 24, 32, 256, 512]
    assert [graphs(gib, 8) for gib in (24, 48, 80)] == [80, 160, 512]
    fraction = sglang_defaults.mem_fraction_static
    # H100 at tp 1: 512 + 8192 * 1.5 + 256 * 2 + 128 MiB kept out of 80 GiB
    assert fraction(80, chunk=8192, max_prefill_tokens=16384, graph_bs=256, tp=1) == 0.836
    h200 = dict(chunk=8192, max_prefill_tokens=16384, graph_bs=512, tp=8)
    assert fraction(141, **h200) == 0.897
    assert fraction(141, **h200, dp_attention=8) == 0.770  # 512 slots x 8 ranks x 4.5 MiB more
    assert fraction(141, **h200, speculative=True) == round(0.897 - 2 / 141, 3)
    # unchunked prefill keeps activations for max_prefill_tokens; small GPUs no 10 GiB floor
    assert fraction(141, chunk=0, max_prefill_tokens=65536, graph_bs=512, tp=8) < 0.35
    assert fraction(24, chunk=2048, max_prefill_tokens=16384, graph_bs=24, tp=1) > 0.84


def _experiment(hardware: str, tp: int = 1, dp: int = 1, model: str = "llama-3.1-8b",
                **scheduler) -> dict:
    role = {"instances": 1, "tp": tp, "dp_attention": dp, "scheduler": scheduler}
    if dp > 1:
        role["ep"] = tp
    return {"name": "defaults", "model": model, "hardware": hardware,
            "cluster": {"prefill": dict(role), "decode": dict(role)},
            "workload": {"num_requests": 4, "arrival": {"process": "poisson", "rate_rps": 1},
                         "input_len": {"dist": "fixed", "value": 64},
                         "output_len": {"dist": "fixed", "value": 4}}}


@pytest.mark.parametrize("hardware, chunk", [("l40s", 4096), ("h100", 8192), ("b200", 16384)])
def test_an_unset_chunk_and_pool_are_sglangs_for_the_gpu(hardware: str, chunk: int) -> None:
    cluster = build_cluster(parse_experiment(_experiment(hardware)))
    sched = cluster.prefill.scheduler
    assert sched.chunked_prefill_size == chunk
    hw = load_hardware_spec(hardware)
    fraction = sglang_defaults.mem_fraction_static(
        hw.hbm_gib, chunk=chunk, max_prefill_tokens=16384,
        graph_bs=sglang_defaults.cuda_graph_max_bs(hw.hbm_gib, 1), tp=1)
    tokens = pool_sizes(model_preset("llama-3.1-8b"), hw, Parallelism(), fraction).kv_tokens
    assert sched.num_pages == tokens // sched.page_size
    # given, they are kept
    given = parse_experiment(_experiment(hardware, chunked_prefill_size=1024,
                                         mem_fraction_static=0.5))
    kept = build_cluster(given).prefill.scheduler
    assert kept.chunked_prefill_size == 1024 and kept.num_pages < sched.num_pages


def test_a_derived_fraction_too_small_says_which_flag_to_set() -> None:
    # DeepSeek-V3 on 8 H200s with DP attention and 64k-token chunks: SGLang keeps 1.5 MiB per
    # chunk token and 512 graph slots for each DP rank, leaving 0.174 of the memory, less than
    # each GPU's weights; over 32 such ranks it would keep more than the memory
    data = _experiment("h200", tp=8, dp=8, model="deepseek-v3", chunked_prefill_size=65536)
    with pytest.raises(ConfigError, match=r"cluster.prefill: .*0.174 is the mem_fraction_static "
                                          r"SGLang derives here.*set cluster.prefill.scheduler"
                                          r".mem_fraction_static"):
        build_cluster(parse_experiment(data))
    data["cluster"]["prefill"]["scheduler"]["mem_fraction_static"] = 0.85
    data["cluster"]["decode"]["scheduler"]["mem_fraction_static"] = 0.85
    assert build_cluster(parse_experiment(data)).decode.scheduler.num_pages > 0
    wide = _experiment("h200", tp=32, dp=32, model="deepseek-v3", chunked_prefill_size=65536)
    with pytest.raises(ConfigError, match=r"derived --mem-fraction-static is -0.2\d* on h200 "
                                          r".*512 requests on each of 32 DP ranks.*would not "
                                          r"start; set cluster.prefill.scheduler"):
        build_cluster(parse_experiment(wide))


def test_a_format_the_gpu_cannot_run_is_not_blamed_on_the_memory_fraction() -> None:
    data = _experiment("h100")
    data["model"] = {"base": "llama-3.1-8b", "precision": {"dense_mlp": "nvfp4"}}
    data["cost_model"] = {"name": "roofline"}
    with pytest.raises(ConfigError, match="nvfp4 weights need FP4 tensor cores") as err:
        build_cluster(parse_experiment(data))
    assert "mem_fraction_static" not in str(err.value)


def test_max_total_tokens_caps_the_pool_as_sglang_does() -> None:
    """--max-total-tokens keeps the smaller of itself and what memory leaves, in whole pages,
    per DP rank; the real backend, which cannot measure memory, takes it as the pool."""
    free = build_cluster(parse_experiment(_experiment("h100", page_size=64))).prefill.scheduler
    capped = build_cluster(parse_experiment(_experiment(
        "h100", page_size=64, max_total_tokens=100_000))).prefill.scheduler
    assert capped.num_pages == 100_000 // 64 < free.num_pages
    above = build_cluster(parse_experiment(_experiment(
        "h100", page_size=64, max_total_tokens=10**9))).prefill.scheduler
    assert above.num_pages == free.num_pages
    # DeepSeek-V3's published large-EP prefill: 131,072 tokens on each of 8 DP ranks
    ranks = build_cluster(parse_experiment(_experiment(
        "h200", tp=8, dp=8, model="deepseek-v3", page_size=1, mem_fraction_static=0.85,
        max_total_tokens=131072))).prefill.scheduler
    assert ranks.num_pages == 131072
    for bad, match in (({"num_pages": 10, "max_total_tokens": 640}, "both size the KV pool; "
                        "give one"),
                       ({"page_size": 64, "max_total_tokens": 32}, "less than one page")):
        with pytest.raises(ConfigError, match=match):
            parse_experiment(_experiment("h100", **bad))


def test_the_real_backend_takes_max_total_tokens_as_its_pool() -> None:
    from runtime.serve_config import PDServeConfig

    data = _experiment("h100", page_size=16, max_total_tokens=4096)
    data["model"] = "tiny-llama"
    cfg = PDServeConfig.model_validate(data)
    assert cfg.scheduler_config("prefill").num_pages == 256
    data["cluster"]["decode"]["scheduler"] = {"page_size": 16}
    with pytest.raises(ValueError, match="cluster.decode.scheduler.num_pages: not given.*or "
                                         "max_total_tokens"):
        PDServeConfig.model_validate(data)
