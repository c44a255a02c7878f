"""Model and hardware specs: the shapes and peaks that cost models and capacity planning read."""

from pdsim.specs.hardware import HardwareSpec, hardware_preset_names, load_hardware_spec
from pdsim.specs.models import (
    ModelSpec,
    load_model_spec,
    model_preset,
    model_preset_names,
    model_spec_from_hf_config,
)
from pdsim.specs.precision import DTYPES, Precision, gemm_peak_tflops

__all__ = [
    "DTYPES",
    "Precision",
    "HardwareSpec",
    "ModelSpec",
    "hardware_preset_names",
    "load_hardware_spec",
    "load_model_spec",
    "model_preset",
    "model_preset_names",
    "model_spec_from_hf_config",
    "gemm_peak_tflops",
]
