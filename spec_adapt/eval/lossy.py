"""A deliberately lossy acceptance rule, to prove the quality-regression suite catches one. Never use it to generate.

`LossyTopK(k)` is an Acceptor (spec_adapt.acceptor) that accepts a drafted token whenever it is among the target's
top-k at that position (instead of equal to the argmax / passing the rejection test). The first token not in the
top-k is replaced by the target's argmax (greedy) or a sample from p. Pass it as `acceptor=` to one call: nothing
global changes, so other calls (other threads included) stay lossless.
"""

from __future__ import annotations

import torch

from spec_adapt.acceptor import Acceptor


def _topk_accepted(scores, drafts, lengths, k):
    width = drafts.shape[1]
    top = scores[:, :width].topk(min(k, scores.shape[-1]), dim=-1).indices                 # [B, S, k]
    ok = (top == drafts[..., None]).any(-1)
    ok &= torch.arange(width, device=ok.device)[None, :] < lengths[:, None]
    return ok.long().cumprod(-1).sum(-1)


class LossyTopK(Acceptor):
    def __init__(self, k: int = 5):
        super().__init__(kernels="off")
        self.k = k

    def greedy(self, logits, drafts, lengths):
        accepted = _topk_accepted(logits, drafts, lengths, self.k)
        return accepted, logits.argmax(-1).gather(1, accepted[:, None]).squeeze(1)

    def rejection(self, probs, drafts, q, lengths, uniforms, exponentials):
        accepted = _topk_accepted(probs, drafts, lengths, self.k)
        p = probs[torch.arange(len(accepted), device=probs.device), accepted].float()
        return accepted, (p / exponentials).argmax(-1)
