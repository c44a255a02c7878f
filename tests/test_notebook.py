"""notebooks/capacity_planning.ipynb runs top to bottom (nbclient, from the notebook's folder),
so it cannot rot; and it is committed with its outputs stripped."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "capacity_planning.ipynb"


def _text(cell) -> str:
    parts = []
    for out in cell.outputs:
        parts.append(out.get("text", ""))
        parts.append(out.get("data", {}).get("text/plain", ""))
    return "".join(parts)


def test_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code
    for cell in code:
        assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


@pytest.mark.slow
def test_notebook_executes_and_reaches_a_recommendation():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # Any cell error raises CellExecutionError and fails the test.
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    text = "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")
    assert "recommended: " in text and "bottleneck: " in text
    assert "sglang.launch_server" in text and "--disaggregation-mode" in text
    assert any(o.get("data", {}).get("image/png") for c in nb.cells if c.cell_type == "code"
               for o in c.outputs)  # the frontier plot, inline
