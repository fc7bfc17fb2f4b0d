"""The lossless rule for greedy outputs, tie-aware, for any dtype.

Two greedy outputs of the same target (a reference from stock `generate`, a candidate from spec_adapt) agree when,
per row, they are identical; or when, up to the first position where they differ, they are identical, and:

1. at that position the two tokens are a tie of the target on the reference path: both logits lie within the
   dtype's tolerance of the position's top logit (for the reference's and the candidate's tokens being the top two,
   that is the top-2 gap), and
2. from that position on, each output is the target's own greedy continuation of its own prefix: re-scored by the
   target (one forward per row over prompt and output), every later token's logit is within the tolerance of that
   position's top logit; a candidate token that is not the argmax there is one more tie.

A verification over several tokens and a one-token step sum in other orders (batched matrix products, attention
kernels that block differently), so a near-tie between two logits may break either way: that is not a loss. A
divergence where the target clearly preferred the reference's token, or a continuation that is not the target's
greedy choice, is.

Tolerance at a position: `tolerance(dtype, max|logit|) = C * eps(dtype) * max|logit|`, C = 8 (`TIE_FACTOR`). A logit
computed in a dtype with machine epsilon eps carries a relative rounding error of eps/2 per rounding; the logit
itself is rounded once when written (eps/2 * |logit|), and so is the hidden state it is computed from (another eps/2
relative, which the output projection carries to at most about |logit| when the projection does not cancel). Two
computations of a gap (two logits each) differ by up to 4 such terms, 2 * eps * max|logit|, from roundings alone;
the residual stream before the last layer reaches the hidden state through several rounded sums whose order differs
between the paths, worth up to as much again per independently reordered stage (attention, MLP, norm): C = 8 is
four times the rounding bound. For the three dtypes, per unit of max|logit|: float32 9.5e-7, float16 7.8e-3,
bfloat16 6.25e-2 (a bf16 logit of 10 has a spacing of 0.0625: C = 8 at |logit| 10 is 10 units in the last place).

`judge(model, prompt_ids, attention_mask, reference, candidate)` answers a `Verdict` (per row "identical",
"tie-equivalent (k ties)" or "differs"); `assert_lossless(...)` raises an AssertionError naming the rows that differ.
This module imports nothing of spec_adapt: it judges outputs, whoever produced them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TIE_FACTOR = 8.0
IDENTICAL, TIE, DIFFERS = "identical", "tie-equivalent", "differs"


def tolerance(dtype: torch.dtype, scale) -> float | torch.Tensor:
    """The tie tolerance of logits computed in `dtype` whose largest magnitude is `scale` (a float or a tensor)."""
    if not dtype.is_floating_point:
        raise ValueError(f"tolerance is defined for floating-point dtypes, got {dtype}")
    return TIE_FACTOR * torch.finfo(dtype).eps * scale


@dataclass(frozen=True)
class RowVerdict:
    status: str                     # IDENTICAL, TIE or DIFFERS
    ties: int = 0                   # tie positions along the candidate (the divergence included)
    first: int | None = None        # the first generated position where the outputs differ (None: nowhere)
    reason: str = ""

    def __str__(self) -> str:
        if self.status == TIE:
            return f"{TIE} ({self.ties} tie{'s' if self.ties != 1 else ''})"
        return self.status if self.status == IDENTICAL else f"{DIFFERS}: {self.reason}"


@dataclass(frozen=True)
class Verdict:
    rows: tuple[RowVerdict, ...]

    @property
    def ok(self) -> bool:
        """No row differs (ties are not failures)."""
        return all(r.status != DIFFERS for r in self.rows)

    @property
    def ties(self) -> int:
        return sum(r.ties for r in self.rows)

    def __str__(self) -> str:
        return "; ".join(f"row {b}: {r}" for b, r in enumerate(self.rows))


def rescore(model, prefix: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The target's logits (float32) for each of `tokens` [T] after `prefix` [P] (one unpadded row, one forward):
    row t is the distribution `tokens[t]` was chosen from. [T, V]."""
    sequence = torch.cat([prefix, tokens]).to(_device(model))[None]
    with torch.no_grad():
        logits = model(input_ids=sequence, attention_mask=torch.ones_like(sequence)).logits[0]
    return logits[prefix.numel() - 1: prefix.numel() - 1 + tokens.numel()].float()


