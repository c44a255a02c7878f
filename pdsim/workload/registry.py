"""Spec classes looked up by the name a config gives (`process: gamma`, `dist: lognormal`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

M = TypeVar("M", bound=BaseModel)


class Registry(Generic[M]):
    """Spec classes by name; the name is the default of the class's tag field (`process`, `dist`).

    `parse` is a pydantic before-validator: it reads the tag from a mapping and validates the
    mapping with the registered class, so errors carry the field path and list the allowed names.
    """

    def __init__(self, kind: str, tag: str) -> None:
        self.kind = kind
        self.tag = tag
        self._classes: dict[str, type[M]] = {}

    def register(self, cls: type[M]) -> type[M]:
        field = cls.model_fields.get(self.tag)
        name = None if field is None else field.default
        if not isinstance(name, str) or not name:
            raise TypeError(f"{cls.__qualname__} must declare `{self.tag}: Literal[<name>] = <name>`")
        if name in self._classes:
            raise ValueError(
                f"{self.kind} {name!r} is already registered (by {self._classes[name].__qualname__})"
            )
        self._classes[name] = cls
        return cls

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._classes))

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def __getitem__(self, name: str) -> type[M]:
        try:
            return self._classes[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; allowed: {', '.join(self.names())}") from None

    def parse(self, value: Any) -> Any:
        if not isinstance(value, Mapping):
            return value  # an instance passes through; anything else fails pydantic's type check
        if self.tag not in value:
            details = InitErrorDetails(type="missing", loc=(self.tag,), input=dict(value))
            raise ValidationError.from_exception_data(self.kind, [details])
        name = value[self.tag]
        if not isinstance(name, str) or name not in self._classes:
            message = f"unknown {self.kind} {name!r}; allowed: {', '.join(self.names())}"
            error = PydanticCustomError("unknown_name", message)
            details = InitErrorDetails(type=error, loc=(self.tag,), input=name)
            raise ValidationError.from_exception_data(self.kind, [details])
        return self._classes[name].model_validate(dict(value))


class Spec(BaseModel):
    """Base of every workload config model: frozen, unknown keys rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)
