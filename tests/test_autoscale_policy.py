"""The autoscaling policies (pdsim/core/autoscale.py) on constructed observations, and the
`autoscaling:` config section's errors."""

import pytest
from pydantic import ValidationError

from pdsim.autoscaling_config import AutoscalingConfig
from pdsim.core.autoscale import (
    Bounds,
    FixedSchedule,
    Predictor,
    RoleState,
    RoleThresholds,
    ScaleObservation,
    ScaleTarget,
    SlaPlanner,
    ThresholdPolicy,
)
from pdsim.deployment import Deployment


def obs(now_s=0.0, p=RoleState(1), d=RoleState(1), window_s=10.0, **kw):
    return ScaleObservation(now_s=now_s, window_s=window_s, prefill=p, decode=d, **kw)


def test_fixed_schedule_follows_its_steps_and_keeps_the_current_counts_before_the_first():
    policy = FixedSchedule([(10, 2, 3), (20, 1, 1)], interval_s=5)
    assert policy.decide(obs(5, RoleState(4), RoleState(5, starting=1))) == ScaleTarget(4, 6)
    assert policy.decide(obs(10)) == ScaleTarget(2, 3)
    assert policy.decide(obs(19.9)) == ScaleTarget(2, 3)
    assert policy.decide(obs(25)) == ScaleTarget(1, 1)


def test_fixed_schedule_rejects_unordered_steps():
    with pytest.raises(ValueError, match="increasing at_s"):
        FixedSchedule([(10, 1, 1), (10, 2, 2)], interval_s=5)


def test_threshold_grows_a_role_whose_queue_or_kv_is_high_and_shrinks_an_idle_one():
    policy = ThresholdPolicy(RoleThresholds(queue_up=4), RoleThresholds(kv_up=0.8),
                             interval_s=10, bounds=Bounds(max_prefill=3, max_decode=3))
    # prefill: 10 waiting on 2 running is 5 per instance > 4; decode: KV 0.9 > 0.8
    t = policy.decide(obs(0, RoleState(2, queue_len=10, kv_usage=0.5),
                          RoleState(2, kv_usage=0.9)))
    assert t == ScaleTarget(3, 3)
    # both idle: one fewer each; but not below the minimum
    t = policy.decide(obs(10, RoleState(3), RoleState(1)))
    assert t == ScaleTarget(2, 1)


def test_threshold_caps_at_max_and_holds_while_an_instance_starts_or_drains():
    policy = ThresholdPolicy(RoleThresholds(), RoleThresholds(), interval_s=10,
                             bounds=Bounds(max_prefill=2, max_decode=4))
    busy = RoleState(2, queue_len=100)
    assert policy.decide(obs(0, busy, busy)).prefill == 2
    # idle, but a decode instance is still starting: no shrink yet
    assert policy.decide(obs(10, RoleState(2), RoleState(2, starting=1))) == ScaleTarget(1, 3)


def test_threshold_cooldown_holds_a_role_that_just_changed():
    policy = ThresholdPolicy(RoleThresholds(), RoleThresholds(), interval_s=10, cooldown_s=30)
    busy = RoleState(1, queue_len=50)
    assert policy.decide(obs(0, busy, RoleState(2, kv_usage=0.5))) == ScaleTarget(2, 2)
    busy2 = RoleState(2, queue_len=50)
    assert policy.decide(obs(10, busy2, RoleState(2, kv_usage=0.5))) == ScaleTarget(2, 2)
    assert policy.decide(obs(30, busy2, RoleState(2, kv_usage=0.5))) == ScaleTarget(3, 2)


def test_thresholds_must_be_ordered():
    with pytest.raises(ValueError, match="queue_down < queue_up"):
        RoleThresholds(queue_up=1, queue_down=2)
    with pytest.raises(ValueError, match="kv_down < kv_up"):
        RoleThresholds(kv_up=0.3, kv_down=0.5)


def test_sla_planner_sizes_each_role_from_rate_lengths_and_capacity():
    planner = SlaPlanner(prefill_tokens_per_s=10_000, decode_tokens_per_s=1_000, interval_s=10,
                         predictor="last", bounds=Bounds(max_prefill=10, max_decode=10))
    # 100 arrivals in 10 s = 10 req/s; 2500 prompt tokens -> 25k tok/s -> 3 prefill;
    # 250 output tokens -> 2.5k tok/s -> 3 decode
    t = planner.decide(obs(10, arrivals=100, mean_input_tokens=2500, mean_output_tokens=250))
    assert t == ScaleTarget(3, 3)
    # exactly 2 instances' worth is 2, not 3
    t = planner.decide(obs(20, arrivals=80, mean_input_tokens=2500, mean_output_tokens=250))
    assert t == ScaleTarget(2, 2)
    # more than the bounds allow: capped
    t = planner.decide(obs(30, arrivals=10_000, mean_input_tokens=2500, mean_output_tokens=250))
    assert t == ScaleTarget(10, 10)


