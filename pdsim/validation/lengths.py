"""Did the endpoint process the lengths the workload asked for? The token counts it reported
(`usage`, or SGLang's `meta_info`) against the intended ones, per direction: how many requests
were off and by how much. A text prompt the endpoint's tokenizer counts differently (a BOS, a
chat template) or an output cut short (an endpoint that ignores `ignore_eos`) shows here."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from pdsim.validation.replay import Reply


def length_check(replies: Sequence[Reply], input_tokens: Sequence[int],
                 output_tokens: Sequence[int]) -> pd.DataFrame:
    """One row per direction (input, output): requests whose count was reported, how many were
    exact, how many off, the mean and the largest difference (reported − intended, tokens),
    and how many the endpoint reported no count for."""
    rows = []
    for name, intended, reported in (
            ("input", input_tokens, [r.prompt_tokens for r in replies]),
            ("output", output_tokens, [r.completion_tokens for r in replies])):
        diffs = np.array([got - int(want) for got, want, r in zip(reported, intended, replies)
                          if got is not None and r.record.ok], dtype=float)
        off = diffs[diffs != 0]
        rows.append({"tokens": name, "reported": len(diffs), "exact": int((diffs == 0).sum()),
                     "off": len(off), "mean_diff": float(off.mean()) if len(off) else 0.0,
                     "largest_diff": float(off[np.argmax(np.abs(off))]) if len(off) else 0.0,
                     "not_reported": sum(1 for got, r in zip(reported, replies)
                                         if got is None and r.record.ok)})
    return pd.DataFrame(rows)


def mismatched(table: pd.DataFrame) -> bool:
    return bool((table["off"] > 0).any())


def markdown(table: pd.DataFrame) -> str:
    lines = ["### Token counts the endpoint reported, against the workload's", "",
             "| tokens | reported | exact | off | mean diff when off | largest diff | "
             "not reported |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in table.itertuples():
        lines.append(f"| {row.tokens} | {row.reported} | {row.exact} | {row.off} | "
                     f"{row.mean_diff:+.1f} | {row.largest_diff:+.0f} | {row.not_reported} |")
    if mismatched(table):
        lines += ["", "**Some requests were not the lengths asked for**: the simulation uses the "
                  "lengths the endpoint reported."]
    return "\n".join(lines) + "\n"
