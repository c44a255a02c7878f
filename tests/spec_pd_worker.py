"""A PD worker instance for tests/test_spec_pd.py: `runtime.pd.worker` whose MTP draft is the
checked oracle (tests/spec_oracle.py, its references from the file $SPEC_ORACLE) and, with
$SPEC_DROP_HIDDEN set, whose prefill side leaves the request's last hidden state out of the
transfer (the decode side keeps whatever its slot held).

    python tests/spec_pd_worker.py --instance JSON      (what `python -m runtime.pd.worker` takes)
"""

from __future__ import annotations

import os

import runtime.model.draft
import runtime.transfer.prefill
from runtime.pd import worker
from spec_oracle import CheckedOracleDraft


def _oracle(target, *, seed: int = 0):
    return CheckedOracleDraft.load(target, seed, os.environ["SPEC_ORACLE"])


runtime.model.draft.build_draft = _oracle
if os.environ.get("SPEC_DROP_HIDDEN"):
    runtime.transfer.prefill.hidden_descriptors = lambda *args: ([], [], [])

if __name__ == "__main__":
    worker.exit_now(worker.main())
