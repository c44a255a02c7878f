"""Check the Triton kernels against the torch references at realistic shapes; time them.

    python benchmarks/kernel_bench_gpu.py [--quick] [--dtype bfloat16]

Needs a CUDA GPU (without one it says so and exits 0). For every shape it prints the largest
difference from the torch reference and, for the paged decode kernels, the achieved memory
bandwidth: bytes of KV read (plus query and output) divided by the kernel time. Pages are
shuffled, so the kernels read them scattered as in serving.
"""

from __future__ import annotations

import argparse
import sys

import torch

GQA_SHAPES = [  # (name, query heads, kv heads, head dim) per TP rank
    ("llama3-8b", 32, 8, 128),
    ("qwen2.5-7b", 28, 4, 128),
]
MLA_SHAPES = [  # (name, query heads, kv_lora_rank, rope dim)
    ("deepseek-v3/tp8", 16, 512, 64),
    ("deepseek-v3/tp4", 32, 512, 64),
]
BATCH_CONTEXTS = [(1, 4096), (1, 32768), (16, 2048), (64, 4096), (256, 1024)]
QUICK_BATCH_CONTEXTS = [(1, 4096), (64, 2048)]
PAGE_SIZES = [1, 16, 64]
DEVICE = "cuda"


def paged(num_reqs: int, context: int, page_size: int, heads: int, dim: int, dtype: torch.dtype,
          gen: torch.Generator, buffers: int):
    pages_per_req = -(-context // page_size)
    num_pages = num_reqs * pages_per_req
    order = torch.randperm(num_pages, generator=gen).to(DEVICE)
    table = order.view(num_reqs, pages_per_req)
    bufs = [torch.randn(num_pages, page_size, heads, dim, device=DEVICE, dtype=dtype)
            for _ in range(buffers)]
    lens = torch.full((num_reqs,), context, dtype=torch.int32, device=DEVICE)
    # Ragged: every other request gets a shorter context.
    lens[1::2] = max(1, context // 3)
    return bufs, table, lens


def bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=50) * 1e-3  # seconds


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def run(dtype: torch.dtype, quick: bool, tol: float) -> bool:
    from runtime.kernels import reference, triton_kernels

    gen = torch.Generator().manual_seed(0)
    ok = True
    elem = torch.finfo(dtype).bits // 8
    contexts = QUICK_BATCH_CONTEXTS if quick else BATCH_CONTEXTS
    print(f"device: {torch.cuda.get_device_name() if DEVICE == 'cuda' else DEVICE}  dtype: {dtype}")
    print(f"{'kernel':<28}{'page':>5}{'batch':>6}{'ctx':>7}{'max|diff|':>11}{'us':>9}{'GB/s':>9}")

    for name, heads, kv_heads, dim in GQA_SHAPES[:1] if quick else GQA_SHAPES:
        for page_size in PAGE_SIZES:
            for num_reqs, context in contexts:
                (k, v), table, lens = paged(num_reqs, context, page_size, kv_heads, dim, dtype,
                                            gen, buffers=2)
                q = torch.randn(num_reqs, heads, dim, device=DEVICE, dtype=dtype)
                scale = dim ** -0.5

                def triton_fn():
                    return triton_kernels.decode_attention_gqa(q, k, v, table, lens, scale,
                                                               max_context_len=context)

                diff = max_diff(triton_fn(), reference.decode_attention_gqa(
                    q, k, v, table, lens, scale, context))
                seconds = bench(triton_fn)
                read = int(lens.sum()) * kv_heads * dim * 2 * elem + 2 * q.numel() * elem
                ok &= diff <= tol
                print(f"{'gqa ' + name:<28}{page_size:>5}{num_reqs:>6}{context:>7}{diff:>11.2e}"
                      f"{seconds * 1e6:>9.1f}{read / seconds / 1e9:>9.0f}")
                del k, v

    for name, heads, lora, rope in MLA_SHAPES[:1] if quick else MLA_SHAPES:
        for page_size in PAGE_SIZES:
            for num_reqs, context in contexts:
                (latent,), table, lens = paged(num_reqs, context, page_size, 1, lora + rope,
                                               dtype, gen, buffers=1)
                q = torch.randn(num_reqs, heads, lora + rope, device=DEVICE, dtype=dtype)
                scale = 192 ** -0.5

                def triton_fn():
                    return triton_kernels.decode_attention_mla(q, latent, table, lens, lora, scale,
                                                               max_context_len=context)

                diff = max_diff(triton_fn(), reference.decode_attention_mla(
                    q, latent, table, lens, lora, scale, context))
                seconds = bench(triton_fn)
                read = (int(lens.sum()) * (lora + rope) * elem
                        + num_reqs * heads * (2 * lora + rope) * elem)
                ok &= diff <= tol
                print(f"{'mla ' + name:<28}{page_size:>5}{num_reqs:>6}{context:>7}{diff:>11.2e}"
                      f"{seconds * 1e6:>9.1f}{read / seconds / 1e9:>9.0f}")
                del latent

    for tokens, heads, dim in [(1, 8, 128), (256, 8, 128), (8192, 8, 128), (8192, 1, 576)]:
        buffer = torch.zeros(tokens + 1024, 1, heads, dim, device=DEVICE, dtype=dtype)
        new = torch.randn(tokens, heads, dim, device=DEVICE, dtype=dtype)
        slots = torch.randperm(buffer.shape[0], generator=gen)[:tokens].to(DEVICE)
        expected = buffer.clone()
        reference.store_kv(expected, new, slots)
        triton_kernels.store_kv(buffer, new, slots)
        diff = max_diff(buffer, expected)
        seconds = bench(lambda: triton_kernels.store_kv(buffer, new, slots))
        moved = 2 * new.numel() * elem
        ok &= diff == 0
        print(f"{f'store_kv {heads}x{dim}':<28}{1:>5}{tokens:>6}{'-':>7}{diff:>11.2e}"
              f"{seconds * 1e6:>9.1f}{moved / seconds / 1e9:>9.0f}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernel_bench_gpu.py needs a CUDA GPU; none is available here, nothing to do.")
        return 0
    dtype = getattr(torch, args.dtype)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    ok = run(dtype, args.quick, tol)
    print("all kernels match the torch reference" if ok else
          f"MISMATCH: some kernel differs from the reference by more than {tol}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
