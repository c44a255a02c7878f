"""Sim-vs-real validation: one deployment YAML served for real and simulated on the same
workload, compared side by side (docs/validation.md).

- `deployment`: start and stop `pdsim serve CONFIG` as a child process.
- `replay`: an async streaming client that sends the workload's exact arrival times and lengths
  and records every token's arrival time, as `RequestRecord`s.
- `compare`: the side-by-side table (mean, P50, P90, P99 of TTFT, ITL, E2E; throughput;
  goodput), the tolerance check and the plots.
- `validate`: the whole `pdsim validate` command.
"""
