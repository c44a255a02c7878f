"""Prefill and decode workers for disaggregated serving (docs/serving.md).

- `kv`: the poll snapshot every rank of an instance agrees on (`SnapshotKV`).
- `lockstep_engine`: `PDEngine`, the serving engine over a prefill or decode scheduler, in lock
  step across tensor-parallel ranks (the typed step it broadcasts: runtime/protocol/step.py).
- `http`: the worker HTTP API (`WorkerServer`), which the router talks to (its versioned
  `/generate` body and stream events: runtime/protocol/worker.py, stream.py).
- `worker`: building a rank and running an instance (rank processes, bootstrap server).

Nothing here imports the OpenAI front (runtime/openai/). runtime/launcher.py starts whole
deployments (`pdsim serve` with a disaggregated config).
"""
