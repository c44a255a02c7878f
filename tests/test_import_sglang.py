"""`pdsim import-sglang`: SGLang launch commands back into the deployment they start. The round
trip plan -> launch.sh -> import gives the planned deployment (its experiment, as `pdsim plan`
writes it, parsed the way `pdsim run` parses it), for a disaggregated deployment of multi-node
MoE instances and for a colocated one; a large-EP deployment written as such deployments are
published (DeepEP, two-batch overlap, EPLB, environment variables, SGLang's mini_lb, servers on
0.0.0.0) comes back with every option the simulator models and a note naming the rest;
commands that do not describe one deployment are refused naming the line or the flag."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from pdsim.cli import app
from pdsim.config import ConfigError, parse_experiment
from pdsim.planning.candidates import Candidate, RoleShape
from pdsim.planning.config import parse_plan
from pdsim.planning.import_sglang import import_sglang
from pdsim.planning.launch import experiment_yaml, sglang_commands
from pdsim.specs.servable import SERVABLE_HF_CONFIGS

SMALL = {
    "name": "small_plan", "model": "llama-3.1-8b", "hardware": "h100",
    "workload": {"num_requests": 50, "seed": 0, "arrival": {"process": "poisson", "rate_rps": 20},
                 "input_len": {"dist": "fixed", "value": 512},
                 "output_len": {"dist": "fixed", "value": 32}},
    "slo": {"ttft_p90_s": 0.4}, "max_gpus": 64,
}


def normalized(data: dict) -> dict:
    return parse_experiment(data).model_dump(mode="json", exclude={"name", "description"})


@pytest.mark.parametrize("plan, dep", [
    (dict(SMALL, model="deepseek-v3", hardware="h200", kv_dtype_bytes=1,
          scheduler={"page_size": 64, "max_running_requests": 256},
          router={"policy": "cache_aware", "policy_options": {"cache_threshold": 0.5}}),
     Candidate("disaggregated", (("prefill", 2, RoleShape(16, 8, 16, "deepep", eplb=True,
                                                          redundant_experts=16)),
                                 ("decode", 3, RoleShape(8, 8, 8, "deepep",
                                                         two_batch_overlap=True,
                                                         dense_dp=True))))),
    (dict(SMALL, router={"policy": "round_robin"}),
     Candidate("colocated", (("colocated", 6, RoleShape(2)),))),
    (SMALL, Candidate("disaggregated", (("prefill", 1, RoleShape(1, pp=2)),
                                        ("decode", 2, RoleShape(2))))),
    (SMALL, Candidate("disaggregated", (("prefill", 1, RoleShape(1, pp=4, dynamic_chunking=True)),
                                        ("decode", 2, RoleShape(2))))),
], ids=["pd-moe-multinode", "colocated-shared-nodes", "pd-pipeline", "pd-dynamic-chunking"])
def test_plan_launch_import_round_trip(plan, dep, tmp_path):
    cfg = parse_plan(plan)
    script = sglang_commands(dep, cfg, gpus_per_node=8).script()
    planned = yaml.safe_load(experiment_yaml(dep, cfg))
    imported, notes = import_sglang(script, planned)
    assert normalized(imported) == normalized(planned)
    assert notes == []  # every flag a plan writes is read or changes nothing simulated
    # the same through the command line, the commands on standard input
    base = tmp_path / "recommended.yaml"
    base.write_text(experiment_yaml(dep, cfg))
    result = CliRunner().invoke(app, ["import-sglang", "-", "--base", str(base)], input=script)
    assert result.exit_code == 0, result.output
    assert normalized(yaml.safe_load(result.output)) == normalized(planned)


def test_commands_that_are_not_one_deployment_are_refused():
    cfg = parse_plan(SMALL)
    dep = Candidate("disaggregated", (("prefill", 2, RoleShape(1)), ("decode", 1, RoleShape(2))))
    script = sglang_commands(dep, cfg, gpus_per_node=8).script()
    base = yaml.safe_load(experiment_yaml(dep, cfg))
    lines = script.splitlines()
    first = next(i for i, line in enumerate(lines) if "--disaggregation-mode prefill" in line)
    mixed = lines.copy()
    mixed[first] = mixed[first].replace("--tp-size 1", "--tp-size 2")
    with pytest.raises(ConfigError, match="the servers disagree on the prefill parallelism"):
        import_sglang("\n".join(mixed), base)
    missing = [line for i, line in enumerate(lines) if i != first]
    with pytest.raises(ConfigError, match="the router's prefill URLs .* are not the prefill "
                                          "servers'"):
        import_sglang("\n".join(missing), base)
    with pytest.raises(ConfigError, match=r"line 1: 'echo hi' is neither"):
        import_sglang("echo hi\n" + script, base)
    with pytest.raises(ConfigError, match="0 router commands"):
        import_sglang("\n".join(line for line in lines if "launch_router" not in line), base)
    with pytest.raises(ConfigError, match="SGLANG_NUM_RESERVED_DECODE_TOKENS='many'; allowed: "
                                          "an integer"):
        import_sglang(script.replace("python -m sglang.launch_server",
                                     "SGLANG_NUM_RESERVED_DECODE_TOKENS=many python -m "
                                     "sglang.launch_server", 1), base)
    mooncake_ep = script.replace("--tp-size 2", "--tp-size 2 --moe-a2a-backend mooncake")
    with pytest.raises(ConfigError, match="--moe-a2a-backend mooncake; allowed: none, deepep"):
        import_sglang(mooncake_ep, base)
    odd = script.replace("--disaggregation-mode decode", "--disaggregation-mode both")
    with pytest.raises(ConfigError, match="--disaggregation-mode 'both'; allowed: prefill, "
                                          "decode, null"):
        import_sglang(odd, base)


BASE = {"name": "large_ep", "hardware": "h100", "workload": SMALL["workload"]}


MINI_LB = ("python3 -m sglang.srt.disaggregation.mini_lb --prefill http://10.0.0.1:30000 "
           "--prefill http://10.0.1.1:30000 --decode http://10.0.9.1:30000 --host 0.0.0.0 "
           "--port 8000")


def large_ep_commands(decode_extra: str = "", router: str = MINI_LB) -> str:
    """Two prefill instances of 4 nodes and one decode instance of 9 (DeepSeek-V3, DeepEP,
    two-batch overlap, EPLB), each node's command as multi-node launch scripts write it."""
    common = ("--model-path deepseek-ai/DeepSeek-V3-0324 --trust-remote-code --host 0.0.0.0 "
              "--port 30000 --enable-dp-attention --enable-deepep-moe --moe-dense-tp-size 1 "
              "--enable-dp-lm-head --disable-radix-cache --enable-two-batch-overlap "
              "--page-size 1 --watchdog-timeout 1000000 --decode-log-interval 1 "
              "--disaggregation-ib-device mlx5_1 --init-expert-location /data/stats.json "
              "--ep-num-redundant-experts 32 --ep-dispatch-algorithm dynamic")
    lines = ["export MC_TE_METRIC=true", "STATS=/data/stats.json  # not exported"]
    for instance in range(2):
        for rank in range(4):
            lines.append(
                f"SGLANG_TBO_DEBUG=1 python3 -m sglang.launch_server {common} "
                f"--disaggregation-mode prefill --dist-init-addr 10.0.{instance}.1:5757 "
                f"--nnodes 4 --node-rank {rank} --tp-size 32 --dp-size 32 --deepep-mode normal "
                "--mem-fraction-static 0.85 --chunked-prefill-size 524288 "
                "--max-running-requests 8192 --max-total-tokens 131072 --context-length 8192 "
                "--deepep-config /data/deepep.json")
    for rank in range(9):
        lines.append(
            "SGLANG_NUM_RESERVED_DECODE_TOKENS=102 \\\n"
            f"  SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK=256 python3 -m sglang.launch_server "
            f"{common} --disaggregation-mode decode --dist-init-addr 10.0.9.1:5757 --nnodes 9 "
            f"--node-rank {rank} --tp-size 72 --dp-size 72 --deepep-mode low_latency "
            f"--mem-fraction-static 0.835 --max-running-requests 18432 --context-length 4500 "
            f"--cuda-graph-bs 256 {decode_extra}")
    lines.append(router)
    return "\n".join(lines)


