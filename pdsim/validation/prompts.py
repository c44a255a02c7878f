"""Prompts of an exact token length for the replay: token ids, or text built with the
endpoint's own tokenizer.

An endpoint that takes token ids (SGLang's `/generate` `input_ids`, the `prompt` of
`/v1/completions` as a list of ids on SGLang, vLLM and `pdsim serve`) gets exactly the ids
sent. One that takes text counts what its tokenizer makes of it, special tokens (a BOS)
included, so the text is built with the model's `tokenizer.json` until it encodes to the
length wanted; the endpoint's reported `usage` then confirms it (pdsim.validation.lengths).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pdsim.config import ConfigError

PROMPT_VOCAB = 256  # prompt ids are drawn below this: every servable preset's vocabulary holds them
TEXT_TRIES = 50
MIN_SPACED_WORDS = 16


def id_prompts(input_tokens: Sequence[int], seed: int) -> list[list[int]]:
    """One random prompt of exactly `n` token ids per request (seeded)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, PROMPT_VOCAB, int(n)).tolist() for n in input_tokens]


class TextPrompts:
    """Text prompts that a `tokenizer.json` encodes to an exact number of tokens.

    Words are drawn from the vocabulary's tokens that decode to plain text and encode back to
    themselves alone (those that begin with a space where there are enough); neighbours may
    still merge or split, so the draft is re-encoded and trimmed or extended until its length
    is exact.
    """

    def __init__(self, tokenizer_dir: str | Path) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise ConfigError("--tokenizer needs the `tokenizers` package") from exc
        path = Path(tokenizer_dir)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ConfigError(f"--tokenizer {tokenizer_dir}: no tokenizer.json there")
        try:
            self.tok = Tokenizer.from_file(str(file))
        except Exception as exc:  # the library raises a bare Exception on a bad file
            raise ConfigError(f"--tokenizer {file}: cannot load it: {exc}") from None
        self.path = file
        # What the endpoint's tokenizer adds to every prompt (a BOS, a template's tokens).
        self.special = len(self.tok.encode("", add_special_tokens=True).ids)
        specials = {t.content for t in self.tok.get_added_tokens_decoder().values()}
        words = {i: text for tok, i in self.tok.get_vocab().items() if tok not in specials
                 and (text := self.tok.decode([i])).isprintable() and text.strip()
                 and self.tok.encode(text, add_special_tokens=False).ids == [i]}
        # Words that begin with a space do not merge with the word before them where the
        # tokenizer splits at spaces first (byte-level BPE, SentencePiece): prefer them.
        spaced = sorted(i for i, text in words.items() if text.startswith(" "))
        self.words = np.array(spaced if len(spaced) >= MIN_SPACED_WORDS else sorted(words))
        if not len(self.words):
            raise ConfigError(f"--tokenizer {file}: no token of its vocabulary decodes to "
                              "plain text that encodes back to itself")

    def count(self, text: str) -> int:
        """Tokens the endpoint's tokenizer makes of `text`, special tokens included."""
        return len(self.tok.encode(text, add_special_tokens=True).ids)

    def prompt(self, n_tokens: int, rng: np.random.Generator) -> str:
        want = n_tokens - self.special
        if want < 1:
            raise ConfigError(f"a prompt of {n_tokens} tokens: {self.path} adds {self.special} "
                              "special tokens to every prompt, so a prompt holds at least "
                              f"{self.special + 1}")
        ids = rng.choice(self.words, want).tolist()
        for _ in range(TEXT_TRIES):
            text = self.tok.decode(ids)
            got = self.tok.encode(text, add_special_tokens=False).ids
            if len(got) == want:
                return text
            ids = got[:want] if len(got) > want else got + rng.choice(
                self.words, want - len(got)).tolist()
        raise ConfigError(f"{self.path}: no text of exactly {n_tokens} tokens after {TEXT_TRIES} "
                          "tries (its tokens merge across word boundaries); send token ids "
                          "instead (no --tokenizer, or --api generate)")

    def prompts(self, input_tokens: Sequence[int], seed: int) -> list[str]:
        rng = np.random.default_rng(seed)
        return [self.prompt(int(n), rng) for n in input_tokens]
