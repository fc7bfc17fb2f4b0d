"""Triton kernels for the hot operations of a speculative step, each beside its PyTorch reference.

Installed as `spec_adapt.kernels` (never as a top-level `kernels` module: a Hugging Face package owns that name).
The references live in spec_adapt.accept and spec_adapt.ledger; kernels land here with the kernels issue.
"""
