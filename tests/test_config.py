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
