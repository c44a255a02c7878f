"""Prefill and decode on different hardware: each role prices its steps, sizes its KV pool
and sends over its own GPUs; the KV moves at the slower NIC; the price is per role."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import simpy
import yaml
from typer.testing import CliRunner

from pdsim.cli import app
from pdsim.config import ConfigError, parse_experiment
from pdsim.runner import run_point
from pdsim.sim.build import build_cluster, usd_per_gpu_hour
from pdsim.sim.network import Link, NetworkModel, SimFabric
from pdsim.sim.silicon import tables
from pdsim.specs.hardware import load_hardware_spec

ROOT = Path(__file__).resolve().parents[1]


def experiment(prefill: dict | None = None, decode: dict | None = None, **fields) -> dict:
    """A 1P1D Llama-3.1-8B deployment on H100 with a decode-heavy load: short prompts, long
    answers."""
    data = {
        "name": "hetero", "model": "llama-3.1-8b", "hardware": "h100",
        "cost_model": {"name": "roofline"},
        "cluster": {"mode": "disaggregated", "prefill": {"instances": 1, "tp": 1, **(prefill or {})},
                    "decode": {"instances": 1, "tp": 1, **(decode or {})}},
        "workload": {"num_requests": 60, "seed": 0, "arrival": {"process": "poisson", "rate_rps": 4},
                     "input_len": {"dist": "fixed", "value": 256},
                     "output_len": {"dist": "fixed", "value": 256}},
        "slo": {"ttft_s": 1.0, "itl_s": 0.05},
    }
    data.update(fields)
    return data


def run(data: dict) -> dict:
    return run_point(0, parse_experiment(data, "test"), {}, None).summary


def test_each_role_builds_its_cost_model_and_pool_on_its_own_hardware():
    cluster = build_cluster(parse_experiment(experiment(decode={"hardware": "h200"}), "test"))
    assert cluster.prefill.cost().hardware.name == "h100"
    assert cluster.decode.cost().hardware.name == "h200"
    # The same knobs, a bigger pool: 88 % of H200's 141 GB against of H100's 80 GB, less the
    # same 16 GB of weights: about twice the pages.
    assert cluster.decode.scheduler.num_pages > 1.9 * cluster.prefill.scheduler.num_pages


@pytest.mark.skipif(tables.systems_dir() is None, reason="aiconfigurator-core's kernel tables "
                    "are not installed")
@pytest.mark.parametrize("prefill", ["h100", "h200", "b200", "gb200"])
def test_auto_prices_each_role_with_its_gpus_tables_or_the_roofline(prefill):
    unmeasured = {"base": "h100", "name": "unmeasured"}  # no tables, no silicon_base
    cfg = parse_experiment(experiment(prefill={"hardware": prefill},
                                      decode={"hardware": unmeasured},
                                      cost_model={"name": "auto"}), "test")
    cluster = build_cluster(cfg)
    assert type(cluster.prefill.cost()).__name__ == "SiliconCostModel"
    assert type(cluster.decode.cost()).__name__ == "RooflineCostModel"


def test_a_decode_heavy_load_decodes_faster_on_the_faster_decode_gpu():
    slow = run(experiment(decode={"hardware": "l40s"}))  # 864 GB/s of memory bandwidth
    fast = run(experiment(decode={"hardware": "h200"}))  # 4,800 GB/s
    assert slow["completed"] == fast["completed"] == 60
    assert fast["itl_p50_s"] < slow["itl_p50_s"] / 3
    # The prefill side is the same H100 in both, but a PD request waits for the decode side's
    # step boundaries before its first token (its receiver is made, its pages taken, its KV
    # noticed between decode steps): the slower decode GPU adds a step or two, no more.
    assert fast["ttft_p50_s"] < slow["ttft_p50_s"] < fast["ttft_p50_s"] + 2 * slow["itl_p50_s"]


def test_a_mixed_deployment_is_priced_per_role():
    cfg = parse_experiment(experiment(prefill={"instances": 2, "hardware": "b200"},
                                      decode={"hardware": "h200"}), "test")
    b200, h200 = (load_hardware_spec(n).usd_per_gpu_hour for n in ("b200", "h200"))
    assert usd_per_gpu_hour(cfg) == pytest.approx((2 * b200 + h200) / 3)
    summary = run(experiment(prefill={"instances": 2, "hardware": "b200"},
                             decode={"hardware": "h200"}))
    assert summary["usd_per_hour"] == pytest.approx(2 * b200 + h200)
    # A GPU without a list price leaves the whole deployment unpriced.
    unpriced = parse_experiment(experiment(decode={"hardware": "h20"}), "test")
    assert usd_per_gpu_hour(unpriced) is None


def test_role_hardware_takes_a_file_or_a_mapping(tmp_path):
    (tmp_path / "slow_nic.yaml").write_text("base: h100\nname: h100-slow-nic\nrdma_gb_per_s: 5\n")
    cfg = parse_experiment(experiment(prefill={"hardware": "slow_nic.yaml"},
                                      decode={"hardware": {"base": "h200", "name": "h200-x"}}),
                           "test")
    cluster = build_cluster(cfg, str(tmp_path))
    assert cluster.prefill.cost().hardware.name == "h100-slow-nic"
    assert cluster.decode.cost().hardware.name == "h200-x"
    assert cluster.prefill.nic_bytes_per_s == pytest.approx(5e9 * 0.87)
    assert cluster.decode.nic_bytes_per_s == pytest.approx(50e9 * 0.87)


def test_an_unknown_role_hardware_names_the_field():
    with pytest.raises(ConfigError, match=r"cluster\.decode\.hardware: .*h999"):
        build_cluster(parse_experiment(experiment(decode={"hardware": "h999"}), "test"))


def landed_s(src: Link, dst: Link, nbytes: float, descriptors: float,
             per_descriptor_s: float, sender_posts: bool = True) -> float:
    env = simpy.Environment()
    fabric = SimFabric(env, NetworkModel(transfer_floor_s=0.0, per_descriptor_s=per_descriptor_s,
                                         sender_posts=sender_posts))
    landed = []
    fabric.transfer(src, dst, nbytes, descriptors, lambda: landed.append(env.now))
    env.run()
    return landed[0]


def test_the_kv_moves_at_the_slower_nic_of_the_pair():
    fast, slow = Link(50e9), Link(5e9)
    assert landed_s(fast, slow, 1e9, 0, 0.0) == pytest.approx(0.2)
    assert landed_s(slow, fast, 1e9, 0, 0.0) == pytest.approx(0.2)


def test_each_side_pays_the_descriptors_it_handles_over_its_own_gpus():
    # 4 sending GPUs at 40 GB/s, 1 receiving GPU at 20 GB/s; 10^5 descriptors of 1 us.
    src, dst = Link(40e9, gpus=4), Link(20e9, gpus=1)
    sender_s = 1e9 / 40e9 + 1e5 * 1e-6 / 4
    receiver_s = 1e9 / 20e9 + 1e5 * 1e-6 / 1
    # TCP: both sides handle every descriptor
    assert landed_s(src, dst, 1e9, 1e5, 1e-6, sender_posts=False) == pytest.approx(
        max(sender_s, receiver_s))
    # RDMA: the sender's ranks post one-sided writes; the receiver only takes the bytes
    assert landed_s(src, dst, 1e9, 1e5, 1e-6) == pytest.approx(max(sender_s, 1e9 / 20e9))
    # Equal per-GPU bandwidth on both sides: the sender's bytes and descriptors, as before.
    src, dst = Link(20e9, gpus=2), Link(20e9, gpus=2)
    for posts in (True, False):
        assert landed_s(src, dst, 1e9, 1e5, 1e-6, posts) == pytest.approx(
            1e9 / 20e9 + 1e5 * 1e-6 / 2)


def test_a_tp_mismatch_over_rdma_costs_the_sending_ranks_descriptors():
    """Llama-3.1-8B, 4,000 tokens, TP 8 -> 2 and 2 -> 8 over RDMA: the same head slices, posted
    by 8 prefill ranks in the first case and by 2 in the second."""
    from pdsim.sim.network import descriptor_counts
    from pdsim.specs import model_preset

    model = model_preset("llama-3.1-8b")
    per_page = {}
    for p, d in ((8, 2), (2, 8)):
        net = build_cluster(parse_experiment(experiment({"tp": p}, {"tp": d}))).network
        assert net.sender_posts
        per_page[p, d] = net.descriptors_per_page
    assert per_page[8, 2] == per_page[2, 8] == descriptor_counts(
        model.num_layers, 2, 16, model.num_kv_heads, 8, 2, False)[1]
    src8, dst2 = Link(50e9 * 8, gpus=8), Link(50e9 * 2, gpus=2)
    slices = per_page[8, 2] * 4000 / 16
    eight_to_two = landed_s(src8, dst2, 1e9, slices, 0.1e-6)
    two_to_eight = landed_s(dst2, src8, 1e9, slices, 0.1e-6)
    assert eight_to_two == pytest.approx(max(1e9 / 400e9 + slices * 0.1e-6 / 8, 1e9 / 100e9))
    assert two_to_eight > 3 * eight_to_two


def test_a_slow_decode_nic_slows_every_kv_transfer_end_to_end():
    slow_nic = {"base": "h100", "name": "h100-slow-nic", "rdma_gb_per_s": 0.5}
    prompts = {"input_len": {"dist": "fixed", "value": 4096},
               "output_len": {"dist": "fixed", "value": 4}}

    def transfer_p50_s(decode: dict) -> float:
        data = experiment(decode=decode)
        data["workload"] |= prompts
        frame = run_point(0, parse_experiment(data, "test"), {}, None).requests
        return float((frame["transfer_done_s"] - frame["prefill_end_s"]).median())

    # 4096 tokens x 128 KiB (Llama-3.1-8B's bf16 KV per token) = 0.54 GB at 0.435 GB/s: ~1.2 s
    kv_bytes = 4096 * 131072
    slow = transfer_p50_s({"hardware": slow_nic})
    assert slow >= kv_bytes / (0.5e9 * 0.87)
    assert transfer_p50_s({}) < slow / 10


def test_kv_format_must_match_across_hardware():
    with pytest.raises(ConfigError, match=r"prefill\.kv_dtype fp8 .*decode\.kv_dtype default"):
        parse_experiment(experiment(prefill={"hardware": "b200", "kv_dtype": "fp8"},
                                    decode={"hardware": "h200"}), "test")
    knobs = {"scheduler": {"page_size": 32}}
    with pytest.raises(ConfigError, match=r"prefill page_size 32 != decode page_size 16"):
        parse_experiment(experiment(prefill={"hardware": "gb200", **knobs},
                                    decode={"hardware": "h200"}), "test")


def test_gpus_of_two_kinds_cannot_share_an_nvlink_domain():
    cfg = parse_experiment(experiment(decode={"hardware": "h200"}, network={"intra_node": True}),
                           "test")
    with pytest.raises(ConfigError, match=r"intra_node: prefill on h100 and decode on h200"):
        build_cluster(cfg)


def test_a_tp_mismatch_across_hardware_moves_head_slices():
    cluster = build_cluster(parse_experiment(
        experiment(prefill={"tp": 2}, decode={"hardware": "a10"}), "test"))
    assert cluster.network.descriptors_per_page > 0  # GQA heads split 2 ways into 1: slices
    assert math.isclose(cluster.prefill.nic_bytes_per_s, 2 * 50e9 * 0.87)  # 2 H100 NICs
    assert math.isclose(cluster.decode.nic_bytes_per_s, 3.125e9 * 0.87)  # one A10's 25 Gb/s


def test_the_heterogeneous_experiment_checks():
    result = CliRunner().invoke(app, ["check", str(ROOT / "experiments" / "heterogeneous.yaml")])
    assert result.exit_code == 0, result.output
    assert "valid experiment" in result.output


def mixed_plan(**fields) -> dict:
    """Llama-3.1-8B with 4k-token prompts under a tight TTFT: prefill wants H100's compute,
    decode only memory bandwidth, which an H20 at $1.20 an hour sells cheaper."""
    data = {
        "name": "mixed_plan", "model": "llama-3.1-8b", "hardware": "h100",
        "gpu_types": [{"hardware": "h20", "usd_per_gpu_hour": 1.20}],
        "max_gpus": 2, "search": {"modes": ["disaggregated"], "tp": [1]},
        "cost_model": {"name": "roofline"},
        "workload": {"num_requests": 40, "seed": 0,
                     "arrival": {"process": "poisson", "rate_rps": 2},
                     "input_len": {"dist": "fixed", "value": 4096},
                     "output_len": {"dist": "fixed", "value": 128}},
        "slo": {"ttft_p90_s": 0.4, "itl_p90_s": 0.03},
    }
    data.update(fields)
    return data


def test_the_planner_puts_prefill_and_decode_on_the_gpus_that_serve_them_cheapest():
    from pdsim.planning import parse_plan, plan

    result = plan(parse_plan(mixed_plan()), write=False, jobs=1)
    table = result.candidates.set_index("label")
    # 1P1D on each of the four placements; H20 prefill misses the TTFT target on either decode.
    assert len(table) == 4
    h100, h20 = load_hardware_spec("h100").usd_per_gpu_hour, 1.20
    best = result.recommended
    assert best.deployment.label == "1P TP1 on h100 + 1D TP1 on h20"
    assert best.summary["usd_per_hour"] == pytest.approx(h100 + h20)
    assert table.loc["1P TP1 on h100 + 1D TP1 on h100", "feasible"] == True  # noqa: E712
    assert table.loc["1P TP1 on h20 + 1D TP1 on h20", "feasible"] != True  # noqa: E712
    assert any(line.startswith("The mix wins") for line in result.hardware_lines)
    # Its experiment runs the decode role on an H20 at the plan's price.
    cfg = parse_experiment(yaml.safe_load(best.experiment_yaml), "recommended")
    assert cfg.cluster.decode.hardware == {"base": "h20", "name": "h20", "usd_per_gpu_hour": h20}
    assert usd_per_gpu_hour(cfg) == pytest.approx((h100 + h20) / 2)


def test_a_gpu_type_without_a_price_is_named():
    from pdsim.planning import parse_plan, plan

    with pytest.raises(ConfigError, match=r"gpu_types\[0\]: .*'h20' has no list price"):
        plan(parse_plan(mixed_plan(gpu_types=[{"hardware": "h20"}])), write=False, jobs=1)


def test_pdsim_check_loads_and_prices_every_gpu_type(tmp_path):
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(yaml.safe_dump(mixed_plan()))
    result = CliRunner().invoke(app, ["check", str(plan_file)])
    assert result.exit_code == 0 and "on h100, h20" in result.output, result.output
    plan_file.write_text(yaml.safe_dump(mixed_plan(gpu_types=[{"hardware": "h20"}])))
    result = CliRunner().invoke(app, ["check", str(plan_file)])
    assert result.exit_code != 0 and "gpu_types[0]" in result.output, result.output


def test_serving_accepts_and_ignores_role_hardware():
    from runtime.serve_config import parse_serve_config
    from configs import tiny_pd_yaml

    data = yaml.safe_load(tiny_pd_yaml())
    data["cluster"]["decode"]["hardware"] = "h20"  # sim only, like `hardware`: not refused
    assert parse_serve_config(data).cluster.decode.hardware == "h20"
