"""The one wire codec (runtime/protocol/): every message type round-trips through its wire format,
and decoding refuses another version, an unknown key and a wrongly typed (nested) value with one
`ProtocolError` naming the message type and the field."""

from __future__ import annotations

import json
import math

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.checks import BadRequest
from runtime.protocol import codec, step, stream, transfer
from runtime.protocol.codec import VERSION, ProtocolError
from runtime.protocol.worker import GenerateParams, parse_generate
from runtime.sampling import MAX_TOP_LOGPROBS, SamplingParams

i64 = st.integers(codec.INT64_MIN, codec.INT64_MAX)
u63 = st.integers(0, codec.INT64_MAX)
finite = st.floats(allow_nan=False, allow_infinity=False)
logprob = st.floats(max_value=0.0, allow_nan=False) | st.just(float("-inf"))
text = st.text(max_size=16)
ids = st.lists(st.integers(0, 2**31 - 1), max_size=8)

add_requests = st.builds(
    step.AddRequest, rid=text, prompt_ids=ids.filter(bool), max_new_tokens=st.integers(1, 2**31),
    arrival_s=finite, stop_token_ids=ids, temperature=st.floats(0.0, 2.0),
    top_k=st.integers(0, 2**31 - 1), top_p=st.floats(1e-6, 1.0), seed=st.none() | i64,
    bootstrap_host=text, bootstrap_port=st.integers(1, 65535), bootstrap_room=u63,
    top_logprobs=st.integers(0, MAX_TOP_LOGPROBS))
ops = st.one_of(add_requests, st.builds(step.AbortRequest, rid=text, reason=text),
                st.just(step.CheckPools()))
steps = st.builds(step.Step, now=finite, stop=st.booleans(), ops=st.lists(ops, max_size=4))
transfer_messages = st.one_of(
    st.builds(transfer.RegisterDecode, session_id=text, endpoint=text, tp_rank=i64, tp_size=i64,
              kv_data_ptrs=st.lists(u63, max_size=4), kv_data_lens=st.lists(u63, max_size=4),
              kv_item_lens=st.lists(u63, max_size=4), metadata_ptr=u63, metadata_len=u63,
              metadata_item_len=u63, page_size=i64, kv_dtype=text, is_mla=st.booleans(),
              total_kv_heads=i64, kv_heads_per_rank=i64),
    st.builds(transfer.TransferInfo, room=u63, session_id=text, decode_tp_rank=i64,
              dst_pages=st.binary(max_size=32), page_dtype=st.sampled_from(["int32", "int64"]),
              metadata_slot=i64, is_dummy=st.booleans()),
    st.builds(transfer.Status, room=u63, poll=i64, reason=text, prefill_tp_rank=i64),
    st.builds(transfer.Abort, room=u63, reason=text, session_id=text),
    st.builds(transfer.Heartbeat, session_id=text, endpoint=text, reply=st.booleans()))
events = st.builds(
    stream.StreamEvent, token_ids=st.lists(i64, max_size=4).map(tuple),
    logprobs=st.lists(logprob, max_size=4).map(tuple),
    top_logprobs=st.lists(st.lists(st.tuples(i64, logprob), max_size=3).map(tuple),
                          max_size=3).map(tuple),
    finished=st.booleans(), finish_reason=st.none() | text, error=st.none() | text,
    prompt_tokens=i64, completion_tokens=i64, cached_tokens=i64,
    status=st.none() | st.integers(100, 599), param=st.none() | text)
generate = st.builds(
    GenerateParams, rid=st.text("abcdef-0123", min_size=1, max_size=16),
    input_ids=st.lists(st.integers(0, 511), min_size=1, max_size=8),
    max_new_tokens=st.integers(1, 64),
    sampling=st.builds(SamplingParams, temperature=st.floats(0.0, 2.0),
                       top_k=st.integers(0, 2**31 - 1), top_p=st.floats(1e-6, 1.0),
                       seed=st.none() | i64),
    stop_token_ids=st.lists(st.integers(0, 511), max_size=4),
    top_logprobs=st.integers(0, MAX_TOP_LOGPROBS), bootstrap_host=st.just("127.0.0.1"),
    bootstrap_port=st.integers(1, 65535), bootstrap_room=u63)


# ---- round trips -------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None, derandomize=True)
@given(msg=steps)
def test_a_step_round_trips(msg):
    assert step.decode(step.encode(msg)) == msg


