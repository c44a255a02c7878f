"""The PD router: the OpenAI-compatible front of a disaggregated deployment.

For each request it picks a (prefill, decode) pair with the core's router policies, draws a
bootstrap room, and posts the same request to both workers (their API: docs/serving.md). The
prefill worker answers once its side is done; the decode worker streams every token, the
first one (computed by prefill, delivered in the KV metadata) included. The router relays the
decode stream to the client and passes errors through with their status: a request a prefill
worker refuses before any token (too long for its pool, say) gets that worker's 4xx.

It reuses `OpenAIServer` for parsing, validation and the OpenAI wire format; only the
`Backend` differs: `PDClient` here instead of a local `Engine`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from pdsim.core.records import RequestRecord
from pdsim.core.router import Router
from runtime.engine import EngineStopped, Sink, StreamEvent, deliver
from runtime.sampling import SamplingParams
from runtime.serve_metrics import ServeMetrics
from runtime.server import ChatTemplate, Limits, OpenAIServer
from runtime.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerAddress:
    """A worker's HTTP API; prefill workers also name their bootstrap server."""

    url: str
    bootstrap_host: str = ""
    bootstrap_port: int = 0


class WorkerError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class PDClient:
    """The router's `Backend`: each request becomes a task that talks to two workers."""

    def __init__(self, prefill: Sequence[WorkerAddress], decode: Sequence[WorkerAddress], *,
                 policy: str = "round_robin", seed: int = 0, max_records: int = 100_000,
                 connect_timeout_s: float = 10.0) -> None:
        if not prefill or not decode:
            raise ValueError(f"a PD router needs prefill and decode workers, got {len(prefill)} "
                             f"prefill and {len(decode)} decode")
        for w in prefill:
            if not w.bootstrap_host or not w.bootstrap_port:
                raise ValueError(f"prefill worker {w.url} names no bootstrap host and port")
        self.prefill = list(prefill)
        self.decode = list(decode)
        # Rooms from the OS: routers sharing workers must not draw the same ones.
        self.router = Router(policy, len(prefill), len(decode), seed, room_rng=random.SystemRandom())
        self.metrics = ServeMetrics()
        self.records: deque[RequestRecord] = deque(maxlen=max_records)
        self._inflight_prefill = [0] * len(prefill)  # the policies' load signal
        self._inflight_decode = [0] * len(decode)
        self._tasks: dict[str, asyncio.Task] = {}
        self._session: aiohttp.ClientSession | None = None
        self._connect_timeout_s = connect_timeout_s
        self._t0 = time.monotonic()

    # ---- Backend ----------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._session is not None and not self._session.closed

    def start(self) -> PDClient:
        """Call on the event loop the router serves from."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout_s)
        connector = aiohttp.TCPConnector(limit=0)  # one stream per request; no pool cap
        self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)
        self._t0 = time.monotonic()
        return self

    async def shutdown(self) -> None:
        """Fail the requests in flight ("server shutting down") and close the connections."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel("server shutting down")
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    def submit(self, prompt_ids: Sequence[int], max_new_tokens: int, sink: Sink, *,
               sampling: SamplingParams | None = None, stop_token_ids: Sequence[int] = (),
               top_logprobs: int = 0, rid: str | None = None) -> str:
        if not self.running:
            raise EngineStopped("the router is not running")
        rid = rid or uuid.uuid4().hex
        sampling = sampling or SamplingParams()
        body = {
            "rid": rid,
            "input_ids": list(prompt_ids),
            "max_new_tokens": max_new_tokens,
            "sampling": {"temperature": sampling.temperature, "top_p": sampling.top_p,
                         "top_k": sampling.top_k, "seed": sampling.seed},
            "stop_token_ids": list(stop_token_ids),
            "top_logprobs": top_logprobs,
        }
        task = asyncio.get_running_loop().create_task(self._serve(body, sink))
        self._tasks[rid] = task
        task.add_done_callback(lambda _t: self._tasks.pop(rid, None))
        return rid

    def abort(self, rid: str, reason: str = "aborted by the client") -> None:
        task = self._tasks.get(rid)
        if task is not None:
            task.cancel(reason)

    # ---- one request ------------------------------------------------------------------------

    async def _serve(self, body: dict, sink: Sink) -> None:
        p, d, room = self.router.route(self._inflight_prefill.__getitem__,
                                       self._inflight_decode.__getitem__)
        pre, dec = self.prefill[p], self.decode[d]
        body = {**body, "bootstrap_host": pre.bootstrap_host,
                "bootstrap_port": pre.bootstrap_port, "bootstrap_room": room}
        record = RequestRecord(rid=body["rid"], input_tokens=len(body["input_ids"]),
                               output_tokens=0, status="failed", prefill_instance=p,
                               decode_instance=d, arrival_s=self.now())
        self._inflight_prefill[p] += 1
        self._inflight_decode[d] += 1
        prefill_call = asyncio.create_task(self._prefill(pre, body))
        try:
            await self._relay(dec, body, prefill_call, sink, record)
        except asyncio.CancelledError as exc:
            reason = str(exc.args[0]) if exc.args else "aborted"
            record.error = reason
            await self._abort_both(pre, dec, body["rid"], reason)
            deliver(sink, StreamEvent(finished=True, error=reason, status=503))
            raise
        except WorkerError as exc:
            record.error = exc.message
            await self._abort_both(pre, dec, body["rid"], exc.message)
            deliver(sink, StreamEvent(finished=True, error=exc.message, status=exc.status))
        finally:
            if not prefill_call.done():
                prefill_call.cancel()
            await asyncio.gather(prefill_call, return_exceptions=True)
            self._inflight_prefill[p] -= 1
            self._inflight_decode[d] -= 1
            record.finish_s = self.now()
            if record.token_times_s:
                record.first_token_s = record.token_times_s[0]
            self.records.append(record)
            self.metrics.observe_request(record)

    async def _prefill(self, worker: WorkerAddress, body: dict) -> None:
        async with self._session.post(f"{worker.url}/generate", json=body) as resp:
            if resp.status != 200:
                raise WorkerError(resp.status, await _error_message(resp, worker))

    async def _relay(self, worker: WorkerAddress, body: dict, prefill_call: asyncio.Task,
                     sink: Sink, record: RequestRecord) -> None:
        """Stream the decode worker's events to `sink`. Until the first token arrives a prefill
        failure wins: its status is the client's."""
        try:
            resp = await self._session.post(f"{worker.url}/generate", json=body)
        except aiohttp.ClientError as exc:
            raise WorkerError(502, f"decode worker {worker.url} unreachable: {exc}") from None
        async with resp:
            if resp.status != 200:
                raise WorkerError(resp.status, await _error_message(resp, worker))
            events = _sse_events(resp)
            first = asyncio.ensure_future(anext(events, None))
            done, _ = await asyncio.wait({first, prefill_call},
                                         return_when=asyncio.FIRST_COMPLETED)
            if prefill_call in done and prefill_call.exception() is not None and first not in done:
                first.cancel()
                raise prefill_call.exception()
            event = await first
            while event is not None:
                now = self.now()
                record.token_times_s.extend([now] * len(event.token_ids))
                record.output_tokens += len(event.token_ids)
                if event.finished:
                    record.status = "failed" if event.error else "ok"
                    record.error = event.error or ""
                    deliver(sink, event)
                    return
                deliver(sink, event)
                event = await anext(events, None)
            raise WorkerError(502, f"decode worker {worker.url} closed the stream early")

    async def _abort_both(self, pre: WorkerAddress, dec: WorkerAddress, rid: str,
                          reason: str) -> None:
        payload = {"rid": rid, "reason": reason}
        for worker in (pre, dec):
            try:
                async with self._session.post(f"{worker.url}/abort", json=payload,
                                              timeout=aiohttp.ClientTimeout(total=5)):
                    pass
            except (aiohttp.ClientError, asyncio.TimeoutError):
                log.info("abort of %s at %s not delivered", rid, worker.url)

    def now(self) -> float:
        """Seconds since `start()` (the router's records' time base)."""
        return time.monotonic() - self._t0


