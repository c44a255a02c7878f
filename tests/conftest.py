"""Test-wide settings and the public traces fixture."""

import os
from pathlib import Path

import pytest

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
