"""Experiment configs: validation errors that say where and what, and sweep expansion."""

from __future__ import annotations

import pytest
import yaml

from pdsim.config import ConfigError, expand_sweep, load_experiment, parse_experiment
from pdsim.sim.build import build_cluster

BASE = {
    "name": "x",
    "workload": {"num_requests": 10, "seed": 0, "arrival": {"process": "poisson", "rate_rps": 1},
                 "input_len": {"dist": "fixed", "value": 100},
                 "output_len": {"dist": "fixed", "value": 10}},
}


def write(tmp_path, data) -> str:
    p = tmp_path / "exp.yaml"
    p.write_text(yaml.safe_dump(data))
    return str(p)


def test_unknown_key_names_file_path_and_allowed_keys(tmp_path):
    data = {**BASE, "cluster": {"prefill": {"instancez": 2}}}
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as e:
        load_experiment(path)
    msg = str(e.value)
    assert path in msg
    assert "cluster.prefill.instancez" in msg
    assert "instances" in msg and "tp" in msg  # what is allowed


def test_bad_value_is_named_with_its_value(tmp_path):
    data = {**BASE, "cluster": {"decode": {"tp": 4, "dp_attention": 3}}}
    with pytest.raises(ConfigError, match=r"dp_attention=3 must divide tp=4"):
        load_experiment(write(tmp_path, data))
    with pytest.raises(ConfigError, match=r"cluster.prefill.instances.*got 0"):
        parse_experiment({**BASE, "cluster": {"prefill": {"instances": 0}}})


def test_unknown_policy_and_cost_model_list_allowed():
    with pytest.raises(ConfigError, match=r"router.policy.*'fastest'.*least_loaded"):
        parse_experiment({**BASE, "router": {"policy": "fastest"}})
    with pytest.raises(ConfigError, match=r"cost_model.name.*roofline"):
        parse_experiment({**BASE, "cost_model": {"name": "magic"}})


def test_page_size_mismatch_between_roles_is_refused():
    data = {**BASE, "cluster": {"prefill": {"scheduler": {"page_size": 16}},
                                "decode": {"scheduler": {"page_size": 32}}}}
    with pytest.raises(ConfigError, match="page_size 16 != decode page_size 32"):
        parse_experiment(data)


def test_unknown_model_and_weights_that_do_not_fit():
    with pytest.raises(ConfigError, match="llama-3.1-8b"):  # lists the presets
        build_cluster(parse_experiment({**BASE, "model": "gpt-5"}))
    with pytest.raises(ConfigError, match="cluster.prefill"):
        build_cluster(parse_experiment({**BASE, "model": "llama-3.1-70b"}))  # 140 GB on one H100


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="no such experiment file"):
        load_experiment(tmp_path / "nope.yaml")
    p = tmp_path / "bad.yaml"
    p.write_text("name: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_experiment(p)


def test_sweep_grid_and_zipped_fields():
    data = {**BASE, "sweep": {
        "cluster.prefill.instances,cluster.decode.instances": [[1, 3], [3, 1]],
        "workload.arrival.rate_rps": [1, 2, 4],
    }}
    cfg = parse_experiment(data)
    points = expand_sweep(cfg, data)
    assert len(points) == 6
    pairs = {(c.cluster.prefill.instances, c.cluster.decode.instances, c.workload.arrival.rate_rps)
             for _, c in points}
    assert pairs == {(p, d, r) for p, d in [(1, 3), (3, 1)] for r in (1, 2, 4)}
    swept, first = points[0]
    assert swept == {"cluster.prefill.instances": 1, "cluster.decode.instances": 3,
                     "workload.arrival.rate_rps": 1}


def test_sweep_value_errors_name_the_point():
    data = {**BASE, "sweep": {"cluster.prefill.tp": [1, 0]}}
    with pytest.raises(ConfigError, match=r"sweep point cluster.prefill.tp=0"):
        expand_sweep(parse_experiment(data), data)
    data = {**BASE, "sweep": {"a,b": [[1]]}}
    with pytest.raises(ConfigError, match="list of 2"):
        expand_sweep(parse_experiment(data), data)


def test_config_is_frozen():
    cfg = parse_experiment(BASE)
    with pytest.raises(Exception):
        cfg.seed = 3


# ---- one deployment, two backends (pdsim/deployment.py) -------------------------------------

REPO = __import__("pathlib").Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name,roles", [("real_pd", ("prefill", "decode")),
                                        ("real_colocated", ("colocated",))])
