"""The `real` marker is where it must be: a test that imports a module that starts the real
backend (torch model forwards, Mooncake, ZMQ, HTTP servers, worker processes) is marked `real`,
so `-m "not real"` never starts one. Read from the source (ast), so it costs nothing to run.

An import at module level needs the module marked (`pytestmark`); one inside a test function
needs that test (or its class, or the module) marked; one inside a helper or fixture needs the
module to mark some test `real` (a decorator or a `pytest.param(..., marks=...)`), since which
tests reach the helper is not visible statically. A test that starts real servers only through a
`pdsim` subprocess is out of its sight: mark those by hand.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from markers import marks_in, module_marks

TESTS = Path(__file__).resolve().parent

# Modules whose use starts real components (or, for torch, runs model forwards). A name covers
# its submodules.
REAL_MODULES = (
    "torch", "mooncake", "zmq", "aiohttp", "pd_harness",
    "runtime.launcher", "runtime.router", "runtime.driver", "runtime.executor",
    "runtime.model", "runtime.kernels", "runtime.distributed", "runtime.calibration",
    "runtime.openai.server", "runtime.pd.worker", "runtime.pd.http", "runtime.pd.lockstep_engine",
    "runtime.pd.kv", "runtime.transfer.mooncake", "runtime.transfer.mooncake_engine",
    "runtime.transfer.bootstrap_server", "runtime.transfer.channel", "runtime.transfer.prefill",
    "runtime.transfer.decode",
)


def _is_real(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in REAL_MODULES)


def _imported(node: ast.AST) -> list[str]:
    """Module names an import statement loads (`from a import b`: `a`, and `a.b` in case `b` is
    a submodule)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
        if _is_real(node.module):
            return [node.module]
        return [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return []


def _real_imports(node: ast.AST) -> list[str]:
    return sorted({m for n in ast.walk(node) for m in _imported(n) if _is_real(m)})


def _marks_real(node: ast.AST) -> bool:
    return "real" in marks_in(node)


def unmarked_real_tests(source: str) -> list[str]:
    """What in a test file's `source` starts real components without the `real` mark."""
    tree = ast.parse(source)
    if "real" in module_marks(tree):
        return []
    problems = []
    top_level = [stmt for stmt in tree.body if isinstance(stmt, (ast.Import, ast.ImportFrom))]
    if found := sorted({m for stmt in top_level for m in _real_imports(stmt)}):
        problems.append(f"module level imports {', '.join(found)}: needs pytestmark with "
                        "pytest.mark.real")
    marks_some_test = _marks_real(tree)
    for stmt in tree.body:
        if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        found = _real_imports(stmt)
        if not found:
            continue
        if stmt.name.startswith(("test_", "Test")):
            if not any(_marks_real(d) for d in stmt.decorator_list):
                problems.append(f"{stmt.name} imports {', '.join(found)}: needs "
                                "@pytest.mark.real")
        elif not marks_some_test:
            problems.append(f"{stmt.name} (a helper) imports {', '.join(found)}: mark the tests "
                            "that use it real")
    return problems


@pytest.mark.parametrize("path", sorted(TESTS.glob("test_*.py")), ids=lambda p: p.name)
def test_tests_that_start_real_components_are_marked_real(path: Path) -> None:
    assert unmarked_real_tests(path.read_text()) == []


def test_the_check_finds_each_kind_of_unmarked_import() -> None:
    module_level = "import pytest\nfrom runtime.transfer.mooncake import MooncakeKVManager\n"
    assert unmarked_real_tests(module_level) == [
        "module level imports runtime.transfer.mooncake: needs pytestmark with pytest.mark.real"]
    assert unmarked_real_tests("import pytest\npytestmark = [pytest.mark.real]\n"
                               + module_level) == []
    in_test = "import pytest\n\ndef test_x():\n    import torch\n"
    assert unmarked_real_tests(in_test) == ["test_x imports torch: needs @pytest.mark.real"]
    assert unmarked_real_tests(in_test.replace("def test_x", "@pytest.mark.real\ndef test_x")) \
        == []
    in_helper = ("import pytest\n\ndef pair():\n    from pd_harness import start_worker\n\n"
                 "@pytest.mark.parametrize('make', [pair])\ndef test_y(make):\n    make()\n")
    assert unmarked_real_tests(in_helper) == [
        "pair (a helper) imports pd_harness: mark the tests that use it real"]
    assert unmarked_real_tests(in_helper.replace(
        "[pair]", "[pytest.param(pair, marks=pytest.mark.real)]")) == []
    # what is not the real backend needs no mark
    assert unmarked_real_tests("from runtime.serve_config import parse_serve_config\n"
                               "from runtime.protocol.worker import parse_generate\n") == []
