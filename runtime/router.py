"""The PD router: the OpenAI-compatible front of a disaggregated deployment.

For each request it picks a (prefill, decode) pair with the core's router policies, draws a
bootstrap room, and posts the same request to both workers (their API: docs/serving.md). The
prefill worker answers once its side is done; the decode worker streams every token, the
first one (computed by prefill, delivered in the KV metadata) included. The router relays the
decode stream to the client and passes errors through with their status: a request a prefill
worker refuses before any token (too long for its pool, say) gets that worker's 4xx.

Every client gets an end: a worker that cannot be reached or drops the connection (killed,
restarting: 503), that stalls (`read_timeout_s` of silence) or breaks the protocol (502) ends the
stream with an error event and `data: [DONE]` like any other failure. A request that fails with
503 before any token reached its client (a worker down or restarting, a transfer peer lost) is
sent once more, as a new request (a fresh pair and room); a second 503 is the client's, with
Retry-After. `GET /health` probes the workers (503 naming those that do not answer, and those
that refuse this router's cluster token); more than `max_inflight_requests` at once get 503
with Retry-After.

Workers join and leave while it serves (`/workers`, runtime/router_control.py): a worker being
removed gets no new requests and leaves once its calls in flight are done.

It reuses `OpenAIServer` for parsing, validation and the OpenAI wire format; only the
`Backend` differs: `PDClient` here instead of a local `Engine`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from pdsim.core.radix import token_page_keys
from pdsim.core.records import RequestRecord
from pdsim.core.router import Router
from runtime.chat_template import ChatTemplate
from runtime.openai.protocol import Limits
from runtime.openai.server import OpenAIServer
from runtime.protocol.codec import ProtocolError
from runtime.protocol.stream import StreamEvent, from_sse_data
from runtime.protocol.worker import MAX_RID_CHARS, GenerateParams
from runtime.router_control import MembershipError, WorkerRoutes, internal_guard
from runtime.sampling import SamplingParams
from runtime.security import ClusterKey, redact_addresses
from runtime.serve_metrics import ServeMetrics
from runtime.streams import EngineStopped, Sink, deliver
from runtime.tokenizer import Tokenizer

if TYPE_CHECKING:
    from pdsim.deployment import Deployment, HttpLimits

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerAddress:
    """A worker's HTTP API; prefill workers also name their bootstrap server."""

    url: str
    bootstrap_host: str = ""
    bootstrap_port: int = 0
    name: str = ""  # what clients are told: "decode worker 1", never the URL (PDClient sets it)


@dataclass(eq=False)
class Member:
    """A worker the router knows. `load` is the policies' signal (what the core schedulers'
    load() counts in the simulator): for a prefill worker the prompt tokens sent whose prefill
    call has not returned (its KV not yet computed and sent), for a decode worker the requests
    in flight. `calls`: the calls to it in flight (prefill calls, decode streams); a draining
    worker gets no new ones and leaves once they are 0."""

    role: str
    index: int  # among the workers of its role ever added: its name's number
    address: WorkerAddress
    load: int = 0
    calls: int = 0
    draining: bool = False
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def name(self) -> str:
        return self.address.name

    def sent(self, load: int) -> None:
        self.load += load
        self.calls += 1
        self.idle.clear()

    def returned(self, load: int) -> None:
        self.load -= load
        self.calls -= 1
        if not self.calls:
            self.idle.set()

    def describe(self) -> dict:
        return {"name": self.name, "role": self.role, "url": self.address.url,
                "state": "draining" if self.draining else "serving", "requests": self.calls}


