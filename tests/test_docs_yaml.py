"""Every YAML block of README.md and docs/*.md validates with the parser of its kind.

A block is a plan (it has `max_gpus`, `target_rate_rps` or `search`), a serve config (it has
`mode` and no `workload`), or an experiment (the rest). A block without `name:` that is one or
more top-level sections (`workload:`, `faults:`, ...) is checked over a minimal config of its
page's kind. An experiment whose model is a servable preset must be a serve config too. A
block whose first line is `# fragment` is not a config and is skipped.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from pdsim.config import parse_experiment
from pdsim.deployment import servable_presets
from pdsim.planning.config import parse_plan
from runtime.serve_config import parse_serve_config

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```ya?ml[ \t]*\n(.*?)^```", re.M | re.S)
PLAN_KEYS = {"max_gpus", "target_rate_rps", "search"}

_WORKLOAD = {"num_requests": 4, "seed": 0, "arrival": {"process": "poisson", "rate_rps": 1},
             "input_len": {"dist": "fixed", "value": 8},
             "output_len": {"dist": "fixed", "value": 4}}
MINIMAL = {
    "experiment": {"name": "doc", "workload": _WORKLOAD},
    "serve": {"model": "tiny-llama", "cluster": {
        "mode": "disaggregated", "prefill": {"scheduler": {"num_pages": 64}},
        "decode": {"scheduler": {"num_pages": 64}}}},
    "plan": {"name": "doc", "model": "qwen3-32b", "hardware": "h200", "max_gpus": 4,
             "workload": _WORKLOAD, "slo": {"ttft_p90_s": 1.0}},
}
PAGE_KIND = {"serving.md": "serve", "planning.md": "plan"}


def _blocks() -> list[tuple[str, str]]:
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            found.append((f"{path.relative_to(ROOT)}:{line}", m.group(1)))
    return found


BLOCKS = _blocks()


def _kind(data: dict, page: str) -> tuple[str, bool]:
    """(the parser to use, whether the block is only sections of a config)."""
    if PLAN_KEYS & data.keys():
        return "plan", False
    if "cluster" in data and not {"name", "workload"} & data.keys():
        return "serve", False
    if "name" in data:
        return "experiment", False
    return PAGE_KIND.get(page, "experiment"), True


PARSERS = {"experiment": parse_experiment, "serve": parse_serve_config, "plan": parse_plan}


def test_the_docs_hold_yaml_blocks() -> None:
    assert len(BLOCKS) >= 10
    assert any(where.startswith("README.md") for where, _ in BLOCKS)


@pytest.mark.parametrize("where,text", BLOCKS, ids=[w for w, _ in BLOCKS])
def test_yaml_block_validates(where: str, text: str) -> None:
    if text.splitlines()[0].strip() == "# fragment":
        pytest.skip("marked # fragment")
    data = yaml.safe_load(text)
    assert isinstance(data, dict), f"{where}: a YAML block is a mapping (or mark it # fragment)"
    kind, sections = _kind(data, Path(where.split(":")[0]).name)
    if sections:
        data = {**copy.deepcopy(MINIMAL[kind]), **data}
    PARSERS[kind](data, where)
    if kind == "experiment" and data.get("model") in servable_presets():
        parse_serve_config(data, where)  # a deployment both backends take


def test_a_broken_block_fails() -> None:
    """The check can fail: a wrong field in a section block is reported with its path."""
    from pdsim.config import ConfigError

    with pytest.raises(ConfigError, match="workload.arrival"):
        parse_experiment({**MINIMAL["experiment"],
                          "workload": {**_WORKLOAD, "arrival": {"process": "poison"}}}, "doc")