def test_a_published_style_large_ep_deployment_keeps_what_is_modelled(tmp_path):
    imported, notes = import_sglang(large_ep_commands(), BASE, model="deepseek-v3")
    large_ep = {"dp_attention": 32, "moe_a2a": "deepep", "two_batch_overlap": True,
                "moe_dense_tp": 1, "dp_lm_head": True, "eplb": {"redundant_experts": 32}}
    assert imported["cluster"] == {
        "mode": "disaggregated",
        "prefill": {"instances": 2, "tp": 32, "ep": 32, **large_ep, "scheduler": {
            "chunked_prefill_size": 524288, "disable_radix_cache": True,
            "max_running_requests": 8192, "max_total_tokens": 131072,
            "mem_fraction_static": 0.85, "page_size": 1}},
        "decode": {"instances": 1, "tp": 72, "ep": 72, **large_ep, "dp_attention": 72,
                   "num_max_dispatch_tokens_per_rank": 256, "scheduler": {
                       "disable_radix_cache": True, "max_running_requests": 18432,
                       "mem_fraction_static": 0.835, "num_reserved_decode_tokens": 102,
                       "page_size": 1}}}
    assert imported["router"] == {"policy": "random"}  # what mini_lb does
    # --cuda-graph-bs 256 captures that size alone: every decode batch replays padded to 256
    assert imported["cost_model"] == {"params": {"cuda_graph_bs": [256]}}
    cfg = parse_experiment(imported)
    assert cfg.cluster.decode.eplb.redundant_experts == 32
    # every prefill node says the same; the note names its first node's line
    assert notes == [
        "line 3 (prefill server): read past, not modelled: --context-length, --deepep-config",
        "line 7 (prefill server): read past, not modelled: --context-length, --deepep-config",
        "line 11 (decode server): read past, not modelled: --context-length"]
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump(BASE))
    result = CliRunner().invoke(app, ["import-sglang", "-", "--base", str(base), "--model",
                                      "deepseek-v3", "-o", str(tmp_path / "x.yaml")],
                                input=large_ep_commands())
    assert result.exit_code == 0, result.output
    assert "warning: line 11 (decode server): read past, not modelled: --context-length" in \
        result.output
    assert yaml.safe_load((tmp_path / "x.yaml").read_text()) == imported


