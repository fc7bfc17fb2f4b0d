"""`spec-adapt profile`: measure this machine's step-time profile (a `LatencyTable`) for a model and its draft.

The table's lookup (`LatencyTable`, `cached_profile`, `profile_path`) lives with the estimators the policies use,
`spec_adapt.policies.estimators`; this module only measures.
"""

from __future__ import annotations

import time

import torch

from ..policies.estimators import LatencyTable, cached_profile, profile_key, profile_path  # noqa: F401 (re-exported)


def profile(model, draft=None, batch_sizes=(1, 4, 16), lengths=(0, 1, 2, 4, 8), lags=(32, 128, 512),
            context: int = 256, repeats: int = 5, progress: bool = True) -> LatencyTable:
    """Measure T(B, s) for `model`, the draft's per-token time and catch-up cost c_prefill(L, B) on this machine."""
    from tqdm import tqdm

    from ..ledger import KVLedger

    def timed(fn) -> float:
        fn()                                                  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    def primed(m, batch, length):
        ledger = KVLedger(m)
        ids = torch.randint(3, m.config.vocab_size, (batch, length))
        ledger.prefill(ids, None)
        return ledger

    def forward_then_rollback(ledger, width):
        tokens = torch.randint(3, ledger.model.config.vocab_size, (ledger.slots.shape[0], width))
        keep = ledger.n_cached.clone()
        ledger.forward(tokens, torch.full((tokens.shape[0],), width))
        ledger.rollback(keep)

    table = LatencyTable(meta={"context": context, "repeats": repeats, "batch_sizes": list(batch_sizes)})
    jobs = [("step", b, s) for b in batch_sizes for s in lengths]
    if draft is not None:
        jobs += [("draft", b, 1) for b in batch_sizes] + [("prefill", b, l) for b in batch_sizes for l in lags]
    with torch.no_grad():
        for kind, batch, n in tqdm(jobs, desc="profiling", disable=not progress):
            if kind == "step":
                ledger = primed(model, batch, context)
                table.step.setdefault(batch, {})[n] = timed(lambda: forward_then_rollback(ledger, n + 1))
            elif kind == "draft":
                ledger = primed(draft, batch, context)
                table.draft_token[batch] = timed(lambda: forward_then_rollback(ledger, 1))
            else:
                ledger = primed(draft, batch, context)
                table.prefill.setdefault(n, {})[batch] = timed(lambda: forward_then_rollback(ledger, n))
    return table


