"""A cost model fitted to measured forwards: the simulator calibrated on the real backend.

The real executor records every forward as its `BatchShape` fields and wall time
(`ModelExecutor.save_timings`, or a served config's `timings_path`). Here a step costs

    t = base[kind] + a·prefill_tokens + b·prefill_attn_pairs + c·decode_reqs + d·decode_context_tokens

with one fixed cost per kind ("extend": a batch with prefill tokens; "decode") and the four
slopes shared, fitted by least squares with every coefficient kept ≥ 0. With attention DP the
step takes the slowest rank, as in the roofline model. Around the forward a real engine step
spends host time the forwards table does not hold; `pdsim calibrate` measures it per role:

- `step_overhead_s` per step (scheduling, the loop's own work);
- `token_overhead_s` per request a decode step gives a token to (streaming it out: encoding
  the event, handing it to the HTTP loop, writing it), so it grows with the batch.

`roles` sets any of `timings`, `step_overhead_s` and `token_overhead_s` for one role (prefill,
decode, colocated) over the shared values: a PD prefill rank runs at its own tp and streams
nothing, its decode peer streams every token.

    cost_model: {name: profiled, params: {timings: results/real_colocated/forward_timings.csv}}
    cost_model: {name: profiled, params: {timings: decode.csv, token_overhead_s: 0.0004,
                 roles: {prefill: {timings: prefill_tp2.csv, token_overhead_s: 0}}}}
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pdsim.core.batch import BatchShape
from pdsim.sim.cost import Parallelism, register_cost_model
from pdsim.specs.hardware import HardwareSpec
from pdsim.specs.models import ModelSpec

if TYPE_CHECKING:  # pandas loads when a profiled model is built, not with every simulation
    import pandas as pd

FEATURES = ("prefill_tokens", "prefill_attn_pairs", "decode_reqs", "decode_context_tokens")
ROLE_PARAMS = ("timings", "step_overhead_s", "token_overhead_s")
MIN_FORWARDS = 8


def fit_linear_costs(timings: pd.DataFrame) -> tuple[float, float, np.ndarray]:
    """(extend base s, decode base s, the four slopes) from measured forwards, all ≥ 0."""
    missing = [c for c in ("kind", "duration_s", *FEATURES) if c not in timings.columns]
    if missing:
        raise ValueError(f"timings lack the columns {missing}; expected an executor timings table")
    if len(timings) < MIN_FORWARDS:
        raise ValueError(f"{len(timings)} measured forwards; at least {MIN_FORWARDS} are needed")
    extend = (timings["prefill_tokens"] > 0).to_numpy(float)
    x = np.column_stack([extend, 1.0 - extend, timings[list(FEATURES)].to_numpy(float)])
    y = timings["duration_s"].to_numpy(float)
    scale = np.maximum(np.abs(x).max(axis=0), 1e-12)  # columns differ by orders of magnitude
    coef = _nonnegative_lstsq(x / scale, y) / scale
    return float(coef[0]), float(coef[1]), coef[2:]


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients ≥ 0: drop the most negative one and refit until none is
    (a few columns only, so this active-set loop is exact enough and cheap)."""
    active = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1])
        if active:
            coef[active] = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
        worst = min(active, key=lambda i: coef[i], default=None)
        if worst is None or coef[worst] >= 0:
            return coef
        active.remove(worst)


@register_cost_model("profiled")
class ProfiledCostModel:
    """Step times interpolated from the real backend's measured forwards (module docstring)."""

    def __init__(self, model: ModelSpec, hardware: HardwareSpec, parallel: Parallelism, *,
                 timings: str | Path | pd.DataFrame, kv_dtype_bytes: float = 2,
                 role: str = "colocated", step_overhead_s: float = 0.0,
                 token_overhead_s: float = 0.0, roles: dict | None = None,
                 expert_imbalance: bool = True, seed: int = 0,
                 eplb_redundant_experts: int | None = None) -> None:
        # kv_dtype_bytes, role and (under expert parallelism) expert_imbalance and seed are
        # accepted as every cost model's are; the measured forwards already carry their effect
        # (the real model's own routing). The real backend has no EPLB to have measured.
        if eplb_redundant_experts is not None:
            raise ValueError("eplb: the profiled forwards were measured without EPLB (the real "
                             "backend has none); remove eplb or use the roofline cost model")
        own = _role_params(roles, role)
        timings = own.get("timings", timings)
        step_overhead_s = own.get("step_overhead_s", step_overhead_s)
        token_overhead_s = own.get("token_overhead_s", token_overhead_s)
        frame = timings if not isinstance(timings, (str, Path)) else _read(Path(timings))
        self.extend_base_s, self.decode_base_s, slopes = fit_linear_costs(frame)
        self._a, self._b, self._c, self._d = (float(v) for v in slopes)
        for name, value in (("step_overhead_s", step_overhead_s),
                            ("token_overhead_s", token_overhead_s)):
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name}={value!r}; must be a number of seconds >= 0")
        self.extend_base_s += step_overhead_s
        self.decode_base_s += step_overhead_s
        self._c += token_overhead_s

    def step_time_s(self, shapes: Sequence[BatchShape]) -> float:
        worst = 0.0
        for s in shapes:
            if s.prefill_tokens == 0 and s.decode_reqs == 0:
                continue
            base = self.extend_base_s if s.prefill_tokens else self.decode_base_s
            t = (base + self._a * s.prefill_tokens + self._b * s.prefill_attn_pairs
                 + self._c * s.decode_reqs + self._d * s.decode_context_tokens)
            worst = t if t > worst else worst
        return worst


def _role_params(roles: dict | None, role: str) -> dict:
    """`roles[role]`, checked: a mapping of ROLE_PARAMS (empty when the role has none)."""
    if roles is None:
        return {}
    if not isinstance(roles, dict):
        raise ValueError(f"roles={roles!r}; expected a mapping of role -> parameters")
    unknown_roles = sorted(set(roles) - {"prefill", "decode", "colocated"})
    if unknown_roles:
        raise ValueError(f"roles: unknown role(s) {unknown_roles}; allowed: prefill, decode, "
                         "colocated")
    own = roles.get(role) or {}
    unknown = sorted(set(own) - set(ROLE_PARAMS))
    if unknown:
        raise ValueError(f"roles.{role}: unknown parameter(s) {unknown}; allowed: "
                         f"{', '.join(ROLE_PARAMS)}")
    return own


def _read(path: Path) -> "pd.DataFrame":
    import pandas as pd

    if not path.is_file():
        raise ValueError(f"no timings file at {path} (an executor's save_timings output)")
    return pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path)