def test_speculative_decoding_takes_its_acceptance_from_the_base():
    flags = ("--speculative-algorithm EAGLE --speculative-num-steps 2 "
             "--speculative-eagle-topk 1 --speculative-num-draft-tokens 3")
    with pytest.raises(ConfigError, match="gives no speculative.acceptance"):
        import_sglang(large_ep_commands(flags), BASE, model="deepseek-v3")
    base = dict(BASE, speculative={"acceptance": {"mean_accept_len": 2.1}})
    imported, _ = import_sglang(large_ep_commands(flags), base, model="deepseek-v3")
    assert imported["speculative"] == {"acceptance": {"mean_accept_len": 2.1},
                                       "method": "mtp", "num_draft_tokens": 2}
    parse_experiment(imported)


def test_deepep_sets_ep_and_unchunked_prefill_reads_as_zero():
    script = "\n".join([
        "python -m sglang.launch_server --model-path deepseek-v3 --tensor-parallel-size 8 "
        "--moe-a2a-backend deepep --chunked-prefill-size -1 --disable-cuda-graph "
        "--attention-backend fa3",
        "python -m sglang_router.launch_router --worker-urls http://127.0.0.1:30000"])
    imported, notes = import_sglang(script, BASE)
    role = imported["cluster"]["colocated"]
    assert (role["ep"], role["moe_a2a"], role["scheduler"]) == (8, "deepep",
                                                              {"chunked_prefill_size": 0})
    assert imported["cost_model"]["params"] == {"cuda_graph_max_bs": 0}
    # no --mem-fraction-static: the simulator derives it as SGLang does, nothing to note
    assert notes == ["line 1 (colocated server): read past, not modelled: --attention-backend"]
    parse_experiment(imported)


