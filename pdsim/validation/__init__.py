"""Sim-vs-real validation: one deployment YAML run for real and simulated on the same workload,
compared side by side (docs/validation.md).

- `deployment`: start and stop `pdsim serve CONFIG` as a child process.
- `replay`: an async streaming client that sends the workload's exact arrival times and lengths
  to an endpoint (`pdsim serve`, SGLang, vLLM, ...) and records every token's arrival time, as
  `RequestRecord`s; `prompts` builds prompts of exact token lengths (ids, or text with the
  model's tokenizer.json); `lengths` checks the endpoint's reported counts.
- `measured`: per-request results a benchmark client wrote (SGLang bench_serving, aiperf, CSV)
  read as `RequestRecord`s; `timing` turns chunk arrival times into token times.
- `compare`: the side-by-side table (mean, P50, P90, P99 of TTFT, ITL, E2E; throughput;
  goodput), the tolerance check and the plots; `phases`: where TTFT goes.
- `validate`: the `pdsim validate` and `pdsim compare` commands (one comparison core).
- `fit`: `pdsim calibrate --measured`, a decode step and a per-request cost fitted to a file.
"""
