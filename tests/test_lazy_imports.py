"""Heavy libraries load only where they are used: a simulation does not pay pandas' or
matplotlib's import time, and pool workers that import the runner do not load matplotlib."""

import subprocess
import sys


def _loaded_after(imports: str) -> set[str]:
    code = (f"import sys\nimport {imports}\n"
            "print(' '.join(m for m in ('pandas', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_simulating_imports_neither_pandas_nor_matplotlib():
    assert _loaded_after("pdsim.sim.build, pdsim.sim.cluster, pdsim.sim.silicon, pdsim.metrics,"
                         " pdsim.workload, pdsim.config") == set()


def test_runner_leaves_matplotlib_to_plotting():
    assert _loaded_after("pdsim.runner") == {"pandas"}
    assert _loaded_after("pdsim.runner, pdsim.plots") == {"pandas", "matplotlib"}
