"""Heavy libraries load only where they are used: a simulation does not pay pandas',
matplotlib's or torch's import time, and pool workers that import the runner do not load
matplotlib."""

import subprocess
import sys

import pytest


def _loaded_after(imports: str, then: str = "") -> set[str]:
    code = (f"import sys\nimport {imports}\n{then}\n"
            "print(' '.join(m for m in ('pandas', 'matplotlib', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_simulating_imports_neither_pandas_nor_matplotlib():
    assert _loaded_after("pdsim.sim.build, pdsim.sim.cluster, pdsim.sim.silicon, pdsim.metrics,"
                         " pdsim.workload, pdsim.config") == set()


@pytest.mark.slow
def test_runner_leaves_matplotlib_to_plotting():
    assert _loaded_after("pdsim.runner") == {"pandas"}
    assert _loaded_after("pdsim.runner, pdsim.plots") == {"pandas", "matplotlib"}


@pytest.mark.slow
def test_reading_a_model_preset_leaves_torch_to_the_real_backend():
    """The presets both backends share live in runtime/model/config.py, which is torch-free;
    `runtime.model` itself imports its torch modules only when one of their names is used."""
    read = "from pdsim.specs import load_model_spec; load_model_spec('tiny-llama')"
    assert _loaded_after("pdsim.specs", read) == set()
    assert _loaded_after("runtime.model", "from runtime.model import build_model") == {"torch"}
