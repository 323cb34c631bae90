"""pdcluster: a disaggregated prefill/decode serving cluster for K3.1-style hybrid sparse-attention models."""

__version__ = "0.1.0"
