"""A prompt too long to fit is refused before it is tokenised, and parsing a big body does not
stall the server's other streams: the bound on a tokenizer's bytes per token, the request
parser, and a real server on loopback."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from runtime.chat_template import ChatTemplate
from runtime.checks import BadRequest
from runtime.openai.protocol import Limits, RequestParser
from runtime.tokenizer import ByteTokenizer, load_tokenizer

LIMITS = Limits(max_model_len=1024, pool_tokens=512, max_position=2048, model_vocab=259)


class CountingTokenizer(ByteTokenizer):
    """The byte tokenizer, counting the characters it was asked to tokenise."""

    def __init__(self) -> None:
        self.encoded_chars = 0

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        self.encoded_chars += len(text)
        return super().encode(text, add_bos)


def test_a_text_that_cannot_fit_is_refused_without_tokenising_it():
    tok = CountingTokenizer()
    parser = RequestParser(tok, LIMITS, ChatTemplate(), [257], 16)
    with pytest.raises(BadRequest) as err:
        parser.completion({"prompt": "x" * 2_000_000})
    assert err.value.param == "prompt" and tok.encoded_chars == 0
    assert ("the prompt has 2000000 characters, so more than 512 tokens (a token of this "
            "tokenizer holds at most 1 byte); allowed: at most 512 tokens (the prefill KV pool "
            "holds 512 tokens)") == err.value.message
    with pytest.raises(BadRequest) as err:
        parser.chat({"messages": [{"role": "user", "content": "é" * 100_000}]})
    assert err.value.param == "messages" and tok.encoded_chars == 0
    # At the bound it is tokenised and the exact count decides (BOS + 512 bytes = 513 tokens).
    with pytest.raises(BadRequest, match="the prompt has 513 tokens; allowed: at most 512"):
        parser.completion({"prompt": "x" * 512})
    assert tok.encoded_chars == 512
    assert len(parser.completion({"prompt": "x" * 511, "max_tokens": 1}).prompt_ids) == 512


def _save(tmp_path, hf, **special) -> None:
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(special))


def test_the_bytes_per_token_bound_of_hf_tokenizers(tmp_path):
    import tokenizers
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(["hello world, the quick brown fox"] * 50, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.add_special_tokens(["<|a-rather-long-special-token|>"])
    _save(tmp_path, bpe)
    tok = load_tokenizer(tmp_path)
    assert tok.max_bytes_per_token == len("<|a-rather-long-special-token|>")
    for text in ("hello world " * 40, "<|a-rather-long-special-token|>" * 9, "ÿ€😀 x" * 20):
        assert len(tok.encode(text, add_bos=False)) >= len(text.encode()) / tok.max_bytes_per_token

    bpe.normalizer = normalizers.NFKC()  # may shrink a character 4 bytes to 1
    _save(tmp_path, bpe)
    longest = len("<|a-rather-long-special-token|>")
    assert load_tokenizer(tmp_path).max_bytes_per_token == 4 * longest

    bpe.normalizer = normalizers.Replace(tokenizers.Regex(" +"), " ")  # deletes spaces
    _save(tmp_path, bpe)
    assert load_tokenizer(tmp_path).max_bytes_per_token is None

    # An unknown-word token stands for a word of any length: no bound.
    words = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    _save(tmp_path, words)
    tok = load_tokenizer(tmp_path)
    assert tok.max_bytes_per_token is None
    assert tok.encode("x" * 10_000, add_bos=False) == [0]


# ---- a real server ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    from configs import colocated_config

    from runtime.colocated import BackgroundServer

    cfg = colocated_config("tiny-llama", num_pages=64, page_size=8, seed=3,
                           scheduler=dict(max_running_requests=8, max_prefill_tokens=128,
                                          chunked_prefill_size=32))
    with BackgroundServer(cfg) as srv:
        yield srv


def _post(url: str, body: bytes) -> tuple[int, dict, float]:
    start = time.monotonic()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.load(resp), time.monotonic() - start
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc), time.monotonic() - start


def _stream_gaps(url: str, started: threading.Event, out: list[float]) -> None:
    """Stream one long completion, appending the time between consecutive events to `out`."""
    body = json.dumps({"prompt": "once upon a time", "max_tokens": 450, "ignore_eos": True,
                       "stream": True}).encode()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        last = None
        for line in resp:
            if not line.startswith(b"data: "):
                continue
            now = time.monotonic()
            if last is not None:
                out.append(now - last)
            last = now
            started.set()


@pytest.mark.real
@pytest.mark.slow
def test_a_huge_prompt_gets_a_quick_400_while_another_stream_flows(server):
    from pdsim.deployment import HttpLimits

    url = server.url + "/v1/completions"
    max_body_bytes = HttpLimits().max_body_bytes
    head = b'{"max_tokens": 1, "prompt": "'
    huge = head + b"y" * (max_body_bytes - len(head) - 2 - 64) + b'"}'
    assert max_body_bytes - 64 <= len(huge) < max_body_bytes

    gaps: list[float] = []
    started = threading.Event()
    streamer = threading.Thread(target=_stream_gaps, args=(url, started, gaps))
    streamer.start()
    assert started.wait(60)
    time.sleep(0.5)
    calm = list(gaps)  # the stream's gaps before any big body arrives
    n_calm = len(gaps)
    answers = [_post(url, huge) for _ in range(4)]
    deadline = time.monotonic() + 10  # the gap spanning the posts ends at the next token
    while len(gaps) == n_calm and time.monotonic() < deadline:
        time.sleep(0.01)
    during = gaps[n_calm:]
    streamer.join(120)

    limit = server.server.limits.max_prompt_tokens
    for status, body, took_s in answers:
        assert status == 400, body
        assert body["error"]["param"] == "prompt"
        assert f"allowed: at most {limit} tokens" in body["error"]["message"]
        assert took_s < 2.0, took_s
    assert during, "the stream sent nothing while the big bodies were parsed"
    # The concurrent stream keeps flowing: no gap near the seconds a tokenised 8 MiB would take.
    assert max(during) < max(0.5, 3 * max(calm)), (max(during), max(calm))
