"""Tokenizers: byte-level for random models, HF `tokenizer.json` for real checkpoints.

Both satisfy the `Tokenizer` protocol. `StreamDecoder` turns a growing token stream into text
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

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str: ...


class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes; then BOS, EOS and PAD."""

    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 259

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

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos and self.bos_id is not None else ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)


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