class PDRouter:
    """The router server: `port = await router.start(host, port)`, then `await router.close()`."""

    def __init__(self, prefill: Sequence[WorkerAddress], decode: Sequence[WorkerAddress], *,
                 tokenizer: Tokenizer, model_name: str, limits: Limits, policy: str = "round_robin",
                 seed: int = 0, chat_template: ChatTemplate | None = None,
                 eos_ids: Sequence[int] = (), default_chat_max_tokens: int = 256) -> None:
        self.client = PDClient(prefill, decode, policy=policy, seed=seed)
        self.server = OpenAIServer(self.client, tokenizer, model_name=model_name, limits=limits,
                                   chat_template=chat_template, eos_ids=eos_ids,
                                   default_chat_max_tokens=default_chat_max_tokens)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        return await self.server.start(host, port)

    async def close(self) -> None:
        await self.server.close()

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def records(self) -> deque[RequestRecord]:
        return self.client.records


# ---- the workers' wire format -------------------------------------------------------------


async def sse_data(resp: aiohttp.ClientResponse):
    """The JSON objects of a worker's SSE stream (`data: {...}` lines), until `data: [DONE]`.
    A stream that ends without `[DONE]` simply stops: the caller decides what that means."""
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


async def _sse_events(resp: aiohttp.ClientResponse):
    async for obj in sse_data(resp):
        yield _event(obj)


def _event(obj: dict) -> StreamEvent:
    return StreamEvent(
        token_ids=tuple(obj.get("token_ids", ())),
        logprobs=tuple(obj.get("logprobs", ())),
        top_logprobs=tuple(tuple((int(i), float(v)) for i, v in top)
                           for top in obj.get("top_logprobs", ())),
        finished=bool(obj.get("finished", False)),
        finish_reason=obj.get("finish_reason"),
        error=obj.get("error"),
        prompt_tokens=int(obj.get("prompt_tokens", 0)),
        completion_tokens=int(obj.get("completion_tokens", 0)),
    )


async def _error_message(resp: aiohttp.ClientResponse, worker: WorkerAddress) -> str:
    try:
        body = await resp.json(content_type=None)
        message = body["error"]["message"]
    except (ValueError, KeyError, TypeError, aiohttp.ClientError):
        message = (await resp.text())[:200] or resp.reason or "no reason given"
    return f"{worker.url}: {message}"

