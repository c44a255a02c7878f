"""KV transfer throughput: the Mooncake backend's sender/receiver path against Mooncake's raw
`batch_transfer_sync_write` on the same buffers, page lists and sizes (TCP on loopback here).

    python benchmarks/transfer_bench.py [--repeats 5] [--layers 8]

Each case moves `pages` pages of a model with `layers` layers (one K and one V buffer per layer,
8 KV heads of 128 fp16 values per token) from prefill pages 0..n-1 to shuffled runs of decode
pages, so descriptors merge into runs of about 8 pages. "raw" issues the same descriptors in
batches of `max_batch` (Mooncake's TCP transport fails batches of more than ~2,000 descriptors);
"backend" times one request from `send(..., last=True)` to the receiver's `Success`, which adds
the metadata slot write, the worker hand-off and the ZMQ status message. Best of `repeats`.
Last, the head slices of a TP 2 -> 1 transfer: what one descriptor costs.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's glog chatter, before it loads

import numpy as np  # noqa: E402

from pdsim.core.kvpoll import KVPoll  # noqa: E402
from pdsim.core.request import Request  # noqa: E402
from pdsim.core.transfer import FirstTokenMetadata  # noqa: E402
from pdsim.deployment import TransferConfig  # noqa: E402
from runtime.calibration import profile_descriptors  # noqa: E402
from runtime.transfer.bootstrap_server import BootstrapServer  # noqa: E402
from runtime.transfer.mooncake_engine import MAX_BATCH, MooncakeEngine, mooncake_version  # noqa: E402
from runtime.transfer.layout import KVArgs, page_descriptors  # noqa: E402
from runtime.transfer.metadata import MetadataBuffer  # noqa: E402
from runtime.transfer.mooncake import MooncakeKVManager  # noqa: E402

HEADS, HEAD_DIM, ELEMENT_BYTES = 8, 128, 2
CASES = [(16, 64), (16, 512), (64, 32), (64, 256)]  # (page_size tokens, pages per request)


class Side:
    def __init__(self, layers: int, page_size: int, num_pages: int) -> None:
        item = page_size * HEADS * HEAD_DIM * ELEMENT_BYTES
        self.buffers = [np.zeros(num_pages * item, dtype=np.uint8) for _ in range(2 * layers)]
        self.metadata = MetadataBuffer.allocate(4)
        self.args = KVArgs(
            kv_data_ptrs=[b.ctypes.data for b in self.buffers],
            kv_data_lens=[b.nbytes for b in self.buffers], kv_item_lens=[item] * len(self.buffers),
            metadata_ptr=self.metadata.ptr, metadata_len=self.metadata.nbytes,
            metadata_item_len=self.metadata.item_len, page_size=page_size, kv_dtype="float16",
            total_kv_heads=HEADS, kv_heads_per_rank=HEADS, owners=(self.buffers, self.metadata))


def shuffled_runs(n: int, run: int, seed: int) -> list[int]:
    blocks = np.arange(n).reshape(-1, run) if n % run == 0 else np.arange(n).reshape(-1, 1)
    np.random.default_rng(seed).shuffle(blocks)
    return blocks.ravel().tolist()


def bench_raw(src: Side, dst: Side, src_pages, dst_pages, repeats: int, max_batch: int) -> float:
    a, b = MooncakeEngine(max_batch=max_batch), MooncakeEngine()
    for buf in src.buffers:
        a.register(buf.ctypes.data, buf.nbytes)
    for buf in dst.buffers:
        b.register(buf.ctypes.data, buf.nbytes)
    raw = a._engine  # the bare mooncake.engine.TransferEngine
    srcs, dsts, lens = page_descriptors(src.args.kv_data_ptrs, dst.args.kv_data_ptrs,
                                        src.args.kv_item_lens, src_pages, dst_pages)
    best = float("inf")
    for attempt in range(repeats + 1):  # the first connects the engines: not timed
        t0 = time.perf_counter()
        for i in range(0, len(srcs), max_batch):
            rc = raw.batch_transfer_sync_write(b.session_id, srcs[i:i + max_batch],
                                               dsts[i:i + max_batch], lens[i:i + max_batch])
            if rc != 0:
                raise RuntimeError(f"raw batch_transfer_sync_write returned {rc}")
        if attempt:
            best = min(best, time.perf_counter() - t0)
    a.unregister_all()
    b.unregister_all()
    return best


def bench_backend(src: Side, dst: Side, src_pages, dst_pages, repeats: int) -> float:
    config = TransferConfig(heartbeat_interval_s=0)
    server = BootstrapServer().start()
    prefill, decode = MooncakeKVManager(src.args, config), MooncakeKVManager(dst.args, config)
    prefill.register_with_bootstrap("127.0.0.1", server.port)
    best = float("inf")
    try:
        for room in range(repeats + 1):  # room 0 connects the engines: not timed
            req = Request(rid=str(room), input_len=1, max_new_tokens=1,
                          bootstrap_host="127.0.0.1", bootstrap_port=server.port,
                          bootstrap_room=room)
            sender, receiver = prefill.create_sender(req), decode.create_receiver(req)
            while receiver.poll() is KVPoll.Bootstrapping:
                time.sleep(0.0005)
            receiver.send_metadata(dst_pages, metadata_slot=0)
            while sender.poll() is KVPoll.Bootstrapping:
                time.sleep(0.0005)
            sender.init(len(src_pages), metadata_slot=0)
            prefill.metadata.write(0, FirstTokenMetadata(room, 1, 0.0, 0))
            t0 = time.perf_counter()
            sender.send(src_pages, last=True)
            while (state := receiver.poll()) not in (KVPoll.Success, KVPoll.Failed):
                time.sleep(0.0005)  # a busier poll steals the CPU the TCP threads need
            elapsed = time.perf_counter() - t0
            if state is KVPoll.Failed:
                raise RuntimeError(receiver.failure_reason())
            if room:
                best = min(best, elapsed)
            sender.close()
            receiver.close()
    finally:
        prefill.close()
        decode.close()
        server.stop()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-batch", type=int, default=MAX_BATCH)
    args = parser.parse_args()
    print(f"Mooncake {mooncake_version()}, TCP loopback, {args.layers} layers x K/V, "
          f"{HEADS} heads x {HEAD_DIM} fp16 per token, best of {args.repeats}")
    print(f"{'page':>5} {'pages':>6} {'MiB':>7} {'descr':>6} | {'raw GB/s':>9} {'pages/s':>9} | "
          f"{'backend GB/s':>12} {'pages/s':>9} | {'backend/raw':>11}")
    for page_size, pages in CASES:
        src = Side(args.layers, page_size, pages)
        dst = Side(args.layers, page_size, pages)
        for buf in src.buffers:
            buf[:] = np.random.default_rng(0).integers(0, 255, buf.size, dtype=np.uint8)
        src_pages, dst_pages = list(range(pages)), shuffled_runs(pages, 8, seed=pages)
        nbytes = sum(src.args.kv_item_lens) * pages
        n_descr = len(page_descriptors(src.args.kv_data_ptrs, dst.args.kv_data_ptrs,
                                       src.args.kv_item_lens, src_pages, dst_pages)[0])
        raw_s = bench_raw(src, dst, src_pages, dst_pages, args.repeats, args.max_batch)
        for buf in dst.buffers:
            buf[:] = 0
        backend_s = bench_backend(src, dst, src_pages, dst_pages, args.repeats)
        for s_buf, d_buf in zip(src.buffers, dst.buffers):  # the bytes really arrived
            item = src.args.kv_item_lens[0]
            assert np.array_equal(d_buf.reshape(pages, item)[dst_pages],
                                  s_buf.reshape(pages, item)[src_pages])
        print(f"{page_size:>5} {pages:>6} {nbytes / 2**20:>7.1f} {n_descr:>6} | "
              f"{nbytes / raw_s / 1e9:>9.2f} {pages / raw_s:>9.0f} | "
              f"{nbytes / backend_s / 1e9:>12.2f} {pages / backend_s:>9.0f} | "
              f"{raw_s / backend_s:>10.0%}")
        if (page_size, pages) == CASES[-1]:
            bench_descriptors(args.layers, page_size, nbytes / raw_s / 1e9, args.repeats)


def bench_descriptors(layers: int, page_size: int, gb_per_s: float, repeats: int) -> None:
    """The head-slice path of a TP mismatch: what one descriptor costs (`pdsim calibrate`'s
    probe, runtime/calibration.py)."""
    item = page_size * HEADS * HEAD_DIM * ELEMENT_BYTES
    fit = profile_descriptors([item] * (2 * layers), page_size, gb_per_s, repeats=repeats)
    print(f"head slices, {fit.senders} ranks into one at once, {page_size}-token pages: "
          + ", ".join(f"{d} descr {s * 1e3:.1f} ms" for d, s in fit.rows)
          + f" -> {fit.per_descriptor_s * 1e6:.1f} us per descriptor per GPU")


if __name__ == "__main__":
    main()
