"""The rules SGLang puts on combining parallelism options, checked where a deployment is read
(pdsim.deployment's roles) and where the simulator prices one (pdsim.sim.cost.Parallelism):
one copy below both."""

from __future__ import annotations


def check_moe_a2a(moe_a2a: str, two_batch_overlap: bool, tp: int, ep: int,
                  single_batch_overlap: bool = False) -> None:
    """The rules SGLang puts on DeepEP and the batch overlaps (and pdsim's: one overlap)."""
    if moe_a2a == "deepep" and not ep == tp > 1:
        raise ValueError(
            f"moe_a2a='deepep' runs expert parallelism over every GPU of the instance: it "
            f"needs ep = tp > 1, got ep={ep}, tp={tp}"
        )
    for label, on in (("two_batch_overlap", two_batch_overlap),
                      ("single_batch_overlap", single_batch_overlap)):
        if on and moe_a2a != "deepep":
            raise ValueError(
                f"{label} overlaps DeepEP's dispatch/combine with compute: it needs "
                f"moe_a2a='deepep', got {moe_a2a!r}"
            )
    if two_batch_overlap and single_batch_overlap:
        raise ValueError("two_batch_overlap and single_batch_overlap: pdsim prices one overlap "
                         "of DeepEP with compute per role; choose one")


def check_dp_options(moe_dense_tp: int | None, dp_lm_head: bool, dp_attention: int) -> None:
    """SGLang accepts --moe-dense-tp-size 1 and --enable-dp-lm-head only with DP attention
    (pdsim's rule for the first: without it every GPU would run the whole MLP on all tokens)."""
    for label, on in (("moe_dense_tp=1", moe_dense_tp == 1), ("dp_lm_head", dp_lm_head)):
        if on and dp_attention < 2:
            raise ValueError(f"{label} runs per attention-DP rank: it needs dp_attention > 1, "
                             f"got dp_attention={dp_attention}")
