"""pdsim: simulate and run prefill/decode disaggregated LLM serving from one scheduler core."""

__version__ = "0.1.0"