def test_online_fp8_quantization_prices_the_16_bit_blocks_per_tensor():
    """SGLang's --quantization fp8 quantises a BF16 checkpoint's linear layers at load with
    per-tensor scales; a checkpoint already in FP8 keeps its own (block) format."""
    def imported_model(model: str, quantization: str) -> tuple:
        script = "\n".join([
            f"python -m sglang.launch_server --model-path {model} --tp 2 "
            f"--quantization {quantization}",
            "python -m sglang_router.launch_router --worker-urls http://127.0.0.1:30000"])
        data, notes = import_sglang(script, BASE)
        parse_experiment(data)
        return data["model"], notes

    model, notes = imported_model("meta-llama/Llama-3.1-8B-Instruct", "fp8")
    assert model == {"base": "llama-3.1-8b", "precision": {
        "attention": "fp8_tensor", "dense_mlp": "fp8_tensor"}} and notes == []
    assert imported_model("deepseek-v3", "fp8") == ("deepseek-v3", [])  # block FP8 already
    model, notes = imported_model("llama-3.1-8b", "modelopt_fp8")
    assert model == {"base": "llama-3.1-8b", "precision": {
        "attention": "fp8_tensor", "dense_mlp": "fp8_tensor"}} and notes == []


def test_quantization_reads_as_the_format_sglang_serves():
    """--quantization modelopt_fp4 is ModelOpt's NVFP4 checkpoint (MLA attention kept BF16),
    never the FP8 preset's format; values that read the checkpoint's own format check the
    model holds it; values pdsim cannot price are an error naming the allowed ones."""
    def imported_model(model: str, quantization: str) -> dict | str:
        script = "\n".join([
            f"python -m sglang.launch_server --model-path {model} --tp 8 "
            f"--quantization {quantization}",
            "python -m sglang_router.launch_router --worker-urls http://127.0.0.1:30000"])
        data, notes = import_sglang(script, BASE)
        assert notes == []
        parse_experiment(data)
        return data["model"]

    assert imported_model("deepseek-r1", "modelopt_fp4") == {"base": "deepseek-r1", "precision": {
        "attention": "bf16", "dense_mlp": "nvfp4", "moe_experts": "nvfp4"}}
    assert imported_model("llama-3.1-70b", "modelopt_fp4") == {
        "base": "llama-3.1-70b", "precision": {"attention": "nvfp4", "dense_mlp": "nvfp4"}}
    assert imported_model("gpt-oss-120b", "mxfp4") == "gpt-oss-120b"
    assert imported_model("kimi-k2-thinking", "compressed-tensors") == "kimi-k2-thinking"
    assert imported_model("kimi-k2-thinking", "moe_wna16") == "kimi-k2-thinking"
    with pytest.raises(ConfigError, match="--quantization awq reads a checkpoint in w4a16"):
        imported_model("llama-3.1-8b", "awq")
    with pytest.raises(ConfigError, match="--quantization w4afp8 is not a format pdsim can "
                                          "price; allowed: fp8, w8a8_fp8, modelopt_fp8"):
        imported_model("deepseek-r1", "w4afp8")


def test_piecewise_cuda_graphs_asked_of_the_prefill_servers_are_priced():
    def imported(prefill_flags: str) -> dict:
        script = "\n".join([
            "python -m sglang.launch_server --model-path llama-3.1-8b --disaggregation-mode "
            f"prefill --port 30000 {prefill_flags}",
            "python -m sglang.launch_server --model-path llama-3.1-8b --disaggregation-mode "
            "decode --port 30001 --cuda-graph-max-bs 128",
            "python -m sglang_router.launch_router --pd-disaggregation --prefill "
            "http://127.0.0.1:30000 --decode http://127.0.0.1:30001"])
        data, notes = import_sglang(script, BASE)
        assert notes == []
        parse_experiment(data)
        return data["cost_model"]["params"]

    assert imported("--enable-piecewise-cuda-graph --piecewise-cuda-graph-max-tokens 4096") == {
        "cuda_graph_max_bs": 128, "piecewise_cuda_graph": True,
        "piecewise_cuda_graph_max_tokens": 4096}
    assert imported("--enable-piecewise-cuda-graph") == {"cuda_graph_max_bs": 128,
                                                          "piecewise_cuda_graph": True}
    assert imported("") == {"cuda_graph_max_bs": 128}


