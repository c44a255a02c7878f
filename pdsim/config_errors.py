"""One way to report a config that does not validate, for experiments and serve configs alike:
the file, then one line per problem with its field path, what is wrong, the value given and
(for an unknown key) the keys that are allowed there."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError


def allowed_keys(root: type[BaseModel], loc: tuple) -> list[str]:
    """The field names of the model found at `loc[:-1]` below `root`."""
    model: Any = root
    for part in loc[:-1]:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = field.annotation
        if getattr(model, "__args__", None):  # `X | None`: the model in it
            model = next((a for a in model.__args__ if hasattr(a, "model_fields")), model)
    return sorted(getattr(model, "model_fields", {}))


def format_validation_error(exc: ValidationError, source: str, what: str,
                            root: type[BaseModel]) -> str:
    lines = [f"{source}: invalid {what}"]
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = f"unknown key (allowed: {', '.join(allowed_keys(root, err['loc']))})"
        value = err.get("input")
        shown = "" if isinstance(value, dict) else f" (got {value!r})"
        lines.append(f"  {path}: {msg}{shown}")
    return "\n".join(lines)
