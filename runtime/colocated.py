"""The colocated server: one process that loads the model, builds its executor and the `Engine`,
and serves them behind the OpenAI front (runtime/openai/server.py).

The engine runs on its own thread; the server on an asyncio loop. `serve(config)` runs one until
SIGINT/SIGTERM (the CLI); `BackgroundServer(config)` runs one on a thread (tests, notebooks,
benchmarks). Everything that needs torch for the colocated backend is assembled here, so the
OpenAI front and the PD router import none of it.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable

import torch

from runtime.driver import Engine, merged_gauges
from runtime.executor import ModelExecutor, warmup_shape
from runtime.model.draft import build_draft
from runtime.model.hybrid import with_state_slots
from runtime.model.loading import load_served_model, load_text_side, resolve_device
from runtime.openai.protocol import Limits
from runtime.openai.server import OpenAIServer
from runtime.security import api_key
from runtime.serve_config import ServeConfig
from runtime.speculative import with_draft_slots


def build_server(config: ServeConfig) -> OpenAIServer:
    """Load the model and tokenizer, size the KV cache, build the engine and the server (none
    started yet)."""
    model = load_served_model(config, resolve_device(config.device))
    mcfg = model.config
    text = load_text_side(config, mcfg.vocab_size)
    tokenizer, template, eos_ids = text.tokenizer, text.chat_template, text.eos_ids
    sched_cfg = with_state_slots(config.scheduler_config(), mcfg)
    if config.speculative.method == "mtp":
        sched_cfg = with_draft_slots(sched_cfg)
    executor = ModelExecutor(model, num_pages=config.num_pages, page_size=config.page_size,
                             seed=config.seed, vocab_limit=text.vocab_limit(mcfg.vocab_size),
                             state_slots=sched_cfg.state_slots,
                             threads=config.forward_threads("colocated"),
                             warmup=warmup_shape(sched_cfg))
    gauges = merged_gauges
    if config.speculative.method == "mtp":
        executor.speculate(build_draft(model, seed=config.seed),
                           config.speculative.num_draft_tokens)
        gauges = _with_acceptance(executor.speculation.stats)
    engine = Engine(executor, sched_cfg, gauges=gauges, max_records=config.max_records)
    limits = Limits(max_model_len=min(sched_cfg.pool_tokens, mcfg.max_position),
                    pool_tokens=sched_cfg.pool_tokens, max_position=mcfg.max_position,
                    model_vocab=mcfg.vocab_size)

    def save_results() -> None:
        if config.records_path:
            engine.save_records(config.records_path)
        if config.timings_path:
            executor.save_timings(config.timings_path)

    return OpenAIServer(engine, tokenizer, model_name=config.model_name, limits=limits,
                        chat_template=template, eos_ids=eos_ids,
                        default_chat_max_tokens=config.default_max_tokens,
                        max_inflight_requests=config.max_inflight_requests, on_close=save_results)


def serve(config: ServeConfig, on_ready: Callable[[OpenAIServer], None] | None = None) -> None:
    """Run a server until SIGINT or SIGTERM, then shut down cleanly. The process's own threads
    keep one torch thread; the engine's takes the forwards' (`ModelExecutor.bind_thread`)."""
    torch.set_num_threads(1)

    async def main() -> None:
        server = build_server(config)
        server.protect(api_key=api_key(config.security.api_key), limits=config.security.limits)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await server.start(config.host, config.port)
        try:
            if on_ready is not None:
                on_ready(server)
            await stop.wait()
        finally:
            await server.close()

    asyncio.run(main())


class BackgroundServer:
    """A server on its own thread and event loop: `with BackgroundServer(cfg) as s: s.url`."""

    def __init__(self, config: ServeConfig | OpenAIServer, host: str | None = None,
                 port: int | None = None) -> None:
        if isinstance(config, OpenAIServer):
            self.server, self._host, self._port = config, host or "127.0.0.1", port or 0
        else:
            self.server = build_server(config)
            self._host = host or config.host
            self._port = config.port if port is None else port
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="pdsim-http",
                                        daemon=True)

    def start(self) -> BackgroundServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(self._host, self._port),
                                         self.loop).result(60)
        return self

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def engine(self) -> Engine:
        return self.server.engine


def _with_acceptance(stats):
    """The engine's gauges plus the speculative acceptance (tokens per verify step)."""

    def gauges(scheds):
        return {**merged_gauges(scheds), "sglang:spec_accept_length": stats.mean_accept_len}

    return gauges
