"""Chat messages -> prompt text, for the OpenAI front and the PD router.

Chat prompts use the checkpoint's Jinja `chat_template` when its `tokenizer_config.json` has one
(and jinja2 is installed); otherwise this template, for byte-level models:

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n ... <|assistant|>\\n

that is, `<|{role}|>` + newline + content + newline per message, then `<|assistant|>` + newline,
after the BOS token.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

from runtime.checks import BadRequest

log = logging.getLogger(__name__)


class ChatTemplate:
    """Messages -> prompt text. The default is the byte-level template of the module docstring;
    `from_tokenizer_config` uses a checkpoint's Jinja template."""

    def __init__(self, jinja_source: str | None = None, bos_token: str = "",
                 eos_token: str = "") -> None:
        self._template = None
        self.bos_token, self.eos_token = bos_token, eos_token
        if jinja_source is not None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(jinja_source)

    @classmethod
    def from_tokenizer_config(cls, directory: Path) -> ChatTemplate:
        """The Jinja template of `directory/tokenizer_config.json`, else the default."""
        file = directory / "tokenizer_config.json"
        if not file.is_file():
            return cls()
        raw = json.loads(file.read_text())
        source = raw.get("chat_template")
        if not isinstance(source, str):
            return cls()
        if importlib.util.find_spec("jinja2") is None:
            log.warning("%s has a chat_template but jinja2 is not installed; using the default "
                        "template", file)
            return cls()

        def token(key: str) -> str:
            value = raw.get(key) or ""
            return value.get("content", "") if isinstance(value, dict) else str(value)

        return cls(source, token("bos_token"), token("eos_token"))

    @property
    def is_jinja(self) -> bool:
        return self._template is not None

    def render(self, messages: list[dict[str, str]]) -> str:
        if self._template is None:
            turns = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
            return turns + "<|assistant|>\n"
        return self._template.render(messages=messages, add_generation_prompt=True,
                                     bos_token=self.bos_token, eos_token=self.eos_token)


def _raise_template_error(message: str) -> None:
    raise BadRequest("messages", f"the chat template rejected the messages: {message}")