def greedy_ties(logits: torch.Tensor, tokens: torch.Tensor, dtype: torch.dtype) -> tuple[int, int | None]:
    """Whether `tokens` [T] are greedy under `logits` [T, V] within the tolerance: (ties, first offender or None).
    A token that is not the argmax but lies within the tolerance of the top logit is a tie."""
    if tokens.numel() == 0:
        return 0, None
    top = logits.max(dim=-1).values
    chosen = logits.gather(-1, tokens.to(logits.device)[:, None]).squeeze(-1)
    gap = top - chosen
    tol = tolerance(dtype, logits.abs().max(dim=-1).values)
    bad = (gap > tol).nonzero()
    ties = int(((tokens.to(logits.device) != logits.argmax(dim=-1)) & (gap <= tol)).sum())
    return ties, (int(bad[0]) if len(bad) else None)


def judge(model, prompt_ids: torch.Tensor, attention_mask: torch.Tensor | None, reference: torch.Tensor,
          candidate: torch.Tensor, dtype: torch.dtype | None = None, eos_token_id=None) -> Verdict:
    """Judge `candidate` against `reference` (both [B, >= L]: generate's output, the prompt [B, L] first) row by row.
    `dtype`: the dtype the outputs were computed in (default: the model's). `eos_token_id` (an int or a list): a
    row's output ends at its first EOS, what follows is padding. The re-scoring forwards run `model` as it is."""
    dtype = dtype or _dtype(model)
    width = prompt_ids.shape[1]
    mask = torch.ones_like(prompt_ids) if attention_mask is None else attention_mask
    eos = set() if eos_token_id is None else {int(e) for e in torch.as_tensor(eos_token_id).flatten().tolist()}
    rows = []
    for b in range(prompt_ids.shape[0]):
        prefix = prompt_ids[b][mask[b].bool()].cpu()
        ref, cand = _generated(reference[b, width:], eos), _generated(candidate[b, width:], eos)
        rows.append(_judge_row(model, prefix, ref, cand, dtype))
    return Verdict(tuple(rows))


def assert_lossless(model, prompt_ids, attention_mask, reference, candidate, dtype=None, eos_token_id=None) -> Verdict:
    """`judge`, raising an AssertionError when a row differs; returns the Verdict (identical or tie-equivalent)."""
    verdict = judge(model, prompt_ids, attention_mask, reference, candidate, dtype, eos_token_id)
    assert verdict.ok, f"outputs differ beyond ties: {verdict}"
    return verdict


def _judge_row(model, prefix, ref, cand, dtype) -> RowVerdict:
    n = min(len(ref), len(cand))
    differ = (ref[:n] != cand[:n]).nonzero()
    if not len(differ):
        if len(ref) == len(cand):
            return RowVerdict(IDENTICAL)
        return RowVerdict(DIFFERS, first=n, reason=f"one output ends at generated token {n}, the other does not")
    first = int(differ[0])
    ref_logits = rescore(model, prefix, ref)
    at = ref_logits[first]
    top, tol = at.max(), tolerance(dtype, at.abs().max())
    gap = float(top - torch.minimum(at[ref[first]], at[cand[first]]))
    if gap > tol:
        return RowVerdict(DIFFERS, first=first, reason=f"at generated token {first} the target prefers one token by "
                          f"{gap:.4g} (tolerance {float(tol):.4g} in {dtype}): not a tie")
    ties = 1
    for name, tokens, logits in (("reference", ref, ref_logits), ("candidate", cand, None)):
        if logits is None:
            logits = rescore(model, prefix, tokens)
        later, offender = greedy_ties(logits[first + 1:], tokens[first + 1:], dtype)
        if offender is not None:
            at = first + 1 + offender
            return RowVerdict(DIFFERS, first=first, reason=f"after a tie at generated token {first}, the {name}'s "
                              f"token {at} is not the target's greedy choice of its own prefix")
        ties += later if name == "candidate" else 0
    return RowVerdict(TIE, ties, first)


def _generated(tokens: torch.Tensor, eos: set) -> torch.Tensor:
    tokens = tokens.cpu()
    for i, t in enumerate(tokens.tolist()):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def _device(model):
    return next(model.parameters()).device


def _dtype(model):
    return next(p.dtype for p in model.parameters() if p.dtype.is_floating_point)
