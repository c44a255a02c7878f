"""Prefill and decode workers for disaggregated serving (docs/serving.md).

- `kv`: the poll snapshot every rank of an instance agrees on (`SnapshotKV`).
- `engine`: `PDEngine`, the serving engine over a prefill or decode scheduler, in lock step
  across tensor-parallel ranks.
- `http`: the worker HTTP API (`WorkerServer`), which the router talks to.
- `worker`: building a rank and running an instance (rank processes, bootstrap server).

runtime/launcher.py starts whole deployments (`pdsim serve` with a disaggregated config).
"""