def test_sla_planner_headroom_and_an_empty_start():
    planner = SlaPlanner(1000, 1000, interval_s=1, predictor="last", headroom=0.5)
    assert planner.decide(obs(1, window_s=1)) == ScaleTarget(1, 1)  # nothing seen: the floor
    t = planner.decide(obs(2, window_s=1, arrivals=1, mean_input_tokens=900, mean_output_tokens=400))
    assert t == ScaleTarget(2, 1)


def test_sla_planner_moving_average_smooths_a_spike():
    planner = SlaPlanner(1000, 1000, interval_s=1, predictor="moving_average", window=4)
    for now, n in enumerate([1, 1, 1, 9]):
        t = planner.decide(obs(now, window_s=1, arrivals=n, mean_input_tokens=1000,
                               mean_output_tokens=1000))
    assert t == ScaleTarget(3, 3)  # mean 3 req/s, not the last 9


def test_predictors():
    lin = Predictor("linear", 3)
    for v in (1, 2, None, 3):
        lin.add(v)
    assert lin.predict() == pytest.approx(4.0)
    last = Predictor("last", 5)
    for v in (1, 7):
        last.add(v)
    assert last.predict() == 7
    with pytest.raises(ValueError, match="allowed: last, moving_average, linear"):
        Predictor("arima", 3)


def test_scale_target_and_bounds_reject_bad_counts():
    with pytest.raises(ValueError, match="ScaleTarget.decode"):
        ScaleTarget(1, -1)
    with pytest.raises(ValueError, match="1 <= min <= max"):
        Bounds(min_prefill=3, max_prefill=2)


# ---- the config section ------------------------------------------------------------------


def test_config_builds_each_policy():
    fixed = AutoscalingConfig.model_validate(
        {"policy": "fixed", "fixed": {"schedule": [{"at_s": 0, "prefill": 1, "decode": 2}]}})
    assert fixed.make_policy().decide(obs(1)) == ScaleTarget(1, 2)
    assert isinstance(AutoscalingConfig(policy="threshold").make_policy(), ThresholdPolicy)
    static = AutoscalingConfig(policy="static", threshold={"cooldown_s": 5}).make_policy()
    assert static.decide(obs(1, RoleState(3), RoleState(2, starting=1))) == ScaleTarget(3, 3)
    sla = AutoscalingConfig.model_validate({"policy": "sla", "interval_s": 5})
    planner = sla.make_policy(prefill_tokens_per_s=100.0, decode_tokens_per_s=50.0)
    assert (planner.prefill_tokens_per_s, planner.decode_tokens_per_s, planner.interval_s) == (100, 50, 5)


@pytest.mark.parametrize("data, message", [
    ({"policy": "fixed"}, "policy fixed needs fixed.schedule"),
    ({"policy": "scale"}, "fixed"),
    ({"policy": "threshold", "prefill": {"min_instances": 3, "max_instances": 2}},
     "min_instances \\(3\\) must be <= max_instances \\(2\\)"),
    ({"policy": "threshold", "threshold": {"decode": {"kv_up": 0.3}}}, "kv_down < kv_up"),
    ({"policy": "fixed", "fixed": {"schedule": [{"at_s": 5, "prefill": 1, "decode": 1},
                                                {"at_s": 1, "prefill": 1, "decode": 1}]}},
     "increasing at_s"),
    ({"policy": "fixed", "decode": {"max_instances": 2},
      "fixed": {"schedule": [{"at_s": 0, "prefill": 1, "decode": 3}]}},
     "fixed.schedule\\[0\\].decode 3 lies outside autoscaling.decode \\[1, 2\\]"),
])
def test_config_errors_name_the_problem(data, message):
    with pytest.raises(ValidationError, match=message):
        AutoscalingConfig.model_validate(data)


def test_sla_without_capacities_says_which_are_missing():
    with pytest.raises(ValueError, match="autoscaling.sla.decode_tokens_per_s"):
        AutoscalingConfig(policy="sla").make_policy(prefill_tokens_per_s=10.0)


def test_deployment_checks_the_starting_counts_and_mode():
    with pytest.raises(ValidationError, match="cluster.decode.instances 5 .* outside"):
        Deployment.model_validate({"cluster": {"decode": {"instances": 5}},
                                   "autoscaling": {"policy": "threshold",
                                                   "decode": {"max_instances": 4}}})
    with pytest.raises(ValidationError, match="needs cluster.mode disaggregated"):
        Deployment.model_validate({"cluster": {"mode": "colocated"},
                                   "autoscaling": {"policy": "threshold"}})
