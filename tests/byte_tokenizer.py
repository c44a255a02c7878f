"""A tokenizer.json for the tiny presets, for the real clients that need one (aiperf, the
replay's text prompts): built with the `tokenizers` library, nothing downloaded."""

from __future__ import annotations

from pathlib import Path


def byte_tokenizer(directory: Path) -> Path:
    """A byte-level BPE tokenizer.json with no merges: token i is byte i, the tiny presets'
    byte vocabulary (runtime/tokenizer.py), with no BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # The byte-level alphabet: printable Latin-1 bytes stand for themselves, the others for
    # code points from 256 up, in byte order.
    plain = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
             *range(ord("®"), ord("ÿ") + 1)}
    chars, extra = {}, 0
    for b in range(256):
        chars[chr(b) if b in plain else chr(256 + extra)] = b
        extra += b not in plain
    tok = Tokenizer(models.BPE(vocab=chars, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096}')
    return directory