def test_one_file_is_simulated_and_served_with_the_same_scheduler(name, roles):
    """`pdsim run` and `pdsim serve` accept the same YAML, and the simulator's schedulers and
    the real workers' are built from it alike (SchedulerKnobs.build)."""
    from runtime.serve_config import load_serve_config

    path = REPO / "experiments" / f"{name}.yaml"
    exp, _ = load_experiment(path)
    serve = load_serve_config(path)
    cluster = build_cluster(exp, str(path.parent))
    for role in roles:
        sim_sched = getattr(cluster, role).scheduler
        assert sim_sched == serve.scheduler_config(role)
        assert sim_sched.max_prefill_tokens == 4096 and sim_sched.chunked_prefill_size == 512
    assert serve.model_name == "tiny-llama" and serve.router.port == 30000


def test_the_same_yaml_builds_equal_schedulers_for_both_backends():
    """A deployment that gives only the pool: the simulator's and the real workers' schedulers
    are equal, every other knob SGLang's default (one home: SchedulerKnobs) and
    max_running_requests derived from the pool alike."""
    from runtime.serve_config import parse_serve_config

    data = {**BASE, "model": "tiny-llama", "cluster": {
        "prefill": {"scheduler": {"num_pages": 100}},
        "decode": {"scheduler": {"num_pages": 300, "max_running_requests": 64}}}}
    sim = build_cluster(parse_experiment(data))
    real = parse_serve_config(data)
    for role in ("prefill", "decode"):
        assert getattr(sim, role).scheduler == real.scheduler_config(role)
    decode, prefill = real.scheduler_config("decode"), real.scheduler_config("prefill")
    assert (decode.max_prefill_tokens, decode.chunked_prefill_size, decode.num_reserved_decode_tokens,
            decode.bootstrap_timeout_s, decode.waiting_timeout_s) == (16384, 8192, 512, 300.0, 300.0)
    assert (prefill.num_pages, prefill.max_running_requests) == (100, 800)  # 1600 tokens // 2
    assert (decode.num_pages, decode.max_running_requests) == (300, 64)


def test_a_speculating_deployment_runs_sglangs_48_requests_on_both_backends():
    """Unset, max_running_requests is SGLang's 48 per speculating instance on the simulator's
    and the real workers' schedulers alike (not the pool's derived limit); given, it is kept."""
    from runtime.serve_config import parse_serve_config

    spec = {"method": "mtp", "num_draft_tokens": 2, "acceptance": {"mean_accept_len": 1.5}}
    pages = {"scheduler": {"num_pages": 300}}
    data = {**BASE, "model": "tiny-llama", "speculative": spec,
            "cluster": {"prefill": pages, "decode": pages}}
    real = parse_serve_config(data)
    assert [real.scheduler_config(r).max_running_requests for r in ("prefill", "decode")] == [48, 48]
    plain = parse_serve_config({**data, "speculative": {"method": "none"}})
    assert plain.scheduler_config("decode").max_running_requests == 2048  # the pool-derived
    big = {"tp": 8, "scheduler": {"num_pages": 300}}
    sim = build_cluster(parse_experiment({**data, "model": "deepseek-v3", "hardware": "h200",
                                          "cluster": {"prefill": big, "decode": big}}))
    assert sim.decode.scheduler.max_running_requests == 48


def test_num_pages_means_the_same_and_serving_needs_it_given():
    """num_pages is pages per rank in both backends; left out, the simulator sizes the pool
    from the hardware's memory and serving refuses, naming the field (no hidden default)."""
    from runtime.serve_config import load_serve_config, parse_serve_config

    data = {**BASE, "model": "tiny-llama", "cluster": {"prefill": {"scheduler": {"num_pages": 64}}}}
    sim = build_cluster(parse_experiment(data))
    assert sim.prefill.scheduler.num_pages == 64
    assert sim.decode.scheduler.num_pages > 10**6  # an H100's memory, less tiny-llama's weights
    with pytest.raises(ConfigError, match=r"cluster.decode.scheduler.num_pages: not given; the "
                                          r"simulator sizes the KV pool from the hardware's memory"):
        parse_serve_config(data)
    assert load_serve_config(None).scheduler_config().num_pages == 2048  # the file-less default



def test_serving_refuses_attention_dp_and_ep_together_on_one_role():
    """The real backend serves attention DP or EP above 1 on a PD role, not both at once; the
    simulator takes both."""
    from runtime.serve_config import parse_serve_config

    pages = {"scheduler": {"num_pages": 64}}
    data = {**BASE, "model": "tiny-moe",
            "cluster": {"prefill": pages, "decode": {**pages, "tp": 2, "dp_attention": 2, "ep": 2}}}
    assert build_cluster(parse_experiment(data)).decode.dp_attention == 2
    with pytest.raises(ConfigError, match=r"cluster.decode: dp_attention 2 with ep 2; the real "
                                          r"backend serves one of them above 1 per role"):
        parse_serve_config(data)
    one = {**data, "cluster": {"prefill": pages, "decode": {**pages, "tp": 2, "ep": 2}}}
    assert parse_serve_config(one).role("decode").ep == 2

