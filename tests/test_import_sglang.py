"""`pdsim import-sglang`: SGLang launch commands back into the deployment they start. The round
trip plan -> launch.sh -> import gives the planned deployment (its experiment, as `pdsim plan`
writes it, parsed the way `pdsim run` parses it), for a disaggregated deployment of multi-node
MoE instances and for a colocated one; commands that do not describe one deployment are refused
naming the line or the flag."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from pdsim.cli import app
from pdsim.config import ConfigError, parse_experiment
from pdsim.planning.candidates import Candidate, RoleShape
from pdsim.planning.config import parse_plan
from pdsim.planning.import_sglang import import_sglang
from pdsim.planning.launch import experiment_yaml, sglang_commands

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
     Candidate("disaggregated", (("prefill", 2, RoleShape(16, 8, 16, "deepep")),
                                 ("decode", 3, RoleShape(8, 8, 8, "deepep"))))),
    (dict(SMALL, router={"policy": "round_robin"}),
     Candidate("colocated", (("colocated", 6, RoleShape(2)),))),
    (SMALL, Candidate("disaggregated", (("prefill", 1, RoleShape(1, pp=2)),
                                        ("decode", 2, RoleShape(2))))),
], ids=["pd-moe-multinode", "colocated-shared-nodes", "pd-pipeline"])
def test_plan_launch_import_round_trip(plan, dep, tmp_path):
    cfg = parse_plan(plan)
    script = sglang_commands(dep, cfg, gpus_per_node=8).script()
    planned = yaml.safe_load(experiment_yaml(dep, cfg))
    imported = import_sglang(script, planned)
    assert normalized(imported) == normalized(planned)
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
    with pytest.raises(ConfigError, match="0 `python -m sglang_router.launch_router` commands"):
        import_sglang("\n".join(line for line in lines if "launch_router" not in line), base)
    odd = script.replace("--disaggregation-mode decode", "--disaggregation-mode both")
    with pytest.raises(ConfigError, match="--disaggregation-mode 'both'; allowed: prefill, "
                                          "decode, null"):
        import_sglang(odd, base)
