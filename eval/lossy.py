"""A deliberately lossy acceptance rule, to prove the quality-regression suite catches one. Never use it to generate.

`lossy_topk_acceptance(k)` temporarily replaces spec_adapt's acceptance (spec_adapt.fast) with: accept a drafted
token whenever it is among the target's top-k at that position (instead of equal to the argmax / passing the
rejection test). The first token not in the top-k is replaced by the target's argmax (greedy) or a sample from p.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from spec_adapt import fast


def _topk_accepted(scores, drafts, lengths, k):
    width = drafts.shape[1]
    top = scores[:, :width].topk(min(k, scores.shape[-1]), dim=-1).indices                 # [B, S, k]
    ok = (top == drafts[..., None]).any(-1)
    ok &= torch.arange(width, device=ok.device)[None, :] < lengths[:, None]
    return ok.long().cumprod(-1).sum(-1)


@contextmanager
def lossy_topk_acceptance(k: int = 5):
    greedy, rejection = fast.greedy, fast.rejection

    def lossy_greedy(logits, drafts, lengths):
        accepted = _topk_accepted(logits, drafts, lengths, k)
        return accepted, logits.argmax(-1).gather(1, accepted[:, None]).squeeze(1)

    def lossy_rejection(probs, drafts, q, lengths, uniforms, exponentials):
        accepted = _topk_accepted(probs, drafts, lengths, k)
        p = probs[torch.arange(len(accepted), device=probs.device), accepted].float()
        return accepted, (p / exponentials).argmax(-1)

    fast.greedy, fast.rejection = lossy_greedy, lossy_rejection
    try:
        yield
    finally:
        fast.greedy, fast.rejection = greedy, rejection
