"""Where NVIDIA's measured kernel tables live, and which of them a run reads.

The `aiconfigurator-core` package (Apache-2.0) ships per-op latency tables measured on real
GPUs under `aiconfigurator_core/systems/data/<system>/<op>/<framework>/<version>/*.parquet`.
pdsim reads only those files (never the package's estimator code), located without importing
the package.

Version choice: a framework version (default: the package's "current" one for the system, from
its `query_versions.yaml`); each table comes from the newest version directory at or below it
that holds the table, so an op measured only for an older release still serves (backward fill).
NCCL tables sit under `comm/nccl/<nccl version>/` and are framework-independent: the newest.
"""

from __future__ import annotations

import importlib.util
import re
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:
    import pandas as pd

    from pdsim.specs.hardware import HardwareSpec

PACKAGE = "aiconfigurator_core"
INSTALL_HINT = "pip install 'pdsim[silicon]' (aiconfigurator-core==0.12.0)"

# pdsim hardware preset → aiconfigurator system (SXM boards; the PCIe variants ship no tables).
SYSTEMS: dict[str, str] = {
    "a100": "a100_sxm",
    "h100": "h100_sxm",
    "h200": "h200_sxm",
    "b200": "b200_sxm",
    "b300": "b300_sxm",
    "gb200": "gb200",
    "gb300": "gb300",
    "l40s": "l40s",
}
FRAMEWORKS = ("sglang", "trtllm", "vllm")


@lru_cache(maxsize=1)
def systems_dir() -> Path | None:
    """The package's `systems/` folder, or None when aiconfigurator-core is not installed."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "systems"
    return path if (path / "data").is_dir() else None


def require_systems_dir() -> Path:
    path = systems_dir()
    if path is None:
        raise ValueError(f"the silicon cost model needs NVIDIA's kernel tables: {INSTALL_HINT}")
    return path


def system_for(hardware: HardwareSpec) -> str | None:
    """The aiconfigurator system measured for a hardware spec, if tables exist for it: its
    preset's, or those of the preset it names as `silicon_base` (the same die)."""
    system = SYSTEMS.get(hardware.silicon_base or hardware.name)
    root = systems_dir()
    if system is None or root is None or not (root / "data" / system / "gemm").is_dir():
        return None
    return system


def preset_for(system: str) -> str | None:
    """The pdsim hardware preset of the GPU an aiconfigurator system was measured on."""
    return next((preset for preset, name in SYSTEMS.items() if name == system), None)


def has_tables(hardware: HardwareSpec) -> bool:
    return system_for(hardware) is not None


_SUFFIX = {"rc": -1, ".dev": -2, ".post": 1}


def _version(text: str) -> tuple[int, ...] | None:
    """A sortable key for "0.5.14", "0.5.6.post2", "1.3.0rc20" (rc and dev sort before the
    release, post after); None for a name that is not a version."""
    match = re.fullmatch(r"(\d+(?:\.\d+)*)(?:(rc|\.post|\.dev)(\d+))?", text)
    if match is None:
        return None
    release = tuple(int(x) for x in match.group(1).split("."))
    release += (0,) * (4 - len(release))
    suffix = (_SUFFIX[match.group(2)], int(match.group(3))) if match.group(2) else (0, 0)
    return release + suffix


@lru_cache(maxsize=None)
def current_version(system: str, framework: str) -> str:
    """The package's "current" release of `framework` for `system` (query_versions.yaml)."""
    data = yaml.safe_load((require_systems_dir() / "query_versions.yaml").read_text())
    slot = (data.get("overrides", {}).get(system, {}) or {}).get(framework)
    slot = slot or data["defaults"][framework]
    return str(slot["current"])


@lru_cache(maxsize=None)
def table_paths(system: str, op: str, framework: str, version: str, file: str) -> tuple[Path, ...]:
    """Every `<op>/<framework>/<v>/<file>` with v <= version, newest first."""
    root = require_systems_dir() / "data" / system / op / framework
    if not root.is_dir():
        return ()
    limit = _version(version)
    found = [(v, child / file) for child in root.iterdir()
             if (v := _version(child.name)) is not None and (limit is None or v <= limit)
             and (child / file).is_file()]
    return tuple(path for _, path in sorted(found, reverse=True))


def table_path(system: str, op: str, framework: str, version: str, file: str) -> Path | None:
    """The newest `<op>/<framework>/<v>/<file>` with v <= version (None if there is none)."""
    paths = table_paths(system, op, framework, version, file)
    return paths[0] if paths else None


@lru_cache(maxsize=None)
def gpus_per_node(system: str) -> int:
    """GPUs in one node of the machines `system` was measured on (its system file's
    `node.num_gpus_per_node`): 8 on HGX boards, 4 on a GB200/GB300 compute tray. The DeepEP
    tables' `node_num` counts these nodes; their single-node rows ran on every GPU of one."""
    path = require_systems_dir() / f"{system}.yaml"
    node = (yaml.safe_load(path.read_text()) or {}).get("node") or {}
    if "num_gpus_per_node" not in node:
        raise ValueError(f"silicon: {path} names no node.num_gpus_per_node; the DeepEP tables' "
                         f"node counts cannot be read without it")
    return int(node["num_gpus_per_node"])


@lru_cache(maxsize=None)
def nccl_path(system: str) -> Path | None:
    root = require_systems_dir() / "data" / system / "comm" / "nccl"
    if not root.is_dir():
        return None
    found = [(v, p) for p in root.iterdir()
             if (v := _version(p.name)) is not None and (p / "nccl_perf.parquet").is_file()]
    return max(found)[1] / "nccl_perf.parquet" if found else None


@lru_cache(maxsize=64)
def read_table(path: Path) -> pd.DataFrame:
    """A parquet table (cached: every cost-model instance of a run shares it)."""
    import pandas as pd  # here, not at import: pandas takes ~0.25 s to import

    return pd.read_parquet(path)


def versions_of(system: str, framework: str) -> list[str]:
    """Every version directory any op of `system` has for `framework` (for error messages)."""
    root = require_systems_dir() / "data" / system
    names = {v.name for op in root.iterdir() if (op / framework).is_dir()
             for v in (op / framework).iterdir() if v.is_dir()}
    return sorted(names, key=lambda n: _version(n) or (0,))
