"""Prefill and decode throughput of the real executor (`runtime.executor.ModelExecutor`).

For each model preset and batch size it times, through `ModelExecutor.execute` (the path the
server runs, sampling included):

- prefill: one extend batch of `batch` prompts of `--prompt-len` tokens -> prefill tokens/s;
- decode: `--steps` decode steps of `batch` requests after `--context-len` tokens -> tokens/s.

Each figure is the median over `--repeats` runs after one warm-up run. On CUDA the kernels run
with both backends (`PDSIM_KERNEL_BACKEND=torch` and `triton`); elsewhere with torch only.

    python benchmarks/executor_speed.py                  # tiny presets, batch 1, 4, 16
    python benchmarks/executor_speed.py --batch-sizes 1 8 --prompt-len 256
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from pdsim.core.batch import BatchShape, DecodeBatch, ExtendBatch, ExtendSegment, extend_attn_pairs
from pdsim.core.pages import num_pages
from pdsim.core.request import Request
from runtime.executor import ModelExecutor
from runtime.model import ModelConfig, build_model


def make_requests(batch: int, prompt_len: int, extra_tokens: int, page_size: int,
                  vocab: int) -> list[Request]:
    gen = torch.Generator().manual_seed(0)
    reqs, next_page = [], 0
    for i in range(batch):
        ids = torch.randint(0, min(vocab, 256), (prompt_len,), generator=gen).tolist()
        req = Request(f"b{i}", prompt_len, extra_tokens + 1, prompt_ids=ids)
        n = num_pages(prompt_len + extra_tokens + 1, page_size)
        req.pages = list(range(next_page, next_page + n))
        next_page += n
        reqs.append(req)
    return reqs


def prefill_batch(reqs: list[Request]) -> ExtendBatch:
    segs = [ExtendSegment(r, 0, r.input_len) for r in reqs]
    shape = BatchShape(prefill_tokens=sum(r.input_len for r in reqs),
                       prefill_attn_pairs=sum(extend_attn_pairs(r.input_len, 0) for r in reqs))
    return ExtendBatch(shape, 0.0, segs)


def time_prefill(executor: ModelExecutor, reqs: list[Request]) -> float:
    return executor.forward(prefill_batch(reqs)).duration_s


def time_decode(executor: ModelExecutor, reqs: list[Request], steps: int) -> float:
    """Seconds for `steps` decode steps (the prompts are prefilled first, untimed)."""
    result = executor.forward(prefill_batch(reqs))
    for req, tok in zip(reqs, result.token_ids):
        req.output_ids = [tok]
        req.kv_at_join, req.join_step = req.input_len, 0
    total = 0.0
    for step in range(1, steps + 1):
        context = sum(r.input_len + step - 1 for r in reqs)
        shape = BatchShape(decode_reqs=len(reqs), decode_context_tokens=context + len(reqs))
        res = executor.forward(DecodeBatch(shape, 0.0, reqs, step))
        for req, tok in zip(reqs, res.token_ids):
            req.output_ids.append(tok)
        total += res.duration_s
    return total


def run(preset: str, device: str, batch_sizes: list[int], prompt_len: int, context_len: int,
        steps: int, repeats: int) -> list[tuple]:
    cfg = ModelConfig.preset(preset)
    model = build_model(cfg, seed=0, device=device)
    page_size = 16
    biggest = max(batch_sizes)
    pages = biggest * num_pages(max(prompt_len, context_len) + steps + 2, page_size)
    executor = ModelExecutor(model, num_pages=pages, page_size=page_size)
    executor.warmup()
    rows = []
    for b in batch_sizes:
        pre, dec = [], []
        for i in range(repeats + 1):
            t_pre = time_prefill(executor, make_requests(b, prompt_len, steps, page_size,
                                                         cfg.vocab_size))
            t_dec = time_decode(executor, make_requests(b, context_len, steps, page_size,
                                                        cfg.vocab_size), steps)
            if i:  # the first run warms up this shape
                pre.append(t_pre)
                dec.append(t_dec)
        rows.append((preset, b, b * prompt_len / statistics.median(pre),
                     b * steps / statistics.median(dec), statistics.median(dec) / steps * 1e3))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", nargs="+", default=["tiny-llama", "tiny-mla"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--context-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    backends = ["torch", "triton"] if args.device.startswith("cuda") else ["torch"]
    print(f"device {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"prompt {args.prompt_len} tokens, decode after {args.context_len} tokens, "
          f"{args.steps} steps, median of {args.repeats}")
    print(f"{'backend':8} {'preset':11} {'batch':>5} {'prefill tok/s':>14} {'decode tok/s':>13} "
          f"{'decode step ms':>15}")
    for backend in backends:
        os.environ["PDSIM_KERNEL_BACKEND"] = backend
        for preset in args.presets:
            for name, b, pre, dec, step_ms in run(preset, args.device, args.batch_sizes,
                                                  args.prompt_len, args.context_len, args.steps,
                                                  args.repeats):
                print(f"{backend:8} {name:11} {b:5d} {pre:14,.0f} {dec:13,.0f} {step_ms:15.2f}")


if __name__ == "__main__":
    main()
