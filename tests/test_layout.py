"""The package layout keeps its promises: the PD workers import nothing from the OpenAI front,
and the KV cache depends on the model config alone (no import cycle with the model)."""

from __future__ import annotations

import ast
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[1] / "runtime"


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at the top or inside a function."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_pd_workers_do_not_import_the_openai_front():
    for path in sorted((RUNTIME / "pd").glob("*.py")):
        bad = {m for m in imported_modules(path) if m.startswith("runtime.openai")}
        assert not bad, f"{path.name} imports {sorted(bad)}"


def test_kv_cache_depends_on_the_model_config_only():
    runtime_imports = {m for m in imported_modules(RUNTIME / "model" / "kv_cache.py")
                       if m.startswith("runtime.")}
    assert runtime_imports <= {"runtime.model.config", "runtime.model.config.ModelConfig"}


def test_the_loaders_are_shared_not_part_of_the_openai_front():
    for path in (RUNTIME / "model" / "loading.py", RUNTIME / "chat_template.py",
                 RUNTIME / "checks.py", RUNTIME / "streams.py"):
        bad = {m for m in imported_modules(path) if m.startswith("runtime.openai")}
        assert not bad, f"{path.name} imports {sorted(bad)}"