def test_serving_warns_of_head_slices_over_tcp_and_check_prints_it(tmp_path):
    """GQA KV over an attention-TP mismatch moves one descriptor per token slot per buffer: over
    TCP the note says so with the descriptor count the simulator prices (tiny-llama: 2 layers x
    K, V x 2 rank pairs = 8 a token); equal TP, MLA (a replicated latent) and rdma send whole
    pages and get none. `pdsim check` prints it."""
    from typer.testing import CliRunner

    from pdsim.cli import app
    from runtime.serve_config import parse_serve_config

    pages = {"scheduler": {"num_pages": 64}}
    mismatch = {"model": "tiny-llama", "cluster": {"mode": "disaggregated",
                "prefill": {**pages, "tp": 2}, "decode": pages}}
    (note,) = parse_serve_config(mismatch).notes()
    assert "attention TP 2 (prefill) -> 1 (decode)" in note and "8 head slices" in note
    assert "1,000-token prompt's KV takes ~0.10 s" in note
    equal = {**mismatch, "cluster": {"mode": "disaggregated", "prefill": pages, "decode": pages}}
    mla = {**mismatch, "model": "tiny-mla"}
    rdma = {**mismatch, "transfer": {"protocol": "rdma", "device_name": "mlx5_0"}}
    for data in (equal, mla, rdma):
        assert parse_serve_config(data).notes() == []
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(mismatch))
    result = CliRunner().invoke(app, ["check", str(path)])
    assert result.exit_code == 0 and "8 head slices" in result.output
    # a file both simulated and served (a workload and a transfer section, as real_pd.yaml)
    # is checked as an experiment, and still gets the note serving it would print
    both = {**mismatch, "name": "both", "transfer": {"protocol": "tcp"},
            "cost_model": {"name": "roofline"},
            "workload": {"num_requests": 10, "arrival": {"process": "poisson", "rate_rps": 1},
                         "input_len": {"dist": "fixed", "value": 64},
                         "output_len": {"dist": "fixed", "value": 8}}}
    path.write_text(yaml.safe_dump(both))
    result = CliRunner().invoke(app, ["check", str(path)])
    assert result.exit_code == 0 and "valid experiment" in " ".join(result.output.split())
    assert "8 head slices" in result.output


# Spellings `pdsim run` rejects (the earlier flat serve layout's among them), each with the
# field path and message of its error.
REJECTED = [
    ({"mode": "disaggregated"}, "(top level)", "mode is now cluster.mode"),
    ({"page_size": 8}, "(top level)", "page_size is now cluster.<role>.scheduler.page_size"),
    ({"num_pages": 8}, "(top level)", "num_pages is now cluster.<role>.scheduler.num_pages"),
    ({"scheduler": {}}, "(top level)", "scheduler is now cluster.<role>.scheduler"),
    ({"prefill": {}}, "(top level)", "prefill is now cluster.prefill"),
    ({"port": 0}, "(top level)", "port is now router.port"),
    ({"cluster": {"decode": {"num_pages": 8}}}, "cluster.decode",
     "num_pages is now scheduler.num_pages"),
    ({"cluster": {"prefill": {"metadata_slots": 8}}}, "cluster.prefill",
     "metadata_slots is now scheduler.metadata_slots"),
    ({"transfer": {"bootstrap_timeout_s": 5}}, "transfer",
     "bootstrap_timeout_s is now cluster.<role>.scheduler.bootstrap_timeout_s"),
    ({"transfer": {"waiting_timeout_s": 5}}, "transfer",
     "waiting_timeout_s is now cluster.<role>.scheduler.waiting_timeout_s"),
    ({"router": {"polcy": "random"}}, "router.polcy", "unknown key"),
]


@pytest.mark.parametrize("change,where,message", REJECTED, ids=[w + ":" + m.split()[0]
                                                               for _, w, m in REJECTED])