def test_cuda_graph_flags_the_load_balance_method_and_conservativeness_are_imported():
    script = ("python -m sglang.launch_server --model-path m --disaggregation-mode prefill "
              "--port 30000\npython -m sglang.launch_server --model-path m "
              "--disaggregation-mode decode --port 30001 {decode}\npython -m "
              "sglang_router.launch_router --pd-disaggregation --prefill http://127.0.0.1:30000 "
              "--decode http://127.0.0.1:30001")

    def imported(decode: str) -> dict:
        data, _ = import_sglang(script.format(decode=decode), BASE, model="llama-3.1-8b")
        return data

    data = imported("--cuda-graph-bs 8 4 16 --disable-cuda-graph-padding "
                    "--load-balance-method follow_bootstrap_room --schedule-conservativeness 0.5")
    assert data["cluster"]["decode"]["scheduler"]["schedule_conservativeness"] == 0.5
    assert data["cost_model"]["params"] == {"cuda_graph_bs": [4, 8, 16],
                                            "cuda_graph_padding": False}
    assert data["router"]["dp_assignment"] == "room"
    assert parse_experiment(data).cost_model.params["cuda_graph_bs"] == (4, 8, 16)
    assert "dp_assignment" not in imported("")["router"]
    assert "disable_overlap_schedule" not in imported("")["cluster"]["prefill"].get("scheduler", {})
    prefill_off, _ = import_sglang(script.replace("prefill --port", "prefill "
                                                  "--disable-overlap-schedule --port")
                                   .format(decode=""), BASE, model="llama-3.1-8b")
    assert prefill_off["cluster"]["prefill"]["scheduler"]["disable_overlap_schedule"] is True
    assert "disable_overlap_schedule" not in prefill_off["cluster"]["decode"].get("scheduler", {})
    decode_off = imported("--disable-overlap-schedule")["cluster"]["decode"]["scheduler"]
    assert decode_off["disable_overlap_schedule"] is True  # the decode loop's overlap too
    _, notes = import_sglang(script.format(decode="--load-balance-method minimum_tokens"), BASE,
                             model="llama-3.1-8b")
    assert any("--load-balance-method minimum_tokens" in note for note in notes)


def test_the_pd_load_balancer_takes_several_urls_per_flag():
    """SGLang's launch_lb (and mini_lb) take `--prefill URL URL ...`; its policies are random
    and, with the Rust balancer, po2."""
    by_mini_lb, _ = import_sglang(large_ep_commands(), BASE, model="deepseek-v3")
    lb = ("python3 -m sglang.srt.disaggregation.launch_lb --rust-lb --policy po2 --prefill "
          "http://10.0.0.1:30000 http://10.0.1.1:30000 --prefill-bootstrap-ports 8998 "
          "--decode http://10.0.9.1:30000")
    by_lb, _ = import_sglang(large_ep_commands(router=lb), BASE, model="deepseek-v3")
    assert by_lb == {**by_mini_lb, "router": {"policy": "power_of_two"}}
    one_short = lb.replace(" http://10.0.1.1:30000", "")
    with pytest.raises(ConfigError, match="the router's prefill URLs"):
        import_sglang(large_ep_commands(router=one_short), BASE, model="deepseek-v3")


def test_a_model_path_the_simulator_cannot_read_asks_for_a_preset(tmp_path):
    with pytest.raises(ConfigError, match=r"--model-path 'deepseek-ai/DeepSeek-V3-0324' is "
                                          r"neither .*\(its name suggests --model deepseek-v3\)"):
        import_sglang(large_ep_commands(), BASE)
    r1 = large_ep_commands().replace("deepseek-ai/DeepSeek-V3-0324", "deepseek-ai/DeepSeek-R1-0528")
    with pytest.raises(ConfigError, match=r"\(its name suggests --model deepseek-r1\)"):
        import_sglang(r1, BASE)
    # a checkpoint whose config.json is here is read as it is
    checkpoint = tmp_path / "deepseek-ai" / "DeepSeek-V3-0324"
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.json").write_text(json.dumps(SERVABLE_HF_CONFIGS["tiny-mla"]))
    imported, _ = import_sglang(large_ep_commands(), BASE, base_dir=tmp_path)
    assert imported["model"] == "deepseek-ai/DeepSeek-V3-0324"