@settings(max_examples=150, deadline=None, derandomize=True)
@given(msg=transfer_messages)
def test_a_transfer_message_round_trips(msg):
    assert transfer.decode(transfer.encode(msg)) == msg


@settings(max_examples=150, deadline=None, derandomize=True)
@given(event=events)
def test_a_stream_event_round_trips_through_its_sse_json(event):
    assert stream.from_sse_data(stream.to_sse_data(event)) == event


@settings(max_examples=150, deadline=None, derandomize=True)
@given(params=generate)
def test_a_generate_body_round_trips_through_json(params):
    body = json.loads(json.dumps(params.to_body()))
    assert body["version"] == VERSION
    assert parse_generate(body, model_vocab=512, max_position=2**20) == params


# ---- refusals ----------------------------------------------------------------------------------

STEP = step.Step(now=1.0, stop=False, ops=[step.AddRequest(
    rid="r", prompt_ids=[1, 2], max_new_tokens=3, arrival_s=0.5, stop_token_ids=[], temperature=0.0,
    top_k=0, top_p=1.0, seed=None, bootstrap_host="h", bootstrap_port=1, bootstrap_room=0,
    top_logprobs=0)])


def _step_frame(**change) -> bytes:
    body = msgpack.unpackb(step.encode(STEP))
    body.update(change)
    return msgpack.packb(body, use_bin_type=True)


def _refused(decode, frame, message_type, field) -> str:
    with pytest.raises(ProtocolError) as err:
        decode(frame)
    assert (err.value.message_type, err.value.field) == (message_type, field)
    return str(err.value)


def test_another_version_is_refused_naming_it():
    text = _refused(step.decode, _step_frame(version=VERSION - 1), "step", "version")
    assert f"protocol version {VERSION - 1} is not supported; allowed: {VERSION}" in text
    text = _refused(stream.from_sse_data, '{"version": "2"}', "stream_event", "version")
    assert "protocol version '2' is not supported" in text


def test_an_unknown_key_is_refused_naming_it():
    text = _refused(step.decode, _step_frame(colour="red"), "step", "colour")
    assert "unexpected fields ['colour']" in text
    body = json.loads(stream.to_sse_data(stream.StreamEvent()))
    del body["cached_tokens"]
    text = _refused(stream.from_sse_data, json.dumps(body), "stream_event", "cached_tokens")
    assert "missing fields ['cached_tokens']" in text


def test_a_wrong_nested_type_is_refused_naming_the_field_the_value_and_what_is_allowed():
    ops = msgpack.unpackb(step.encode(STEP))["ops"]
    ops[0]["prompt_ids"] = [1, True]
    text = _refused(step.decode, _step_frame(ops=ops), "add_request", "prompt_ids")
    assert "add_request.prompt_ids must be a list of (an integer within 64 bits)" in text
    assert "(item 1: True)" in text
    event = json.loads(stream.to_sse_data(stream.StreamEvent(token_ids=(1,), logprobs=(-0.1,),
                                                             top_logprobs=(((1, -0.1),),))))
    event["top_logprobs"] = [[[1, "x"]]]
    text = _refused(stream.from_sse_data, json.dumps(event), "stream_event", "top_logprobs")
    assert "got [[[1, 'x']]] (item 0: [[1, 'x']] (item 0: [1, 'x'] (item 1: 'x')))" in text
    ops[0] = {"type": "abort", "room": 1, "reason": "x", "session_id": "s"}  # a transfer message
    text = _refused(step.decode, _step_frame(ops=ops), "step", "ops")
    assert "'add_request' map or a 'abort_request' map or a 'check_pools' map" in text


def test_each_link_takes_only_its_own_messages():
    frame = step.encode(STEP)
    assert "unknown message type 'step'; allowed: ['abort', 'heartbeat'" in _refused(
        transfer.decode, frame, None, "type")
    beat = transfer.encode(transfer.Heartbeat(session_id="s", endpoint="e", reply=False))
    assert "unknown message type 'heartbeat'; allowed: ['step']" in _refused(
        step.decode, beat, None, "type")


def test_a_sender_cannot_build_what_a_receiver_would_refuse():
    with pytest.raises(ProtocolError, match=r"step\.now must be a finite number, got nan"):
        step.Step(now=float("nan"), stop=False, ops=[])
    with pytest.raises(ProtocolError, match="step.ops must be"):
        step.Step(now=0.0, stop=False, ops=[transfer.Abort(room=1, reason="x", session_id="s")])


