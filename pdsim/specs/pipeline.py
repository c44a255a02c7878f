"""Pipeline parallelism's layer split: which layers each of an instance's `pp` stages holds.

SGLang's default partition (sglang/srt/distributed/utils.py, get_pp_indices; its
SGLANG_PP_LAYER_PARTITION override is not modelled): consecutive layers, num_layers // pp per
stage, and the last num_layers % pp stages one more each. The last stage thus holds the most
layers and also runs the LM head: it is the slowest and sets the pipeline's pace, and the
simulator prices it (`stage_model`)."""

from __future__ import annotations

from pdsim.specs.models import ModelSpec


def stage_layer_ranges(num_layers: int, pp: int) -> list[range]:
    """The layers of each stage, first to last."""
    if pp < 1:
        raise ValueError(f"pp must be >= 1, got {pp}")
    if num_layers < pp:
        raise ValueError(f"pp={pp} stages need at least one layer each; the model has "
                         f"{num_layers} layers")
    base, extra = divmod(num_layers, pp)
    sizes = [base + (i >= pp - extra) for i in range(pp)]
    starts = [sum(sizes[:i]) for i in range(pp)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def stage_model(model: ModelSpec, pp: int) -> ModelSpec:
    """`model` cut to its last stage's layers (the most layers, and the LM head): a
    cost model pricing it prices one stage's step. The embedding stays counted (conservative
    by one vocabulary matrix in a stage's weights)."""
    if pp == 1:
        return model
    last = stage_layer_ranges(model.num_layers, pp)[-1]
    dense = max(0, model.first_k_dense_layers - last.start) if model.is_moe else 0
    shift = last.start % len(model.layer_pattern)  # the stage's first layer's type first
    pattern = model.layer_pattern[shift:] + model.layer_pattern[:shift]
    return model.model_copy(update={"num_layers": len(last), "first_k_dense_layers": dense,
                                    "layer_pattern": pattern})
