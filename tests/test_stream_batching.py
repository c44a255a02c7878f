"""The per-token hand-off (runtime/streams.py): events from the engine thread reach the event loop
in batches, one wake-up per batch, and the HTTP fronts (the PD decode worker's stream, the
OpenAI server's) answer the events ready at once in one write. The fronts run for real on
loopback; the engine behind them is scripted, so that when events are ready is known."""

from __future__ import annotations

import asyncio
import json
import threading

import aiohttp
import pytest
from aiohttp import web

from runtime.openai.protocol import Limits
from runtime.openai.server import OpenAIServer
from runtime.pd.http import WorkerInfo, WorkerServer
from runtime.protocol.codec import VERSION
from runtime.protocol.stream import StreamEvent, from_sse_data
from runtime.serve_metrics import ServeMetrics
from runtime.streams import EventQueue, Mailbox, deliver, for_running_loop
from runtime.tokenizer import ByteTokenizer

pytestmark = pytest.mark.real  # HTTP servers on loopback


def _post_from_thread(posts) -> None:
    """Run `posts` on another thread and wait for it: the loop (this thread) is busy meanwhile,
    as it is while an engine step hands over its events."""
    thread = threading.Thread(target=posts)
    thread.start()
    thread.join()


def test_events_posted_off_the_loop_wake_it_once_per_batch():
    loop = asyncio.new_event_loop()
    try:
        box = Mailbox(loop)
        a, b = EventQueue(), EventQueue()
        events = [StreamEvent(token_ids=(i,)) for i in range(6)]
        _post_from_thread(lambda: [deliver(box.sink(q), e)
                                   for q, e in zip([a, b] * 3, events)])
        assert box.wakeups == 1
        assert loop.run_until_complete(a.get_ready()) == events[0::2]
        assert loop.run_until_complete(b.get_ready()) == events[1::2]
        _post_from_thread(lambda: deliver(box.sink(a), events[0]))  # a new batch, a new wake-up
        assert box.wakeups == 2
        assert loop.run_until_complete(a.get()) == events[0]
    finally:
        loop.close()


def test_a_sink_on_the_loop_thread_puts_at_once_without_a_wake_up():
    async def main():
        box, queue = for_running_loop(), EventQueue()
        assert for_running_loop() is box
        before = box.wakeups
        box.sink(queue)(StreamEvent(token_ids=(1,)))
        box.sink(queue)(StreamEvent(token_ids=(2,)))
        assert box.wakeups == before
        assert [e.token_ids for e in await queue.get_ready()] == [(1,), (2,)]

    asyncio.run(main())


def test_a_closed_loop_drops_the_events_and_keeps_no_batch_open():
    loop = asyncio.new_event_loop()
    box, queue = Mailbox(loop), EventQueue()
    loop.close()
    raised = []

    def post() -> None:
        try:
            box.post(queue, StreamEvent())
        except RuntimeError as exc:
            raised.append(exc)

    _post_from_thread(post)
    assert len(raised) == 1
    _post_from_thread(lambda: deliver(box.sink(queue), StreamEvent()))  # deliver swallows it
    # Each post tried to wake the loop: none waited behind a batch that never goes.
    assert box.wakeups == 2


# ---- the HTTP fronts ---------------------------------------------------------------------------


class ScriptedEngine:
    """A backend that answers every request with `script`, handed over from another thread in
    one go while the loop waits (as an engine step does)."""

    def __init__(self, script: list[StreamEvent], engine_type: str) -> None:
        self.script = script
        self.metrics = ServeMetrics(engine_type)
        self.running = True
        self.aborted: list[str] = []

    def start(self) -> None:
        self.running = True

    async def shutdown(self) -> None:
        self.running = False

    def submit(self, prompt_ids, max_new_tokens, sink, **options) -> str:
        _post_from_thread(lambda: [deliver(sink, e) for e in self.script])
        return options.get("rid") or "r"

    def abort(self, rid: str, reason: str = "") -> None:
        self.aborted.append(rid)

    async def problems(self) -> dict[str, str]:
        return {}


@pytest.fixture
def writes(monkeypatch) -> list[bytes]:
    """What every streamed response wrote, one item per `write` call."""
    seen: list[bytes] = []
    write = web.StreamResponse.write

    async def spy(self, data):
        seen.append(bytes(data))
        return await write(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", spy)
    return seen


async def _serve_and_post(server, path: str, body: dict) -> bytes:
    port = await server.start("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://127.0.0.1:{port}{path}", json=body) as resp:
                assert resp.status == 200, await resp.text()
                return await resp.read()
    finally:
        await server.close()


def _data_lines(raw: bytes) -> list[str]:
    return [line[5:].strip() for line in raw.decode().split("\n") if line.startswith("data:")]


TOKENS = [StreamEvent(token_ids=(t,), logprobs=(-0.5,), prompt_tokens=2) for t in b"hi!"]
LAST = StreamEvent(finished=True, finish_reason="length", prompt_tokens=2, completion_tokens=3)


def test_the_decode_worker_streams_the_events_ready_at_once_in_one_write(writes):
    engine = ScriptedEngine([*TOKENS, LAST], "decode")
    server = WorkerServer(engine, WorkerInfo("decode", 0, 1, "m", 512, 4096))
    body = {"version": VERSION, "rid": "r1", "input_ids": [1, 2], "max_new_tokens": 3,
            "bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": 7}
    raw = asyncio.run(_serve_and_post(server, "/generate", body))
    *events, done = _data_lines(raw)
    assert [from_sse_data(e) for e in events] == [*TOKENS, LAST] and done == "[DONE]"
    assert len(writes) == 1 and b"".join(writes) == raw


def test_the_openai_stream_writes_the_events_ready_at_once_in_one_write(writes):
    engine = ScriptedEngine([*TOKENS, LAST], "unified")
    server = OpenAIServer(engine, ByteTokenizer(), model_name="m",
                          limits=Limits(max_model_len=4096, pool_tokens=4096, max_position=4096,
                                        model_vocab=259))
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 3, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    raw = asyncio.run(_serve_and_post(server, "/v1/completions", body))
    *chunks, done = _data_lines(raw)
    chunks = [json.loads(c) for c in chunks]
    assert done == "[DONE]" and len(writes) == 1 and b"".join(writes) == raw
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert texts == ["h", "i", "!", ""]
    assert [c["choices"][0]["token_ids"] for c in chunks if c["choices"]] == [
        [104], [105], [33], []]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 3
