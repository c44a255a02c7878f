"""Test-wide settings, the public traces fixture, and a -m that skips whole files unimported."""

import ast
import os
from pathlib import Path

import pytest

from markers import module_marks, rules_out_every_test

# Mooncake's transfer engine logs every segment it opens and closes through glog; keep warnings.
os.environ.setdefault("GLOG_minloglevel", "1")

# The public traces are part of the test environment, not of the repository: they sit in
# shared/traces beside the checkout (CI has them there). A missing one is an error, not a skip.
TRACES_DIR = Path(__file__).resolve().parents[2] / "shared" / "traces"
PUBLIC_TRACES = ("conversation_trace.jsonl", "synthetic_trace.jsonl",
                 "AzureLLMInferenceTrace_conv.csv", "AzureLLMInferenceTrace_code.csv")


@pytest.fixture(scope="session")
def traces() -> Path:
    """The folder of the public traces; fails, naming each missing file's path, unless all of
    `PUBLIC_TRACES` are there."""
    missing = [str(TRACES_DIR / name) for name in PUBLIC_TRACES
               if not (TRACES_DIR / name).is_file()]
    if missing:
        pytest.fail("public traces missing (the tests read them from shared/traces beside the "
                    "checkout): " + ", ".join(missing), pytrace=False)
    return TRACES_DIR


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """With `-m`, a test file whose module marks rule out every test in it (a file marked `slow`
    under `-m "not slow"`) is not imported at all: importing torch and the rest for tests that
    are then deselected would cost the fast loop more than its tests take."""
    markexpr = config.option.markexpr
    if not markexpr or not (collection_path.name.startswith("test_")
                            and collection_path.suffix == ".py"):
        return None
    marks = module_marks(ast.parse(collection_path.read_text()))
    return True if marks and rules_out_every_test(markexpr, marks) else None
