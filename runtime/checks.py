"""Checks on request bodies shared by every HTTP front (the OpenAI server and the PD workers'
internal API): a `BadRequest` names the field, the bad value and what is allowed."""

from __future__ import annotations

import json
from typing import Any


class BadRequest(Exception):
    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def short_repr(value: Any, limit: int = 60) -> str:
    """`repr(value)` cut to `limit` characters, for error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_json(raw: bytes) -> Any:
    """A request body's JSON, or `BadRequest` (also for nesting or numbers too deep or big)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError too
        raise BadRequest(None, f"the body is not valid JSON: {short_repr(str(exc), 200)}") from None


def check_token_ids(param: str, ids: Any, vocab: int, *, empty_ok: bool) -> list[int]:
    """`ids` as a list of token ids in `0..vocab-1`, else `BadRequest` naming `param`."""
    if not (isinstance(ids, list) and (ids or empty_ok) and all(is_int(t) for t in ids)):
        raise BadRequest(param, f"{param}={short_repr(ids)}; allowed: a "
                         f"{'' if empty_ok else 'non-empty '}list of token ids")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise BadRequest(param, f"token ids {short_repr(bad[:5])} are outside the vocabulary; "
                         f"allowed: 0..{vocab - 1}")
    return ids


def check_text(param: str, text: str) -> str:
    """`text`, if it is valid Unicode (JSON's `\\ud800` escapes give unpaired surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRequest(param, f"{param} holds an unpaired surrogate at character {exc.start}; "
                         "allowed: valid UTF-8 text") from None
    return text
