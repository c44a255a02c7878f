"""The package layout keeps its promises, read from the source (an AST scan of every import, at
the top of a module or inside a function):

- pdsim's arrows point one way. pdsim.core (the scheduler both backends run) imports no other
  pdsim package, pdsim.specs none, pdsim.workload only the core; the deployment config (read by
  both backends) imports no simulator, and the simulator nothing that drives it (planning, the
  runner, validation, the CLI); and pdsim imports no runtime: the real backend builds on pdsim,
  never the reverse. The two modules that drive both backends (`pdsim serve`, `pdsim
  validate`) are the exception, and nothing else in pdsim imports them.
- No import cycle among the modules of pdsim and runtime.
- The PD workers import nothing from the OpenAI front, the KV cache depends on the model config
  alone, and the router side of the real backend (runtime.router, the launcher's router) runs
  without torch.
"""

from __future__ import annotations

import pytest

import ast
import functools
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pdsim", "runtime")

# The pdsim packages a package may import besides itself (the bottom layers).
ONLY_IMPORTS = {
    "pdsim.core": (),
    "pdsim.specs": (),
    "pdsim.workload": ("pdsim.core",),
}
# What a package must never import: the layers above it. The deployment config is what both
# backends read, so it knows no simulator.
NEVER_IMPORTS = {
    "pdsim.deployment": ("pdsim.sim", "pdsim.planning", "pdsim.runner"),
    "pdsim.sim": ("pdsim.planning", "pdsim.runner", "pdsim.validation", "pdsim.cli"),
}
# The only pdsim modules that may import runtime: `pdsim serve` and `pdsim validate` start the
# real backend (validation to compare it with the simulator), so they sit above both backends.
DRIVES_BOTH_BACKENDS = ("pdsim.cli", "pdsim.validation")



@dataclass(frozen=True)
class Import:
    """One import statement's edge: `importer` imports `target`, written at `where`."""

    importer: str
    target: str
    where: str  # file:line
    statement: str

    def __str__(self) -> str:
        return f"{self.where} `{self.statement}`"


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every module of `packages` under `root`."""
    files = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, list[Import]]:
    """Every module -> its imports. `from a import b` is an edge to the module a.b when there is
    one, else to a; relative imports are resolved; imports of other packages are kept too."""
    files = module_files(root, packages)
    graph: dict[str, list[Import]] = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        source = path.read_text()
        edges: list[Import] = []
        for node in ast.walk(ast.parse(source, str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base
                           for a in node.names]
            else:
                continue
            where = f"{path.relative_to(root)}:{node.lineno}"
            statement = " ".join((ast.get_source_segment(source, node) or "").split())
            edges += [Import(module, target, where, statement)
                      for target in dict.fromkeys(targets) if target != module]
        graph[module] = edges
    return graph


@functools.cache
def project_graph() -> dict[str, list[Import]]:
    return import_graph(ROOT, PACKAGES)


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def backward_arrows(graph: dict[str, list[Import]]) -> list[str]:
    """Every import that breaks ONLY_IMPORTS, NEVER_IMPORTS or DRIVES_BOTH_BACKENDS, as
    'where: why'."""
    bad = []
    for module, edges in graph.items():
        for edge in edges:
            why = f"{edge}: {module} imports {edge.target}"
            for package, allowed in ONLY_IMPORTS.items():
                if (within(module, package) and within(edge.target, "pdsim")
                        and not any(within(edge.target, p) for p in (package, *allowed))):
                    bad.append(f"{why}; {package} may import only "
                               f"{', '.join((package, *allowed))} of pdsim")
            for package, above in NEVER_IMPORTS.items():
                bad += [f"{why}; {package} never imports {forbidden}" for forbidden in above
                        if within(module, package) and within(edge.target, forbidden)]
            if (within(module, "pdsim") and within(edge.target, "runtime")
                    and not any(within(module, m) for m in DRIVES_BOTH_BACKENDS)):
                bad.append(f"{why}; pdsim never imports runtime (only "
                           f"{', '.join(DRIVES_BOTH_BACKENDS)} may)")
    return bad


def import_cycles(graph: dict[str, list[Import]]) -> dict[frozenset[str], list[Import]]:
    """Each strongly connected group of modules -> one cycle through it (its import statements,
    in order)."""
    inside = {m: [e for e in edges if e.target in graph] for m, edges in graph.items()}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        order[module] = low[module] = len(order)
        stack.append(module)
        for edge in inside[module]:
            if edge.target not in order:
                visit(edge.target)
                low[module] = min(low[module], low[edge.target])
            elif edge.target in stack:
                low[module] = min(low[module], order[edge.target])
        if low[module] == order[module]:
            group = set()
            while not group or module not in group:
                group.add(stack.pop())
            if len(group) > 1:
                groups.append(group)

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return {frozenset(group): _one_cycle(inside, group) for group in groups}


def _one_cycle(inside: dict[str, list[Import]], group: set[str]) -> list[Import]:
    """The shortest import path from the group's first module back to itself."""
    start = min(group)
    paths: dict[str, list[Import]] = {start: []}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for edge in inside[module]:
                if edge.target == start:
                    return paths[module] + [edge]
                if edge.target in group and edge.target not in paths:
                    paths[edge.target] = paths[module] + [edge]
                    following.append(edge.target)
        frontier = following
    raise AssertionError(f"{sorted(group)} is not a cycle")


def describe(cycle: list[Import]) -> str:
    return " -> ".join([cycle[0].importer] + [f"{e.target} ({e})" for e in cycle])


# ---- pdsim's arrows and cycles -------------------------------------------------------------


@pytest.mark.slow
def test_pdsim_arrows_point_one_way():
    bad = backward_arrows(project_graph())
    assert not bad, "backward imports:\n" + "\n".join(bad)


