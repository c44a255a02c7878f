"""The one rule: pdsim.core imports no simpy, torch, triton, zmq, aiohttp, mooncake or ray."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pdsim.core

FORBIDDEN = ("simpy", "torch", "triton", "zmq", "aiohttp", "mooncake", "ray")
CORE_DIR = pathlib.Path(pdsim.core.__path__[0])

# Run before anything else in a fresh interpreter: any import of a forbidden module (or of a
# submodule of one) raises, even if it is installed.
BLOCKER = f"""
import importlib.abc, sys
FORBIDDEN = {FORBIDDEN!r}

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in FORBIDDEN:
            raise ImportError(f"pdsim.core must not import {{name}}")
        return None

sys.meta_path.insert(0, Blocker())
for mod in list(sys.modules):
    if mod.split(".")[0] in FORBIDDEN:
        del sys.modules[mod]
"""

IMPORT_ALL = """
import importlib, pkgutil
import pdsim.core
names = sorted(m.name for m in pkgutil.walk_packages(pdsim.core.__path__, "pdsim.core."))
for name in names:
    importlib.import_module(name)
leaked = sorted(m for m in sys.modules if m.split(".")[0] in FORBIDDEN)
assert not leaked, leaked
print(" ".join(names))
"""


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_every_core_module_imports_with_the_heavy_modules_blocked():
    proc = run_python(BLOCKER + IMPORT_ALL)
    assert proc.returncode == 0, proc.stderr
    imported = set(proc.stdout.split())
    on_disk = {f"pdsim.core.{p.stem}" for p in CORE_DIR.glob("*.py") if p.stem != "__init__"}
    assert on_disk and on_disk <= imported
    for name in ("scheduler", "prefill", "decode", "running", "router", "fake_transfer", "kvpoll"):
        assert f"pdsim.core.{name}" in imported


def test_the_blocker_really_blocks():
    proc = run_python(BLOCKER + "import simpy")
    assert proc.returncode != 0 and "pdsim.core must not import simpy" in proc.stderr
    proc = run_python(BLOCKER + "import zmq.asyncio")
    assert proc.returncode != 0 and "must not import zmq" in proc.stderr


def _imported_roots(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    roots = set()
    for node in ast.walk(tree):  # also imports nested in functions or `if TYPE_CHECKING`
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
            "import_module", "__import__"
        ):
            for arg in node.args[:1]:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    roots.add(arg.value.split(".")[0])
    return roots


def test_no_core_file_names_a_forbidden_module():
    files = sorted(CORE_DIR.rglob("*.py"))
    assert len(files) >= 10
    offenders = {
        str(f.relative_to(CORE_DIR)): sorted(_imported_roots(f) & set(FORBIDDEN)) for f in files
    }
    assert {f: bad for f, bad in offenders.items() if bad} == {}
    line = re.compile(rf"^\s*(import|from)\s+({'|'.join(FORBIDDEN)})\b", re.MULTILINE)
    assert [str(f) for f in files if line.search(f.read_text())] == []


def test_no_core_file_reads_a_clock():
    """Time comes in as an argument: the core never asks for it."""
    for f in sorted(CORE_DIR.rglob("*.py")):
        roots = _imported_roots(f)
        assert not roots & {"time", "datetime", "asyncio", "threading"}, f