def test_a_spelling_pdsim_run_rejects_serving_rejects_alike(change, where, message):
    """One validator for both backends: what `pdsim run` rejects, `pdsim serve` rejects with
    the same error (the earlier flat serve layout is no longer rewritten)."""
    from runtime.serve_config import parse_serve_config

    pool = {"scheduler": {"num_pages": 64}}
    data = {**BASE, "model": "tiny-llama", "cluster": {"prefill": pool, "decode": pool}}
    for key, value in change.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
        if key == "cluster":
            data[key] = {r: {**pool, **value.get(r, {})} for r in ("prefill", "decode")}
    errors = []
    for parse in (parse_experiment, parse_serve_config):
        with pytest.raises(ConfigError) as info:
            parse(data, "x.yaml")
        line = next(ln.strip() for ln in str(info.value).splitlines() if message in ln)
        errors.append(line)
    assert errors[0] == errors[1] and errors[0].startswith(where + ":")


def test_per_instance_knobs_split_over_dp_ranks():
    from pdsim.deployment import SchedulerKnobs

    knobs = SchedulerKnobs(max_running_requests=256, chunked_prefill_size=8192)
    rank = knobs.build(num_pages=10, dp_attention=8)
    assert (rank.max_running_requests, rank.chunked_prefill_size) == (32, 1024)
    assert rank.max_prefill_tokens == 16384  # per rank already
    with pytest.raises(ValueError, match=r"x\.max_running_requests: 4 is per instance.*dp_attention=8"):
        SchedulerKnobs(max_running_requests=4).build(10, 8, where="x")


def test_max_running_requests_unset_is_derived_from_the_pool_as_sglang_does():
    from pdsim.deployment import SchedulerKnobs

    knobs = SchedulerKnobs(page_size=16)
    assert knobs.max_running_requests is None
    # A small pool: half its tokens. 100 pages x 16 = 1600 tokens -> 800.
    assert knobs.build(num_pages=100).max_running_requests == 800
    # 2**18 tokens: the request pool's 2048 floor (2**18 * 512 / 131072 = 1024 < 2048).
    assert knobs.build(num_pages=2**14).max_running_requests == 2048
    # 2**20 tokens: 4096 (its ceiling); per DP rank, not split, since each rank has its own pool.
    assert knobs.build(num_pages=2**16, dp_attention=8).max_running_requests == 4096


def test_renamed_and_moved_fields_name_their_new_place():
    from runtime.serve_config import parse_serve_config

    with pytest.raises(ConfigError, match="network: .*bandwidth_gbps is now bandwidth_gb_per_s"):
        parse_experiment({**BASE, "network": {"bandwidth_gbps": 50}})
    with pytest.raises(ConfigError, match="cluster.decode: .*num_pages is now scheduler.num_pages"):
        parse_experiment({**BASE, "cluster": {"decode": {"num_pages": 50}}})
    with pytest.raises(ConfigError, match=r"transfer: .*bootstrap_timeout_s is now cluster.<role>"
                                          r".scheduler.bootstrap_timeout_s"):
        parse_serve_config({"cluster": {"mode": "disaggregated"},
                            "transfer": {"bootstrap_timeout_s": 5}})


def test_serving_refuses_what_only_the_simulator_models():
    from runtime.serve_config import parse_serve_config

    with pytest.raises(ConfigError, match="'llama-3.1-8b' is not a servable preset"):
        parse_serve_config({"model": "llama-3.1-8b", "cluster": {"mode": "disaggregated"}})
    with pytest.raises(ConfigError, match="cluster.colocated.dp_attention: 2; the real backend"):
        parse_serve_config({"model": "tiny-llama", "cluster": {"mode": "colocated", "colocated": {
            "tp": 2, "dp_attention": 2, "scheduler": {"num_pages": 64}}}})
    with pytest.raises(ConfigError, match="cluster.colocated.instances: 2"):
        parse_serve_config({"model": "tiny-llama", "cluster": {
            "mode": "colocated", "colocated": {"instances": 2, "scheduler": {"num_pages": 64}}}})
    with pytest.raises(ConfigError, match="model: 'llama-3.1-8b' is not a servable"):
        parse_serve_config({"cluster": {"mode": "disaggregated"}})  # the default: one for both


def test_one_preset_registry_marks_the_servable_presets():
    from pdsim.deployment import model_presets

    presets = model_presets()
    assert presets["tiny-llama"] == presets["tiny-mla"] == ("sim", "real")
    assert presets["llama-3.1-8b"] == ("sim",)


def test_bandwidths_are_named_in_gigabytes_per_second():
    from pdsim.specs.hardware import load_hardware_spec

    assert load_hardware_spec("h100").rdma_gb_per_s == 50  # 400 Gb/s NIC
    with pytest.raises(ValueError, match="rdma_gbps is now rdma_gb_per_s"):
        load_hardware_spec({"base": "h100", "rdma_gbps": 25})
