"""Triton kernels for the hot operations of a speculative step, each beside its PyTorch reference.

`spec_adapt.kernels` (never a top-level `kernels` module: a Hugging Face package owns that name). The references
are spec_adapt.acceptance_rules (greedy_accept, rejection_sample) and spec_adapt.kernels.verify / compact
themselves; the per-call `spec_adapt.acceptor.Acceptor` chooses between a kernel and its reference.
"""
