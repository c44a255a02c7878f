"""The router -> worker `/generate` body is a typed, versioned message: what the router encodes
the worker decodes to the same request, and another version is refused naming the field."""

from __future__ import annotations

import pytest

from runtime.checks import BadRequest
from runtime.protocol.codec import VERSION
from runtime.protocol.worker import GenerateParams, parse_generate
from runtime.sampling import SamplingParams


def request(**kw) -> GenerateParams:
    base = dict(rid="r-1", input_ids=[5, 6, 7], max_new_tokens=4,
                sampling=SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=3),
                stop_token_ids=[2], top_logprobs=1, bootstrap_host="127.0.0.1",
                bootstrap_port=8998, bootstrap_room=2**62 + 5)
    base.update(kw)
    return GenerateParams(**base)


def test_what_the_router_encodes_the_worker_decodes():
    sent = request()
    body = sent.to_body()
    assert body["version"] == VERSION
    assert parse_generate(body, model_vocab=512, max_position=2048) == sent


@pytest.mark.parametrize("version", [None, 0, VERSION - 1, VERSION + 1, str(VERSION), True,
                                     float(VERSION)])
def test_another_version_is_refused_naming_the_field(version):
    body = request().to_body()
    if version is None:
        del body["version"]
    else:
        body["version"] = version
    with pytest.raises(BadRequest, match="version") as exc:
        parse_generate(body, model_vocab=512, max_position=2048)
    assert exc.value.param == "version"