class WorkerError(Exception):
    """A worker refused a request (its status and the field it named), or failed it: 502, or
    503 when it cannot be reached or drops the connection (killed, restarting)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


@contextlib.asynccontextmanager
async def _calling(worker: WorkerAddress):
    """Turn whatever goes wrong talking to a worker into a `WorkerError` naming it by role and
    index (the log has its URL and the details)."""
    try:
        yield
    except aiohttp.ClientConnectorError as exc:
        log.warning("%s (%s) is unreachable: %s", worker.name, worker.url, exc)
        raise WorkerError(503, f"{worker.name} is unreachable") from None
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
            aiohttp.ClientPayloadError) as exc:
        # its process went away under the request (killed, restarting; a stream cut mid-body
        # is a payload error): try again later
        log.warning("%s (%s) dropped the connection: %s", worker.name, worker.url, exc)
        raise WorkerError(503, f"{worker.name} dropped the connection (restarting or "
                               "gone)") from None
    except ProtocolError as exc:  # what the worker sent, named (it holds no address)
        log.warning("%s (%s) broke the protocol: %s", worker.name, worker.url, exc)
        raise WorkerError(502, f"{worker.name} failed: {redact_addresses(str(exc))}") from None
    except (aiohttp.ClientError, OSError, ValueError, TypeError, AttributeError) as exc:
        # a reset or cut stream, a read timeout (TimeoutError is an OSError), bad JSON
        log.warning("%s (%s) failed: %s: %s", worker.name, worker.url, type(exc).__name__, exc)
        raise WorkerError(502, f"{worker.name} failed: {type(exc).__name__}") from None


class PDClient:
    """The router's `Backend`: each request becomes a task that talks to two workers.

    Workers join (`add_worker`) and leave (`remove_worker`: drained first) while it serves;
    each keeps the name it got ("decode worker 2": its index among those of its role ever
    added), which its records' instance fields carry too.

    `config` is the deployment: its `router` section (policy, policy_options, read_timeout_s:
    the most a worker may stay silent), `seed` (the policy's), `max_records` and `page_size`
    (the prefill workers' KV pages: the policy gets each prompt's page keys,
    `token_page_keys`, which `cache_aware` routes by). connect_timeout_s: connecting to a
    worker; health_timeout_s / health_ttl_s: the workers' `/health` probes, and how long one
    round of answers is reused.
    """

    def __init__(self, prefill: Sequence[WorkerAddress], decode: Sequence[WorkerAddress],
                 config: Deployment, *, connect_timeout_s: float = 10.0,
                 health_timeout_s: float = 1.0, health_ttl_s: float = 1.0,
                 headers: dict[str, str] | None = None) -> None:
        if not prefill or not decode:
            raise ValueError(f"a PD router needs prefill and decode workers, got {len(prefill)} "
                             f"prefill and {len(decode)} decode")
        # the workers that take new requests, in the policies' index order; draining ones aside
        self.prefill: list[Member] = []
        self.decode: list[Member] = []
        self.draining: list[Member] = []
        self._added = {"prefill": 0, "decode": 0}
        settings = config.router
        # Rooms from the OS: routers sharing workers must not draw the same ones.
        self.router = Router(settings.policy, len(prefill), len(decode), config.seed,
                             room_rng=random.SystemRandom(), policy_options=settings.policy_options)
        for role, given in (("prefill", prefill), ("decode", decode)):
            for w in given:
                self._join(role, w)
        self.page_size = config.page_size
        self.metrics = ServeMetrics(engine_type=None)  # the client's view; no engine here
        self.records: deque[RequestRecord] = deque(maxlen=config.max_records)
        # (arrival_s, prompt tokens) of the requests submitted: the autoscaler's arrivals
        self.arrivals: deque[tuple[float, int]] = deque(maxlen=config.max_records)
        self._tasks: dict[str, asyncio.Task] = {}
        self._session: aiohttp.ClientSession | None = None
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = settings.read_timeout_s
        self.health_timeout_s = health_timeout_s
        self.health_ttl_s = health_ttl_s
        self._health: dict[str, str] = {}
        self._health_at = -math.inf
        self._headers = headers or {}  # on every call to a worker: the cluster's auth token
        self._t0 = time.monotonic()

    # ---- Backend ----------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._session is not None and not self._session.closed

    def start(self) -> PDClient:
        """Call on the event loop the router serves from."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout_s,
                                        sock_read=self._read_timeout_s)
        connector = aiohttp.TCPConnector(limit=0)  # one stream per request; no pool cap
        self._session = aiohttp.ClientSession(timeout=timeout, connector=connector,
                                              headers=self._headers)
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
        self.arrivals.append((self.now(), len(prompt_ids)))
        request = GenerateParams(
            rid, list(prompt_ids), max_new_tokens, sampling or SamplingParams(),
            list(stop_token_ids), top_logprobs, bootstrap_host="", bootstrap_port=0,
            bootstrap_room=0)  # where the two sides meet: set once a pair is picked
        task = asyncio.get_running_loop().create_task(self._serve(request, sink))
        self._tasks[rid] = task
        task.add_done_callback(lambda _t: self._tasks.pop(rid, None))
        return rid

    def abort(self, rid: str, reason: str = "aborted by the client") -> None:
        task = self._tasks.get(rid)
        if task is not None:
            task.cancel(reason)

    # ---- one request ------------------------------------------------------------------------

    async def _serve(self, request: GenerateParams, sink: Sink) -> None:
        """Every way this ends, `sink` gets a last event: the decode stream's own, or an error
        (a worker's refusal with its status, a worker gone mid-stream, a timeout, a cancel). A
        503 before any token is tried once more, under a new worker rid (the first one may
        still be held while its aborts land)."""
        arrival_s = self.now()
        if not await self._attempt(request, request.rid, sink, arrival_s, may_retry=True):
            await self._attempt(replace(request, rid=_retry_rid(request.rid)), request.rid, sink,
                                arrival_s, may_retry=False)

    async def _attempt(self, request: GenerateParams, client_rid: str, sink: Sink,
                       arrival_s: float, *, may_retry: bool) -> bool:
        """One try of a request on a (prefill, decode) pair; False when it failed with a 503
        before any token and `may_retry` (then nothing reached `sink` and nothing is
        recorded)."""
        keys = token_page_keys(request.input_ids, self.page_size)
        serving = self._serving
        p, d, room = self.router.route(lambda i: serving["prefill"][i].load,
                                       lambda i: serving["decode"][i].load, keys)
        pre_member, dec_member = serving["prefill"][p], serving["decode"][d]
        pre, dec = pre_member.address, dec_member.address
        body = replace(request, bootstrap_host=pre.bootstrap_host,
                       bootstrap_port=pre.bootstrap_port, bootstrap_room=room).to_body()
        record = RequestRecord(rid=client_rid, input_tokens=len(body["input_ids"]),
                               output_tokens=0, status="failed",
                               prefill_instance=pre_member.index,
                               decode_instance=dec_member.index,
                               arrival_s=arrival_s)
        n_in = len(request.input_ids)
        pre_member.sent(n_in)
        dec_member.sent(1)
        prefill_call = asyncio.create_task(self._prefill(pre, body))
        prefill_call.add_done_callback(lambda _t: pre_member.returned(n_in))
        retry = False
        try:
            await self._relay(dec, body, prefill_call, sink, record)
        except asyncio.CancelledError as exc:
            reason = str(exc.args[0]) if exc.args else "aborted"
            record.error = reason
            deliver(sink, StreamEvent(finished=True, error=reason, status=503))
            await self._abort_both(pre, dec, body["rid"], reason)
            raise
        except WorkerError as exc:
            record.error = exc.message
            retry = may_retry and exc.status == 503 and not record.output_tokens
            if retry:
                log.info("request %s: %s; trying once more", client_rid, exc.message)
            else:
                deliver(sink, StreamEvent(finished=True, error=exc.message, status=exc.status,
                                          param=exc.param))
            await self._abort_both(pre, dec, body["rid"], exc.message)
        except Exception as exc:  # a bug here: the client still gets an end, the log one line
            log.error("request %s failed in the router: %r", body["rid"], exc)
            record.error = "router error"
            deliver(sink, StreamEvent(finished=True, error=record.error, status=500))
            await self._abort_both(pre, dec, body["rid"], record.error)
        finally:
            if not prefill_call.done():
                prefill_call.cancel()
            await asyncio.gather(prefill_call, return_exceptions=True)
            dec_member.returned(1)
            if not retry:
                record.finish_s = self.now()
                if record.token_times_s:
                    record.first_token_s = record.token_times_s[0]
                self.records.append(record)
                self.metrics.observe_request(record)
        return not retry

    def loads(self) -> tuple[list[int], list[int]]:
        """The policies' load signal now, per serving worker (`Member.load`): prompt tokens
        whose prefill call has not returned, requests in flight."""
        return [m.load for m in self.prefill], [m.load for m in self.decode]

    # ---- membership -------------------------------------------------------------------------

    def _join(self, role: str, worker: WorkerAddress) -> Member:
        if role == "prefill" and (not worker.bootstrap_host or not worker.bootstrap_port):
            raise ValueError(f"prefill worker {worker.url} names no bootstrap host and port")
        index = self._added[role]
        member = Member(role, index, replace(worker, name=f"{role} worker {index}"))
        member.idle.set()
        self._added[role] += 1
        (self.prefill if role == "prefill" else self.decode).append(member)
        self._route_to_serving()
        return member

    def _route_to_serving(self) -> None:
        """Tell the core router which workers take requests (by index, in joining order: a
        policy's per-position state follows the list, the core's `set_serving`)."""
        self._serving = {role: {m.index: m for m in group}
                         for role, group in (("prefill", self.prefill), ("decode", self.decode))}
        if self.prefill and self.decode:
            self.router.set_serving(list(self._serving["prefill"]),
                                    list(self._serving["decode"]))

    def members(self) -> list[Member]:
        """Every worker the router knows: serving (prefill, then decode), then draining."""
        return [*self.prefill, *self.decode, *self.draining]

    async def add_worker(self, role: str, url: str, bootstrap_host: str = "",
                         bootstrap_port: int = 0) -> Member:
        """Admit the worker at `url`: it must answer `GET /health` as a `role` worker and take
        this router's cluster token; a prefill worker's bootstrap server is its `/health`'s
        unless given. It takes requests from the next one routed."""
        worker = WorkerAddress(url, bootstrap_host, bootstrap_port)
        if role not in ("prefill", "decode"):
            raise MembershipError(400, f"role: {role!r}; allowed: prefill, decode")
        if any(m.address.url == worker.url for m in self.members()):
            raise MembershipError(409, f"{worker.url} is already a worker of this router")
        if role == "decode" and (worker.bootstrap_host or worker.bootstrap_port):
            raise MembershipError(400, "bootstrap_host and bootstrap_port: a decode worker has "
                                       "no bootstrap server; give them for prefill only")
        health, why = await self._check(worker.url)
        if why is None and health.get("role") != role:
            why = f"its /health names role {health.get('role')!r}, not {role!r}"
        if why is not None:
            raise MembershipError(400, f"{worker.url} cannot join as a {role} worker: {why}")
        if role == "prefill" and not worker.bootstrap_port:
            worker = replace(worker, bootstrap_host=str(health.get("bootstrap_host") or ""),
                             bootstrap_port=int(health.get("bootstrap_port") or 0))
            if not worker.bootstrap_port:
                raise MembershipError(400, f"{worker.url} names no bootstrap server in its "
                                           "/health; give bootstrap_host and bootstrap_port")
        if any(m.address.url == worker.url for m in self.members()):  # added while we asked
            raise MembershipError(409, f"{worker.url} is already a worker of this router")
        member = self._join(role, worker)
        log.info("%s (%s) joined", member.name, worker.url)
        return member

    async def remove_worker(self, url: str) -> Member:
        """Drain the serving worker at `url`, then forget it: it gets no new requests at once;
        a decode worker finishes its streams, a prefill worker its prefill calls (the call
        returns once its KV is sent). Returns once nothing of this router's is left on it;
        the caller may stop it then."""
        serving = {m.address.url: m for m in (*self.prefill, *self.decode)}
        member = serving.get(url)
        if member is None:
            if any(m.address.url == url for m in self.draining):
                raise MembershipError(409, f"{url} is draining already")
            raise MembershipError(404, f"{url} is not a worker of this router; its workers: "
                                       f"{', '.join(serving) or 'none'}")
        group = self.prefill if member.role == "prefill" else self.decode
        if len(group) == 1:
            raise MembershipError(409, f"{member.name} is the last {member.role} worker "
                                       "serving; add another before removing it")
        group.remove(member)
        self._route_to_serving()
        member.draining = True
        self.draining.append(member)
        log.info("%s (%s) draining: %d calls in flight", member.name, url, member.calls)
        try:
            await member.idle.wait()
        finally:
            self.draining.remove(member)
        log.info("%s (%s) left", member.name, url)
        return member

    async def _prefill(self, worker: WorkerAddress, body: dict) -> None:
        async with _calling(worker):
            async with self._session.post(f"{worker.url}/generate", json=body) as resp:
                if resp.status != 200:
                    raise await _worker_error(resp, worker)

    async def _open_stream(self, worker: WorkerAddress, body: dict):
        """The decode worker's response (status 200) and its first event."""
        async with _calling(worker):
            resp = await self._session.post(f"{worker.url}/generate", json=body)
            if resp.status != 200:
                async with resp:
                    raise await _worker_error(resp, worker)
            try:
                events = _sse_events(resp)
                return resp, events, await anext(events, None)
            except BaseException:
                resp.release()
                raise

    async def _relay(self, worker: WorkerAddress, body: dict, prefill_call: asyncio.Task,
                     sink: Sink, record: RequestRecord) -> None:
        """Stream the decode worker's events to `sink`. Until the first token arrives a prefill
        failure wins: its status is the client's (the decode side would only time out)."""
        opening = asyncio.create_task(self._open_stream(worker, body))
        try:
            await asyncio.wait({opening, prefill_call}, return_when=asyncio.FIRST_COMPLETED)
            if not opening.done() and prefill_call.exception() is not None:
                raise prefill_call.exception()
            resp, events, event = await opening
        finally:
            if not opening.done():
                opening.cancel()
                await asyncio.gather(opening, return_exceptions=True)
        async with resp, _calling(worker):
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
            raise WorkerError(502, f"{worker.name} failed: the stream ended before "
                              "the request finished")

    async def _abort_both(self, pre: WorkerAddress, dec: WorkerAddress, rid: str,
                          reason: str) -> None:
        payload = {"rid": rid, "reason": reason}

        async def one(worker: WorkerAddress) -> None:
            try:
                async with self._session.post(f"{worker.url}/abort", json=payload,
                                              timeout=aiohttp.ClientTimeout(total=5)):
                    pass
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                log.info("abort of %s at %s not delivered", rid, worker.url)

        await asyncio.gather(one(pre), one(dec))

    # ---- health -----------------------------------------------------------------------------

    async def problems(self) -> dict[str, str]:
        """The workers that do not answer `GET /health` with 200 within `health_timeout_s`, by
        name ("prefill worker 0"), with why (no address: it goes to clients; the log has the
        URLs); probed at most every `health_ttl_s`."""
        if not self.running:
            return {"router": "stopped"}
        if time.monotonic() - self._health_at > self.health_ttl_s:
            workers = [m.address for m in (*self.prefill, *self.decode)]
            found = await asyncio.gather(*(self._probe(w) for w in workers))
            self._health = {w.name: why for w, why in zip(workers, found) if why}
            for w, why in zip(workers, found):
                if why:
                    log.warning("%s (%s) is unhealthy: %s", w.name, w.url, why)
            self._health_at = time.monotonic()
        return dict(self._health)

    async def _probe(self, worker: WorkerAddress) -> str | None:
        """Why `worker` cannot serve this router's requests, or None."""
        return (await self._check(worker.url))[1]

    async def _check(self, url: str) -> tuple[dict, str | None]:
        """The worker's `/health` JSON and why it cannot serve this router's requests (None:
        it can). `/health` needs no token, so `/load` (which does) tells whether the worker
        takes this router's."""
        timeout = aiohttp.ClientTimeout(total=self.health_timeout_s)
        try:
            async with self._session.get(f"{url}/health", timeout=timeout) as resp:
                if resp.status != 200:
                    return {}, f"/health answered {resp.status}"
                health = await resp.json(content_type=None)
            async with self._session.get(f"{url}/load", timeout=timeout) as resp:
                if resp.status == 401:
                    return health, ("refuses this router's cluster token (401): the router "
                                    "does not hold the workers' cluster secret")
            if not isinstance(health, dict):
                return {}, "its /health is not a JSON object"
            return health, None
        except asyncio.TimeoutError:
            return {}, f"/health did not answer within {self.health_timeout_s:g} s"
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            return {}, f"unreachable ({type(exc).__name__})"

    def now(self) -> float:
        """Seconds since `start()` (the router's records' time base)."""
        return time.monotonic() - self._t0


