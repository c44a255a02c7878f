"""Loading what a serve config names: the model (a preset's seeded random weights or a
checkpoint), its tokenizer, chat template and EOS ids. Used by the colocated server and by the
PD workers and router alike."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.chat_template import ChatTemplate
from runtime.tokenizer import ByteTokenizer, Tokenizer

if TYPE_CHECKING:
    from runtime.serve_config import PDServeConfig, ServeConfig


@dataclass(frozen=True)
class TextSide:
    """What turns requests into token ids and back, for a served model."""

    tokenizer: Tokenizer
    chat_template: ChatTemplate
    eos_ids: list[int]

    def vocab_limit(self, model_vocab: int) -> int:
        """Sample among the tokenizer's ids only (the tiny presets have more model ids)."""
        return min(self.tokenizer.vocab_size, model_vocab)


def model_config_of(config: ServeConfig | PDServeConfig):
    """The `ModelConfig` a serve config names (the preset or the checkpoint's config.json), with
    its dtype override; no weights are loaded."""
    from runtime.model import ModelConfig

    if config.is_preset:
        model_cfg = ModelConfig.preset(config.model)
    else:
        model_cfg = ModelConfig.from_hf_config(Path(config.model).expanduser())
    return model_cfg.with_(dtype=config.dtype) if config.dtype is not None else model_cfg


def load_text_side(config: ServeConfig | PDServeConfig, model_vocab: int) -> TextSide:
    """The tokenizer (the config's, the checkpoint's tokenizer.json, else byte-level), the chat
    template and the EOS ids of a served model."""
    from runtime.tokenizer import HFTokenizer

    template = ChatTemplate()
    eos_ids: list[int] = []
    directory = None if config.is_preset else Path(config.model).expanduser()
    if directory is not None:
        eos_ids = _generation_eos(directory)
    tok_path = config.tokenizer
    if tok_path is None and directory is not None and (directory / "tokenizer.json").is_file():
        tok_path = str(directory)
    if tok_path is not None:
        tokenizer: Tokenizer = HFTokenizer(tok_path)
        tok_dir = Path(tok_path) if Path(tok_path).is_dir() else Path(tok_path).parent
        template = ChatTemplate.from_tokenizer_config(tok_dir)
    else:
        tokenizer = ByteTokenizer()
        if directory is not None:
            template = ChatTemplate.from_tokenizer_config(directory)
    if tokenizer.vocab_size > model_vocab and tok_path is None:
        raise ValueError(f"model {config.model}: vocab_size {model_vocab} cannot hold the "
                         f"byte tokenizer's {tokenizer.vocab_size} ids; give a tokenizer")
    if tokenizer.eos_id is not None and tokenizer.eos_id not in eos_ids:
        eos_ids.append(tokenizer.eos_id)
    return TextSide(tokenizer, template, eos_ids)


def resolve_device(device: str) -> str:
    """"auto" -> cuda when available, else cpu."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_served_model(config: ServeConfig | PDServeConfig, device: str):
    """The model a serve config names: a preset's seeded random weights, or a checkpoint."""
    from runtime.model import build_model, load_model

    if config.is_preset:
        return build_model(model_config_of(config), seed=config.seed, device=device)
    return load_model(Path(config.model).expanduser(), device=device, dtype=config.dtype)


def _generation_eos(directory: Path) -> list[int]:
    file = directory / "generation_config.json"
    if not file.is_file():
        return []
    eos = json.loads(file.read_text()).get("eos_token_id")
    if isinstance(eos, int):
        return [eos]
    return [int(e) for e in eos] if isinstance(eos, list) else []