def test_only_the_modules_driving_both_backends_import_them():
    bad = [f"{edge}: {module} imports {edge.target}, which imports runtime"
           for module, edges in project_graph().items() if within(module, "pdsim")
           and not any(within(module, m) for m in DRIVES_BOTH_BACKENDS)
           for edge in edges if any(within(edge.target, m) for m in DRIVES_BOTH_BACKENDS)]
    assert not bad, "\n".join(bad)


def test_no_import_cycle_among_the_modules():
    cycles = import_cycles(project_graph())
    found = [describe(c) for c in cycles.values()]
    assert not found, "import cycles:\n" + "\n".join(found)


def test_the_scan_finds_cycles_and_backward_arrows(tmp_path):
    """The checks above on a made-up pdsim: a cycle through a function-level import and a
    relative one, a core module importing the simulator, and one importing runtime."""
    sources = {
        "pdsim/__init__.py": "",
        "pdsim/core/__init__.py": "",
        "pdsim/core/queue.py": "from pdsim.sim import cost\n",
        "pdsim/sim/__init__.py": "",
        "pdsim/sim/cost.py": "def f():\n    from .cluster import Cluster\n",
        "pdsim/sim/cluster.py": "import pdsim.sim.cost\nfrom pdsim.core import queue\n",
        "pdsim/specs/__init__.py": "",
        "pdsim/specs/models.py": "from runtime.model.config import PRESETS\n",
        "pdsim/cli.py": "from runtime.launcher import launch\n",
        "runtime/__init__.py": "",
    }
    for name, text in sources.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, PACKAGES)

    bad = backward_arrows(graph)
    assert any(b.startswith("pdsim/core/queue.py:1 `from pdsim.sim import cost`: pdsim.core."
                            "queue imports pdsim.sim.cost") for b in bad), bad
    assert any("pdsim/specs/models.py:1" in b and "pdsim never imports runtime" in b
               for b in bad), bad
    assert not any("pdsim/cli.py" in b for b in bad), bad

    ((group, cycle),) = import_cycles(graph).items()
    assert group == {"pdsim.core.queue", "pdsim.sim.cost", "pdsim.sim.cluster"}
    text = describe(cycle)
    assert "pdsim/sim/cost.py:2 `from .cluster import Cluster`" in text, text
    assert text.startswith("pdsim.core.queue -> pdsim.sim.cost"), text


# ---- runtime --------------------------------------------------------------------------------


def runtime_imports_of(module: str) -> set[str]:
    return {e.target for e in project_graph()[module] if within(e.target, "runtime")}


def test_pd_workers_do_not_import_the_openai_front():
    for module in project_graph():
        if within(module, "runtime.pd"):
            bad = {m for m in runtime_imports_of(module) if within(m, "runtime.openai")}
            assert not bad, f"{module} imports {sorted(bad)}"


def test_kv_cache_depends_on_the_model_config_only():
    assert runtime_imports_of("runtime.model.kv_cache") <= {"runtime.model.config"}


def test_the_loaders_are_shared_not_part_of_the_openai_front():
    for module in ("runtime.model.loading", "runtime.chat_template", "runtime.checks",
                   "runtime.streams", "runtime.sampling"):
        bad = {m for m in runtime_imports_of(module) if within(m, "runtime.openai")}
        assert not bad, f"{module} imports {sorted(bad)}"


def _run_without_torch(code: str) -> None:
    """Run `code` in a fresh interpreter, then fail if it loaded torch or triton, with the stack
    of the first such import (the chain of modules that reached it)."""
    watch = textwrap.dedent("""
        import sys, traceback

        class WatchTorch:
            first = None

            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "triton") and WatchTorch.first is None:
                    stack = [frame for frame in traceback.extract_stack()[:-1]
                             if not frame.filename.startswith("<frozen")]
                    WatchTorch.first = "".join(traceback.format_list(stack))
                return None  # the import goes on as usual

        sys.meta_path.insert(0, WatchTorch())
    """)
    verdict = textwrap.dedent("""
        assert WatchTorch.first is None, "torch or triton was imported here:\\n" + WatchTorch.first
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", watch + textwrap.dedent(code) + verdict],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_importing_the_router_side_loads_no_torch():
    _run_without_torch("""
        import pdsim.cli, runtime.launcher, runtime.openai.server, runtime.router
        import runtime.protocol.step, runtime.protocol.stream, runtime.protocol.transfer
        import runtime.protocol.worker
    """)


def test_the_pd_router_serves_without_torch():
    """The launcher's router side: built for a tiny-mla deployment (its tokenizer, chat template
    and limits), started on loopback, answering /v1/models, closed."""
    _run_without_torch("""
        import asyncio, json, urllib.request
        from runtime.launcher import make_router
        from runtime.serve_config import parse_serve_config

        cfg = parse_serve_config({"model": "tiny-mla", "cluster": {
            "mode": "disaggregated", "prefill": {"instances": 1, "scheduler": {"num_pages": 64}},
            "decode": {"instances": 1, "scheduler": {"num_pages": 64}}}})
        prefill, decode = "http://127.0.0.1:9", "http://127.0.0.1:10"
        health = {prefill: {"bootstrap_host": "127.0.0.1", "bootstrap_port": 11}}

        async def main():
            router = make_router(cfg, [prefill], [decode], health)
            await router.start("127.0.0.1", 0)
            try:
                url = router.url + "/v1/models"
                with await asyncio.to_thread(urllib.request.urlopen, url, timeout=10) as reply:
                    body = reply.read()
                assert json.loads(body)["data"][0]["id"] == cfg.model_name, body
            finally:
                await router.close()

        asyncio.run(main())
    """)