class _RouterServer(OpenAIServer):
    """The OpenAI API, plus internal routes (`add_internal`: `/workers`, the launcher's
    `/scale`) that need the cluster token and never the API key."""

    def __init__(self, *args, cluster_key: ClusterKey | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cluster_key = cluster_key
        self.internal: list[tuple[str, str, Callable]] = []

    @property
    def internal_paths(self) -> frozenset[str]:
        return frozenset(path for _, path, _ in self.internal)

    def make_app(self) -> web.Application:
        app = super().make_app()
        app.middlewares.append(internal_guard(self.cluster_key, self.internal_paths))
        for method, path, handler in self.internal:
            app.router.add_route(method, path, handler)
        return app


class PDRouter:
    """The router server: `port = await router.start(host, port)`, then `await router.close()`.
    `config` is the deployment (its router section, seed, page size, records kept, chat
    max_tokens default, requests answered at once); the rest comes from the served model.
    `cluster_key`: the workers' (the router sends its token on every call to them, and
    requires it on its internal routes, runtime/router_control.py)."""

    def __init__(self, prefill: Sequence[WorkerAddress], decode: Sequence[WorkerAddress],
                 config: Deployment, *, tokenizer: Tokenizer, model_name: str, limits: Limits,
                 chat_template: ChatTemplate | None = None, eos_ids: Sequence[int] = (),
                 cluster_key: ClusterKey | None = None) -> None:
        self.client = PDClient(prefill, decode, config,
                               headers=None if cluster_key is None else cluster_key.headers())
        self.server = _RouterServer(self.client, tokenizer, model_name=model_name, limits=limits,
                                    chat_template=chat_template, eos_ids=eos_ids,
                                    default_chat_max_tokens=config.default_max_tokens,
                                    max_inflight_requests=config.max_inflight_requests,
                                    cluster_key=cluster_key)
        self.add_internal(*WorkerRoutes(self.client).routes())

    def add_internal(self, *routes: tuple[str, str, Callable]) -> None:
        """(method, path, handler) routes that need the cluster token; before `start()`."""
        self.server.internal.extend(routes)

    def protect(self, *, api_key: str | None = None, limits: HttpLimits | None = None) -> None:
        """Require `api_key` on the public API (not on the internal routes); serve under
        `limits`. Before `start()`, after the last `add_internal`."""
        self.server.protect(api_key=api_key, limits=limits,
                            open_paths=("/health", "/info", *self.server.internal_paths))

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


async def _sse_events(resp: aiohttp.ClientResponse):
    """The events of a decode worker's SSE stream (`data: {...}` lines) until `data: [DONE]`. A
    stream that ends without `[DONE]` simply stops: the caller decides what that means. An event
    that is not a `StreamEvent` of this protocol version raises `ProtocolError` (a `ValueError`,
    which `_calling` turns into a 502). An error's text reaches the client with any internal
    address in it redacted."""
    async for raw in resp.content:
        if not raw.startswith(b"data:"):
            continue
        data = raw[5:].strip()
        if data == b"[DONE]":
            return
        event = from_sse_data(data)
        if event.error is not None:
            event = replace(event, error=redact_addresses(event.error))
        yield event


async def _worker_error(resp: aiohttp.ClientResponse, worker: WorkerAddress) -> WorkerError:
    """A worker's error answer as a `WorkerError` with its status, message and field."""
    param = None
    try:
        error = (await resp.json(content_type=None))["error"]
        message, param = str(error["message"]), error.get("param")
    except (ValueError, KeyError, TypeError, AttributeError, aiohttp.ClientError):
        message = (await resp.text(errors="replace"))[:200] or resp.reason or "no reason given"
    if isinstance(param, str):  # the worker API's field, as the client named it
        param = OPENAI_FIELD.get(param, param.removeprefix("sampling."))
    else:
        param = None
    if resp.status >= 500:
        log.warning("%s (%s) answered %d: %s", worker.name, worker.url, resp.status, message)
    return WorkerError(resp.status, f"{worker.name}: {redact_addresses(message)}", param)


OPENAI_FIELD = {"input_ids": "prompt", "max_new_tokens": "max_tokens"}


def _retry_rid(rid: str) -> str:
    """The worker rid of a request's second try (kept within the workers' rid limit)."""
    return rid[:MAX_RID_CHARS - len(".retry")] + ".retry"

