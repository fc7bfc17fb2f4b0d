"""Speculation statistics: one vocabulary shared by the loop, the policies' rewards, benchmarks and eval.

Terms: per row and step, `drafted` tokens were proposed, `accepted` of them matched the target,
and `accepted + 1` tokens were committed (the recovered or bonus token), fewer when the row stopped mid-commit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import threading


_PER_ROW = ("rows", "gammas", "drafted", "accepted", "committed")
_OTHER = ("step_time", "draft_time", "verify_time", "telemetry", "held", "confidence", "free", "path")


class StepRecord:
    """What one speculative step did, for the whole active batch (lists are per active row):

    batch_size: int
    rows: list[int]          original row indices in the user's batch
    gammas: list[int]        lengths the policy asked for
    drafted: list[int]       lengths the drafter actually proposed (early exit may cut them)
    accepted: list[int]
    committed: list[int]     tokens appended to each row this step
    step_time: float         seconds, propose + verify + accept + commit
    draft_time: float
    verify_time: float
    telemetry: dict | None   the drafter's own measurements this step (Proposal.telemetry), e.g. a chain's
    held: int | None         rows the target's forward ran: the active rows and spare rows (None: batch_size)
    confidence: object       [B, S] tensor (the target's device): the draft's probability of each drafted token, or
                             None; copied to the host only by a policy that reads it
    free: list[bool] | None  per row: drafted by a model-free source (no draft forward), or None: no row was
    path: str                the verification path the step took ("full"; "pruned": an early exit, `Verifier.path`)

    The per-row fields may be given as lists or as [B] tensors: a tensor becomes a list the first time it is read, so
    a step whose record nobody reads per row copies nothing to the host; `tensor(name)` reads a field as given."""

    __slots__ = ("batch_size", "_rows", "_gammas", "_drafted", "_accepted", "_committed") + _OTHER

    def __init__(self, batch_size: int, rows, gammas, drafted, accepted, committed, step_time: float,
                 draft_time: float, verify_time: float, telemetry: dict | None = None, held: int | None = None,
                 confidence: object = None, free: list[bool] | None = None, path: str = "full"):
        self.batch_size = batch_size
        self._rows, self._gammas, self._drafted, self._accepted, self._committed = (
            rows, gammas, drafted, accepted, committed)
        self.step_time, self.draft_time, self.verify_time = step_time, draft_time, verify_time
        self.telemetry, self.held, self.confidence, self.free, self.path = telemetry, held, confidence, free, path

    def _list(self, name: str) -> list:
        value = getattr(self, "_" + name)
        if not isinstance(value, list):
            value = value.tolist() if hasattr(value, "tolist") else list(value)
            setattr(self, "_" + name, value)
        return value

    def tensor(self, name: str):
        """A per-row field as it was given (a tensor where the loop recorded one: no host copy)."""
        return getattr(self, "_" + name)

    rows = property(lambda self: self._list("rows"), lambda self, v: setattr(self, "_rows", v))
    gammas = property(lambda self: self._list("gammas"), lambda self, v: setattr(self, "_gammas", v))
    drafted = property(lambda self: self._list("drafted"), lambda self, v: setattr(self, "_drafted", v))
    accepted = property(lambda self: self._list("accepted"), lambda self, v: setattr(self, "_accepted", v))
    committed = property(lambda self: self._list("committed"), lambda self, v: setattr(self, "_committed", v))

    def _fields(self) -> dict:
        return {n: getattr(self, n) for n in ("batch_size",) + _PER_ROW + _OTHER}

    def __eq__(self, other):
        if not isinstance(other, StepRecord):
            return NotImplemented
        mine, theirs = self._fields(), other._fields()
        same = mine.pop("confidence") is theirs.pop("confidence")
        return same and mine == theirs

    def __repr__(self) -> str:
        return "StepRecord(" + ", ".join(f"{k}={v!r}" for k, v in self._fields().items()) + ")"

    def __getstate__(self):
        return self._fields()

    def __setstate__(self, state):
        self.__init__(**state)


@dataclass
class SpecStats:
    """Statistics of one speculative `generate` call. Also readable after the call with `spec_adapt.last_stats()`."""

    batch_size: int = 0
    steps: int = 0                 # verification passes of the target
    row_steps: int = 0             # sum over steps of the active batch size
    drafted: int = 0
    accepted: int = 0
    new_tokens: int = 0            # tokens generated, over all rows, first token included
    per_position_drafted: list[int] = field(default_factory=list)   # index i: drafts at position i+1
    per_position_accepted: list[int] = field(default_factory=list)
    per_row_drafted: list[int] = field(default_factory=list)
    per_row_accepted: list[int] = field(default_factory=list)
    per_row_new_tokens: list[int] = field(default_factory=list)
    per_row_steps: list[int] = field(default_factory=list)
    time_prefill: float = 0.0
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_other: float = 0.0
    time_total: float = 0.0
    fallback: str | None = None    # why speculation was switched off mid-call, if it was
    lossy: str | None = None       # None: the target's own output; else the lossy rule the user chose (e.g.
                                   # "assistant_ensemble_weight=0.5")
    policy: str | None = None      # the policy that chose the lengths (its repr)
    compactions: int = 0
    kernel_paths: dict = field(default_factory=dict)   # operation -> "triton" or "torch": what ran in this call
    drafter_events: list = field(default_factory=list)   # e.g. a chain level dropped after a failure
    verifier: dict = field(default_factory=dict)   # the verifier's counters (EarlyExitVerifier: tested, pruned, ...)
    trace: list[StepRecord] = field(default_factory=list)
    trace_limit: int | None = None   # keep only the last N StepRecords (a serving engine runs for days); None: all
    step_tokens: int = 0             # tokens committed by verification steps (first tokens excluded)
    restarts: int = 0                # serving: times a drafter that had failed was started again
    per_source: dict = field(default_factory=dict)   # a MultiSourceDrafter's sources: name -> {"rows": row-steps it
                                                     # drafted, "drafted": tokens, "accepted": tokens}
    widths: dict = field(default_factory=dict)       # width a row was given (0 = none) -> row-steps
    drafting_row_steps: int = 0                      # row-steps in which the row drafted at least one token

    def start(self, batch_size: int) -> None:
        self.batch_size = batch_size
        for name in ("per_row_drafted", "per_row_accepted", "per_row_new_tokens", "per_row_steps"):
            setattr(self, name, [0] * batch_size)

    def admit(self, rows) -> None:
        """Serving: requests joined in these row numbers (slots, which a request that left may have used): their
        per-row counts start at 0. `batch_size` counts the rows ever admitted; the totals count every request."""
        rows = [int(r) for r in rows]
        self.batch_size += len(rows)
        for name in ("per_row_drafted", "per_row_accepted", "per_row_new_tokens", "per_row_steps"):
            values = getattr(self, name)
            values.extend([0] * (max(rows, default=-1) + 1 - len(values)))
            for row in rows:
                values[row] = 0

    def record(self, rec: StepRecord, plain: bool = False) -> None:
        """Count one step. `plain`: no row drafted (the loop knows it without reading the record per row), so only
        the committed tokens are counted per row, with one host copy."""
        self.steps += 1
        self.row_steps += rec.batch_size
        self.time_draft += rec.draft_time
        self.time_verify += rec.verify_time
        self.time_other += rec.step_time - rec.draft_time - rec.verify_time
        if plain:
            self._record_plain(rec)
            return
        for row, g, d, a, c in zip(rec.rows, rec.gammas, rec.drafted, rec.accepted, rec.committed):
            self.widths[g] = self.widths.get(g, 0) + 1
            self.per_row_drafted[row] += d
            self.per_row_accepted[row] += a
            self.per_row_new_tokens[row] += c
            self.per_row_steps[row] += 1
            self.drafting_row_steps += d > 0
            self.drafted += d
            self.accepted += a
            self.new_tokens += c
            self._extend_positions(d)
            for i in range(d):
                self.per_position_drafted[i] += 1
                self.per_position_accepted[i] += int(i < a)
        self.step_tokens += sum(rec.committed)
        sources = (rec.telemetry or {}).get("source")
        if sources is not None:
            self._count_sources(sources, rec.drafted, rec.accepted)
        self._keep(rec)

    def _record_plain(self, rec: StepRecord) -> None:
        rows, committed = rec.tensor("rows"), rec.tensor("committed")
        if not isinstance(rows, list):
            rows, committed = rows.tolist(), committed.tolist()
        new, steps = self.per_row_new_tokens, self.per_row_steps
        for row, c in zip(rows, committed):
            new[row] += c
            steps[row] += 1
        total = sum(committed)
        self.widths[0] = self.widths.get(0, 0) + len(rows)
        self.new_tokens += total
        self.step_tokens += total
        self._keep(rec)

    def _keep(self, rec: StepRecord) -> None:
        self.trace.append(rec)
        if self.trace_limit is not None and len(self.trace) > 2 * self.trace_limit:
            del self.trace[: len(self.trace) - self.trace_limit]     # amortized: one cut per trace_limit steps

    def _count_sources(self, sources, drafted, accepted) -> None:
        for name, d, a in zip(sources, drafted, accepted):
            if name is not None and d:
                entry = self.per_source.setdefault(name, {"rows": 0, "drafted": 0, "accepted": 0})
                entry["rows"] += 1
                entry["drafted"] += d
                entry["accepted"] += a

    def _extend_positions(self, n: int) -> None:
        missing = n - len(self.per_position_drafted)
        if missing > 0:
            self.per_position_drafted.extend([0] * missing)
            self.per_position_accepted.extend([0] * missing)

    @property
    def acceptance_rate(self) -> float:
        """alpha = accepted / drafted."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_length(self) -> float:
        """Mean tokens committed per row per verification step (accepted + 1), vLLM's mean acceptance length."""
        return self.step_tokens / self.row_steps if self.row_steps else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.per_position_accepted, self.per_position_drafted)]

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.time_total if self.time_total else 0.0

    def summary(self) -> dict:
        return {
            "batch_size": self.batch_size,
            "steps": self.steps,
            "new_tokens": self.new_tokens,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "acceptance_length": round(self.acceptance_length, 4),
            "per_position_acceptance": [round(x, 4) for x in self.per_position_acceptance],
            "tokens_per_second": round(self.tokens_per_second, 3),
            "time_prefill": round(self.time_prefill, 4),
            "time_draft": round(self.time_draft, 4),
            "time_verify": round(self.time_verify, 4),
            "time_other": round(self.time_other, 4),
            "time_total": round(self.time_total, 4),
            "fallback": self.fallback,
            "lossy": self.lossy,
            "policy": self.policy,
            "compactions": self.compactions,
            "kernel_paths": self.kernel_paths,
            "verifier": self.verifier,
            **({"per_source": self.per_source} if self.per_source else {}),
        }


_last = threading.local()


def set_last_stats(stats: SpecStats) -> None:
    _last.stats = stats


def last_stats() -> SpecStats | None:
    """Statistics of the most recent speculative generate call in this thread."""
    return getattr(_last, "stats", None)