def test_the_first_published_instructions_spellings_and_a_sweeping_base():
    """SGLang's first large-EP instructions named the decode reserve
    SGLANG_HACK_PD_DECODE_NUM_RESERVED_DECODE_TOKENS and fronted the servers with
    `launch_router --mini-lb` (random pairs whatever --policy says); a chain's
    --speculative-num-draft-tokens (steps + 1) is what --speculative-num-steps already says; a
    base experiment's sweep over the deployment the commands fix is dropped, with a note."""
    router = ("python3 -m sglang_router.launch_router --pd-disaggregation --mini-lb "
              "--policy cache_aware --prefill http://10.0.0.1:30000 --prefill "
              "http://10.0.1.1:30000 --decode http://10.0.9.1:30000 --port 8000")
    script = large_ep_commands(router=router).replace(
        "SGLANG_NUM_RESERVED_DECODE_TOKENS=102", "SGLANG_HACK_PD_DECODE_NUM_RESERVED_DECODE_TOKENS=77")
    base = dict(BASE, speculative={"acceptance": {"mean_accept_len": 2.1}},
                sweep={"cluster.decode.ep,workload.num_requests": [[8, 10], [16, 20]],
                       "workload.seed": [0, 1]})
    chain = ("--speculative-algorithm EAGLE --speculative-num-steps 3 --speculative-eagle-topk 1 "
             "--speculative-num-draft-tokens 4")
    imported, notes = import_sglang(script.replace("--cuda-graph-bs 256", f"--cuda-graph-bs 256 "
                                                   f"{chain}"), base, model="deepseek-v3")
    assert imported["router"] == {"policy": "random"}
    assert imported["cluster"]["decode"]["scheduler"]["num_reserved_decode_tokens"] == 77
    assert imported["speculative"]["num_draft_tokens"] == 3
    assert imported["sweep"] == {"workload.seed": [0, 1]}
    assert notes[-1] == ("the base's sweep over cluster.decode.ep,workload.num_requests is "
                         "dropped: the commands fix the deployment it would vary")
    assert not any("--speculative-num-draft-tokens" in n for n in notes)
    parse_experiment(imported)
    tree = chain.replace("--speculative-num-draft-tokens 4", "--speculative-num-draft-tokens 8")
    _, notes = import_sglang(script.replace("--cuda-graph-bs 256", f"--cuda-graph-bs 256 {tree}"),
                             base, model="deepseek-v3")
    assert any("--speculative-num-draft-tokens 8 (a chain of 3 steps verifies 4)" in n
               for n in notes)
    # SGLang's argparse takes --dp for --dp-size (an abbreviation): DP attention stays
    short, notes = import_sglang(script.replace("--dp-size", "--dp"), base, model="deepseek-v3")
    assert short["cluster"]["decode"]["dp_attention"] == 72
    assert not any("--dp" in n for n in notes)
    # data-parallel replicas without DP attention are said to be read as one
    _, notes = import_sglang(script.replace("--enable-dp-attention", ""), base,
                             model="deepseek-v3")
    assert any("--dp-size 72 without --enable-dp-attention (SGLang runs 72 replicas of tp 72"
               in n for n in notes)


def test_speculation_without_num_steps_takes_sglangs_auto_choice():
    """SGLang's auto_choose_speculative_params: --speculative-algorithm alone drafts 3 steps
    with top-k 1 for DeepSeek-V3 (4 draft tokens), not 1."""
    base = dict(BASE, speculative={"acceptance": {"mean_accept_len": 2.1}})
    imported, notes = import_sglang(large_ep_commands("--speculative-algorithm NEXTN"), base,
                                    model="deepseek-v3")
    assert imported["speculative"]["num_draft_tokens"] == 3
    assert not any("speculative" in note for note in notes)
    parse_experiment(imported)


def test_a_single_colocated_server_needs_no_router():
    """The most common SGLang launch, one `launch_server` its clients reach directly (on one
    node or over --nnodes), imports as one colocated instance; several servers still need the
    router that shares requests among them, and a PD pair always does."""
    server = ("python -m sglang.launch_server --model-path meta-llama/Llama-3.1-8B-Instruct "
              "--tp 2 --port 30000")
    data, notes = import_sglang(server, BASE)
    cfg = parse_experiment(data)
    assert (cfg.cluster.mode, cfg.cluster.colocated.instances, cfg.cluster.colocated.tp) == (
        "colocated", 1, 2) and notes == []
    nodes = "\n".join(f"{server} --nnodes 2 --node-rank {rank}" for rank in (0, 1))
    assert import_sglang(nodes, BASE)[0]["cluster"] == data["cluster"]
    with pytest.raises(ConfigError, match=r"0 router commands .*; allowed: one \(none only for "
                                          r"a single server without --disaggregation-mode\)"):
        import_sglang(f"{server}\n{server.replace('30000', '30001')}", BASE)
