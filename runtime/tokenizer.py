"""Tokenizers: byte-level for random models, HF `tokenizer.json` for real checkpoints.

Both satisfy the `Tokenizer` protocol. `max_bytes_per_token` bounds how much text one token can
stand for, so a server can refuse a prompt that cannot fit before tokenising it (an 8 MiB text
takes seconds to tokenise). `StreamDecoder` turns a growing token stream into text
pieces without ever emitting half a UTF-8 character (a character split across byte tokens, or a
byte-fallback BPE piece, waits until it is complete).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

REPLACEMENT = "\ufffd"


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    # The most UTF-8 bytes of input text one token stands for; None where nothing bounds it.
    # A text of n characters (>= n bytes) encodes to at least n / max_bytes_per_token tokens.
    max_bytes_per_token: int | None

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str: ...


class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes; then BOS, EOS and PAD."""

    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 259
    max_bytes_per_token = 1

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        data = bytearray()
        for i in ids:
            if 0 <= i < 256:
                data.append(i)
            elif not skip_special:
                raise ValueError(f"id {i} is a special token; the byte tokenizer only decodes it "
                                 "with skip_special=True")
            elif i >= self.vocab_size:
                raise ValueError(f"id {i} is outside the byte tokenizer's vocab of "
                                 f"{self.vocab_size}")
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A HuggingFace `tokenizer.json` through the optional `tokenizers` package."""

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError as e:
            raise ImportError("loading tokenizer.json needs the `tokenizers` package") from e
        path = Path(path)
        directory = path if path.is_dir() else path.parent
        file = directory / "tokenizer.json" if path.is_dir() else path
        self._tok = _Tokenizer.from_file(str(file))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        special = _special_tokens(directory / "tokenizer_config.json")
        self.bos_id = self._id_of(special.get("bos_token"))
        self.eos_id = self._id_of(special.get("eos_token"))
        self.max_bytes_per_token = _max_bytes_per_token(
            json.loads(self._tok.to_str()), self._tok.get_vocab(with_added_tokens=True))

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        # encode_batch lets go of the GIL while it works (encode does not): a long text
        # tokenised on a worker thread then leaves the server's event loop running
        ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        return [self.bos_id, *ids] if add_bos and self.bos_id is not None else ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)


# Normalizers and pre-tokenizers that never delete text (a normalizer may shrink it: NFKC maps a
# 4-byte character to a 1-byte one, hence the factor 4 below).
_KEEPING_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend", "Replace"}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split",
                           "UnicodeScripts"}


def _keeps_text(part: dict | None, kinds: set[str]) -> bool:
    if part is None:
        return True
    kind = part.get("type")
    if kind == "Sequence":
        items = part.get("normalizers") or part.get("pretokenizers") or []
        return all(_keeps_text(p, kinds) for p in items)
    if kind == "Replace":  # a string for one no shorter (" " -> "\u2581"), not a pattern
        pattern = (part.get("pattern") or {}).get("String")
        return pattern is not None and len(pattern) <= len(part.get("content") or "")
    if kind == "Split" and part.get("behavior") == "Removed":
        return False
    return kind in kinds


def _max_bytes_per_token(spec: dict, vocab: dict[str, int]) -> int | None:
    """A bound on the input bytes one token stands for, from the tokenizer.json `spec`: a BPE
    model that never falls back to an unknown token (which stands for a word of any length), and
    no normalizer or pre-tokenizer that deletes text; None otherwise."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or (model.get("unk_token") is not None
                                      and not model.get("byte_fallback")):
        return None
    normalizer = spec.get("normalizer")
    if not (_keeps_text(normalizer, _KEEPING_NORMALIZERS)
            and _keeps_text(spec.get("pre_tokenizer"), _KEEPING_PRE_TOKENIZERS)):
        return None
    longest = max((len(token.encode("utf-8")) for token in vocab), default=1)
    return longest * (4 if normalizer is not None else 1)


def _special_tokens(config_file: Path) -> dict[str, str]:
    if not config_file.exists():
        return {}
    raw = json.loads(config_file.read_text())
    out = {}
    for key in ("bos_token", "eos_token"):
        value = raw.get(key)
        if isinstance(value, dict):  # an AddedToken serialised as a dict
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """`ByteTokenizer` when `path` is None, else the HF tokenizer at `path`."""
    return ByteTokenizer() if path is None else HFTokenizer(path)


class StreamDecoder:
    """Incremental detokenisation: `push(id)` returns the text that became final.

    Keeps two offsets into the token list: text before `prefix` has been emitted and is final;
    decoding from `prefix` gives context (for tokenizers whose pieces depend on neighbours). New
    text is emitted only when it does not end in U+FFFD, i.e. no character is still incomplete.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.ids[start:end], skip_special=self.skip_special)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix)
        if len(text) > len(before) and not text.endswith(REPLACEMENT):
            self._prefix, self._read = self._read, len(self.ids)
            return text[len(before):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (incomplete characters come out as U+FFFD)."""
        before = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix)
        self._prefix = self._read = len(self.ids)
        return text[len(before):]