def test_the_generate_body_uses_the_shared_checks_with_its_field():
    body = GenerateParams("r", [1], 1, SamplingParams(), [], 0, "h", 1, 0).to_body()
    with pytest.raises(BadRequest, match=r"unexpected fields \['colour'\]") as err:
        parse_generate({**body, "colour": 1}, model_vocab=8, max_position=64)
    assert err.value.param == "colour"
    del body["rid"]
    with pytest.raises(BadRequest, match=r"missing fields \['rid'\]") as err:
        parse_generate(body, model_vocab=8, max_position=64)
    assert err.value.param == "rid"



# ---- the stream event's fast path (runtime/protocol/stream.py) -----------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats() | text,
    lambda inner: st.lists(inner, max_size=3), max_leaves=8)
WIRE_KEYS = list(json.loads(stream.to_sse_data(stream.StreamEvent())))


@st.composite
def wire_maps(draw):
    """A valid event's wire map, then (maybe) some values replaced by any JSON value (or by the
    shapes a top logprob takes), a key dropped or a key added."""
    body = json.loads(stream.to_sse_data(draw(events)))
    for key in draw(st.lists(st.sampled_from(WIRE_KEYS), max_size=2, unique=True)):
        body[key] = draw(json_values | st.lists(st.lists(st.lists(json_values, max_size=3),
                                                         max_size=2), max_size=2))
    if draw(st.booleans()) and draw(st.booleans()):
        body.pop(draw(st.sampled_from(WIRE_KEYS)))
    if draw(st.booleans()) and draw(st.booleans()):
        body[draw(text)] = draw(json_values)
    return body


def _outcome(decode, data: str):
    try:
        event = decode(data)
    except ProtocolError as exc:
        return "refused", str(exc), exc.message_type, exc.field
    # repr tells an int from the equal float, and a list from a tuple
    return "accepted", repr(event)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(event=events)
def test_the_fast_stream_encoder_writes_the_codecs_json(event):
    assert stream.to_sse_data(event) == codec.to_json(event)


@settings(max_examples=600, deadline=None, derandomize=True)
@given(body=wire_maps())
def test_the_fast_stream_decoder_accepts_and_refuses_exactly_what_the_codec_does(body):
    data = json.dumps(body)
    assert _outcome(stream.from_sse_data, data) == _outcome(
        lambda d: codec.from_json(d, stream.StreamEvent), data)
    assert _outcome(stream.from_sse_data, data.encode()) == _outcome(stream.from_sse_data, data)


@pytest.mark.parametrize("change", [
    {"token_ids": [1, True]}, {"token_ids": [2**63]}, {"logprobs": [float("nan")]},
    {"logprobs": [float("inf")]}, {"logprobs": [-0.5, "x"]}, {"top_logprobs": [[[1]]]},
    {"top_logprobs": [[[1, -0.1, 2]]]}, {"top_logprobs": [[(1, True)]]}, {"finished": 1},
    {"status": 200.0}, {"prompt_tokens": False}, {"finish_reason": 3}, {"version": VERSION + 1}])
def test_the_fast_stream_decoder_refuses_what_the_codec_refuses(change):
    body = json.loads(stream.to_sse_data(stream.StreamEvent(token_ids=(1,), logprobs=(-0.5,))))
    body.update(change)
    with pytest.raises(ProtocolError) as err:
        stream.from_sse_data(json.dumps(body))
    assert err.value.field == next(iter(change))


def test_the_fast_stream_decoder_keeps_minus_infinity_and_integer_logprobs():
    event = stream.StreamEvent(token_ids=(5, 6), logprobs=(float("-inf"), -1),
                               top_logprobs=(((5, float("-inf")),), ((6, 0),)))
    back = stream.from_sse_data(stream.to_sse_data(event))
    assert back == event and type(back.logprobs[1]) is int and back.logprobs[0] == -math.inf


def test_top_p_at_its_floor_passes_as_a_float32_router_hands_it_on():
    """SGLang's router holds top_p as a float32: 1e-6 arrives as 9.99999997e-07."""
    import struct

    from runtime.sampling import MIN_TOP_P, SamplingError, parse_sampling

    f32 = struct.unpack("f", struct.pack("f", MIN_TOP_P))[0]
    assert f32 < MIN_TOP_P
    assert parse_sampling({"top_p": f32}, default_temperature=1.0).top_p == f32
    with pytest.raises(SamplingError, match="top_p"):
        parse_sampling({"top_p": 9e-7}, default_temperature=1.0)
