"""Where a spec comes from: a preset name, a file, or a mapping of fields over a `base`.

An experiment YAML names its model and hardware in any of these ways; a relative file path is
looked for in the experiment's folder first, then in the current directory (as trace paths are).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

SpecT = TypeVar("SpecT", bound=BaseModel)


def find_spec_file(
    value: str | Path, base_dir: str | Path | None = None, *, dirs: bool = False
) -> tuple[Path | None, list[Path]]:
    """The file `value` names (a directory too if `dirs`), and every place that was tried.

    An absolute path is taken as is; a relative one under `base_dir` (the experiment's
    folder), then under the current directory."""
    given = Path(value).expanduser()
    if given.is_absolute():
        candidates = [given]
    else:
        candidates = [Path(base_dir) / given] if base_dir is not None else []
        candidates.append(Path.cwd() / given)
    for candidate in candidates:
        if candidate.is_file() or (dirs and candidate.is_dir()):
            return candidate, candidates
    return None, candidates


def not_found(
    kind: str, value: str | Path, presets: list[str], tried: list[Path], files: str
) -> str:
    """The error for a spec that is neither a preset nor a file, with every place looked at."""
    looked = ", ".join(str(p) for p in dict.fromkeys(tried))
    return (
        f"unknown {kind} {str(value)!r}: not a preset ({', '.join(presets)}) nor {files} "
        f"(looked at {looked})"
    )


def merge_fields(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `overrides` on top; nested mappings (a model's `precision`) merge key by key."""
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge_fields(merged[key], value)
        else:
            merged[key] = value
    return merged


def validate_fields(cls: type[SpecT], data: Mapping[str, Any], where: str) -> SpecT:
    """`cls` built from `data`; ValueError naming `where`, each bad field (an unknown key inside
    a nested block with that block's keys) and the fields allowed."""
    try:
        return cls.model_validate(dict(data))
    except ValidationError as err:
        problems = "; ".join(_problem(cls, e) for e in err.errors())
        allowed = ", ".join(["base", *cls.model_fields])
        raise ValueError(f"{where}: {problems}; fields: {allowed}") from None


def _problem(cls: type[BaseModel], error: Mapping[str, Any]) -> str:
    loc = error["loc"]
    text = f"{'.'.join(str(p) for p in loc) or '<root>'}: {error['msg']}"
    if loc and error["type"] != "missing":
        text += f" (got {error['input']!r})"
    block = _block(cls, loc[:-1]) if error["type"] == "extra_forbidden" and len(loc) > 1 else None
    if block is not None:
        text += f" (allowed in {'.'.join(map(str, loc[:-1]))}: {', '.join(block.model_fields)})"
    return text


def _block(cls: type[BaseModel], path: tuple) -> type[BaseModel] | None:
    """The nested model a field path of `cls` leads to, or None."""
    for name in path:
        field = cls.model_fields.get(name) if isinstance(name, str) else None
        kind = field.annotation if field is not None else None
        if not (isinstance(kind, type) and issubclass(kind, BaseModel)):
            return None
        cls = kind
    return cls


def read_mapping(path: Path, expected: str, *, as_json: bool = False) -> dict[str, Any]:
    """The mapping a YAML (or, `as_json`, JSON) file holds; errors name the file and what it
    should have held (`expected`)."""
    if as_json:
        import json

        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from None
    else:
        import yaml

        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            raise ValueError(f"{path}: not valid YAML ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected {expected}")
    return data


def read_spec_yaml(path: Path, cls_name: str) -> dict[str, Any]:
    """The fields a YAML spec file holds; named after the file unless it names itself or
    starts from a `base` (which keeps the base's name)."""
    data = read_mapping(path, f"a mapping of {cls_name} fields")
    if "base" not in data:
        data.setdefault("name", path.stem)
    return data
