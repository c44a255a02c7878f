"""Arrival processes whose rate changes over time (pdsim/workload/schedule.py): the arrivals
per window follow the schedule, seeded; bad schedules fail with a clear error."""

import numpy as np
import pytest
from pydantic import ValidationError

from pdsim.workload import DiurnalArrival, StepsArrival, generate

LENGTHS = {"input_len": {"dist": "fixed", "value": 8}, "output_len": {"dist": "fixed", "value": 8}}


def workload(arrival, n, seed=3):
    return generate({"num_requests": n, "seed": seed, "arrival": arrival, **LENGTHS})


def test_steps_give_each_window_its_rate_times_its_length():
    arrival = {"process": "steps", "steps": [{"at_s": 0, "rate_rps": 2}, {"at_s": 100, "rate_rps": 0},
                                             {"at_s": 200, "rate_rps": 20}]}
    w = workload(arrival, 2200)
    counts = np.histogram(w.arrival_s, bins=[0, 100, 200, 300])[0]
    # Poisson counts: 200 (sd 14), 0, 2000 (sd 45); the last step holds past 300 s
    assert abs(counts[0] - 200) < 45 and counts[1] == 0 and abs(counts[2] - 2000) < 140
    assert np.all(np.diff(w.arrival_s) >= 0)
    assert np.array_equal(w.arrival_s, workload(arrival, 2200).arrival_s)  # seeded
    assert not np.array_equal(w.arrival_s, workload(arrival, 2200, seed=4).arrival_s)


def test_diurnal_follows_its_sinusoid_from_trough_to_peak_and_back():
    arrival = {"process": "diurnal", "trough_rps": 2, "peak_rps": 20, "period_s": 1000}
    spec = DiurnalArrival.model_validate(arrival)
    w = workload(arrival, 11_000)  # a period holds (2 + 20) / 2 * 1000 = 11,000 on average
    edges = np.arange(0, 1001, 100)
    counts = np.histogram(w.arrival_s, bins=edges)[0]
    # expected per window: the integral of the rate, from the closed form
    grid = np.linspace(0, 1000, 100_001)
    rate = spec.rate_at(grid)
    expected = [np.trapezoid(rate[(grid >= a) & (grid <= b)], grid[(grid >= a) & (grid <= b)])
                for a, b in zip(edges, edges[1:])]
    assert np.all(np.abs(counts - expected) < 5 * np.sqrt(expected))
    assert counts.argmax() in (4, 5) and counts[0] < counts[5] / 5  # peaks half way, trough first
    assert spec.rate_at(np.array([0.0, 500.0])).tolist() == pytest.approx([2, 20])


def test_steps_rate_at_reads_the_step_in_force():
    spec = StepsArrival.model_validate({"process": "steps", "steps": [
        {"at_s": 0, "rate_rps": 1}, {"at_s": 10, "rate_rps": 5}]})
    assert spec.rate_at(np.array([0.0, 9.9, 10.0, 1e6])).tolist() == [1, 1, 5, 5]


@pytest.mark.parametrize("arrival, message", [
    ({"process": "steps", "steps": [{"at_s": 5, "rate_rps": 1}]}, "first step must be at_s 0"),
    ({"process": "steps", "steps": [{"at_s": 0, "rate_rps": 1}, {"at_s": 0, "rate_rps": 2}]},
     "at_s must increase"),
    ({"process": "steps", "steps": [{"at_s": 0, "rate_rps": 1}, {"at_s": 9, "rate_rps": 0}]},
     "last step's rate_rps must be > 0"),
    ({"process": "steps", "steps": []}, "at least 1 item"),
    ({"process": "diurnal", "trough_rps": 5, "peak_rps": 2, "period_s": 10},
     "trough_rps \\(5\\) must be <= peak_rps \\(2\\)"),
    ({"process": "diurnal", "trough_rps": 1, "peak_rps": 2}, "period_s"),
    ({"process": "hourly"}, "allowed: .*diurnal.*steps"),
])
def test_bad_schedules_say_what_is_wrong(arrival, message):
    with pytest.raises(ValidationError, match=message):
        workload(arrival, 10)
