"""The Policy contract: the observe phase feeds it, and it chooses the next speculative length.

A policy is an object, never a config string, and keeps its state to itself (never in the user's model):
- `begin(batch_size)`: a generate call starts (reset per-call state such as per-row lengths);
- `admit(rows)`: serving: new requests take these row numbers (slots that earlier requests may have used): forget
  what was kept per row for them;
- `choose(info) -> int | sequence/tensor of B ints | Plan`: gamma for the whole batch or one per active row (0 = no
  draft); a `Plan` also names the chain members the drafter should use this step (a ChainScheduler's answer);
- `observe(record)`: what the step did (a `StepRecord`: gammas, drafted, accepted, committed, times, batch size);
- `reset()`: forget everything learned; `state_dict()` / `load_state_dict()`: save and restore what was learned;
- `batch_rows(live, held) -> int`: when rows finish, how many rows the target's batch keeps, from `live` (compact:
  the default) to `held` (the rows it runs now); the extra ones stay as spare rows whose outputs are dropped, for a
  machine that runs the bigger batch faster (on a CPU, some batch sizes run slower than a larger one);
- `cost`: the step-cost model it writes (a `spec_adapt.policies.cost.StepCost`: its `observe` puts each step into it
  once, on the verification path it took, `StepRecord.path`), or None for a policy that weighs no step times (the
  call then has one of its own, which the loop writes). That one model is the call's: the loop hands it, read-only,
  to the drafter (`DraftRequest.cost`) and the verifier (`Verifier.cost`; `share_cost`).
"""

from __future__ import annotations

import numbers
import threading
import weakref
from dataclasses import dataclass

import torch

from ..running_estimates import StopRule

from ..metrics import StepRecord
from .cost import StepCost


class StepInfo:
    """What a policy is told before it chooses. `generated` and `remaining` may be handed over as functions that
    compute them: they run on first read, so a policy that never reads them costs the loop no tensor operation (on a
    GPU or a small model a step's cost is largely such operations). They describe the step being chosen: the loop
    closes the info when `choose` returns (`close`), and a later first read raises instead of describing another
    step (a policy that wants them afterwards reads them in `choose`)."""

    def __init__(self, batch_size: int, rows: torch.Tensor, generated, remaining, step: int,
                 draft_lag: torch.Tensor | None = None, level_lags: list[int] | None = None, closed: bool = False):
        self.batch_size = batch_size
        self.rows = rows                    # [B] the active rows' indices in the user's batch
        self._generated = generated         # [B] tokens generated so far per row
        self._remaining = remaining         # [B] tokens each row may still generate
        self.step = step                    # verification steps done so far in this call
        self.draft_lag = draft_lag          # [B] committed tokens a draft model has not cached (catch-up cost)
        self.level_lags = level_lags        # multi-level drafters: each level's largest lag (index = level)
        # A closed batch (one generate call) takes no new rows, so it ends with its slowest row: tokens a step gives
        # the other rows do not shorten it. An open batch (serving, the lab's refilled batches) is judged by
        # throughput.
        self.closed = closed

    @property
    def generated(self) -> torch.Tensor:
        if callable(self._generated):
            self._generated = self._generated()
        return self._generated

    @property
    def remaining(self) -> torch.Tensor:
        if callable(self._remaining):
            self._remaining = self._remaining()
        return self._remaining

    def close(self) -> None:
        """The step was chosen: a field not read by now can no longer be computed for it."""
        for name in ("_generated", "_remaining"):
            if callable(getattr(self, name)):
                setattr(self, name, _closed(name[1:]))

    def __repr__(self) -> str:
        def shown(value):        # a field not read yet stays unread (and a closed one does not raise)
            return "<not read>" if callable(value) else value
        return (f"StepInfo(batch_size={self.batch_size}, rows={self.rows}, generated={shown(self._generated)}, "
                f"remaining={shown(self._remaining)}, step={self.step}, draft_lag={self.draft_lag}, "
                f"level_lags={self.level_lags}, closed={self.closed})")


def _closed(name: str):
    def read():
        raise RuntimeError(f"StepInfo.{name} was first read after the policy's choose returned; the rows have moved "
                           f"on since: read it inside choose and keep the value")
    return read


# A draft model normally trails the committed text by 1 or 2 tokens (the target's new token, and the last draft token
# when everything was accepted): only a `draft_lag` or `level_lags` beyond that is catch-up.
USUAL_LAG = 2


@dataclass
class Plan:
    """A policy's answer when it steers more than the length: `gammas` as `choose` would return them, and `members`,
    the chain levels to use this step (ascending indices into a ChainDrafter's levels; None = leave the chain as is).
    The plan reaches the drafter through `DraftRequest.members`; the policy never touches the drafter."""

    gammas: object
    members: tuple | None = None
    depth: int | None = None      # a tree plan: gammas count each row's nodes, no node deeper than `depth`
    pooled: bool = False          # a tree plan whose sum(gammas) is one budget for the step, spent on the batch's
                                  # likeliest nodes whatever their row (a drafter that cannot rank across rows keeps
                                  # gammas[b] per row)
    stop: StopRule | None = None  # a chain plan's gammas are then each row's most: a drafter with probabilities stops
                                  # a row where the rule says (spec_adapt.running_estimates.StopRule); others draft
                                  # gammas


class Policy:
    # Whether `observe` reads the step times: on a GPU the loop then marks each phase with a CUDA event and waits
    # once per step for the last (a policy that only counts tokens sets it False and saves that wait).
    needs_timing = True
    trees = False        # True: `choose` may answer with tree plans (the call then checks the target can verify them)
    # What a row's width bounds, with a drafter that has model-free sources (`FreeSources.max_free`: the default
    # several-source drafter). True: every source, so a row drafts at most its width from any of them (0: nothing).
    # False: the widths bound the draft model; `allows_free` may let model-free sources draft up to `max_free`
    # tokens beyond them (they cost no forward, and the router takes them only where they pay).
    width_binds_free = False
    cost: StepCost | None = None     # the step-cost model it writes step times into (module docstring)

    def begin(self, batch_size: int) -> None:
        pass

    def admit(self, rows) -> None:
        pass

    def choose(self, info: StepInfo):
        raise NotImplementedError

    def observe(self, record: StepRecord) -> None:
        pass

    def prefilled(self, tokens: int, seconds: float) -> None:
        """The target's forward over prompts of `tokens` tokens in all (rows x padded length) took `seconds`: a call's
        batch before its first step, or requests joining a running batch."""

    def reset(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def batch_rows(self, live: int, held: int) -> int:
        return live

    def allows_free(self, batch_size: int) -> bool:
        """Whether rows may draft from model-free sources this step (a drafter with `max_free`, such as
        MultiSourceDrafter): beyond the widths `choose` answers, or within them where `width_binds_free`. A policy
        that must measure plain steps first says no until it has."""
        return True


def check_rows(policy, value, live: int, held: int) -> int:
    """A policy's batch_rows answer as an int in [live, held], or an error naming the policy and the fix."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and live <= int(value) <= held:
        return int(value)
    raise ValueError(
        f"{type(policy).__name__}.batch_rows({live}, {held}) returned {value!r}; expected an int from {live} (the "
        f"rows still generating) to {held} (the rows the batch holds now)."
    )


# The most draft tokens (chain length or tree nodes) one row may carry in a step, and the deepest tree: a verification
# wider than this is no speculation any more, and drafters size their buffers by the plan.
MAX_WIDTH = 1024


def check_int(name: str, value, low: int, high: int | None = None) -> int:
    """`value` when it is an int (not a bool) at least `low` and at most `high` (None: no upper bound); else a
    ValueError naming the argument `name`. What the policies' size and count arguments are checked with."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or high is not None and value > high:
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an int {bound}, got {value!r}.")
    return value


def to_json_lists(x):
    """Nested tuples (a random.Random state, a table's tuple keys) as nested lists, for a JSON-friendly
    `state_dict`; `from_json_lists` turns them back."""
    return [to_json_lists(v) for v in x] if isinstance(x, (tuple, list)) else x


def from_json_lists(x):
    """Nested lists (what `to_json_lists` made, read back from JSON) as the nested tuples they were."""
    return tuple(from_json_lists(v) for v in x) if isinstance(x, list) else x


def check_plan(policy, value, batch_size: int) -> Plan:
    """A policy's answer -> a Plan with gammas [B] long, or an error naming the policy and the fix."""
    if not isinstance(value, Plan):
        return Plan(check_gammas(policy, value, batch_size))
    members = None if value.members is None else tuple(int(m) for m in value.members)
    depth = value.depth
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, numbers.Integral)
                              or not 1 <= depth <= MAX_WIDTH):
        raise ValueError(f"{type(policy).__name__}.choose returned a Plan with depth={depth!r}; expected None "
                         f"(chains) or an int in [1, {MAX_WIDTH}].")
    if not isinstance(value.pooled, bool) or (value.pooled and depth is None):
        raise ValueError(f"{type(policy).__name__}.choose returned a Plan with pooled={value.pooled!r}; pooled is "
                         "True or False, and True only for a tree plan (with a depth).")
    if value.stop is not None and (not isinstance(value.stop, StopRule) or depth is not None):
        raise ValueError(f"{type(policy).__name__}.choose returned a Plan with stop={value.stop!r}; expected None or a "
                         "spec_adapt.running_estimates.StopRule, and only for a chain plan (no depth).")
    return Plan(check_gammas(policy, value.gammas, batch_size), members, None if depth is None else int(depth),
                value.pooled, value.stop)


def check_gammas(policy, value, batch_size: int) -> torch.Tensor:
    """Turn a policy's answer into a [B] long tensor, or raise an error naming the policy and the fix. Python and
    NumPy integers and 0-d integer tensors mean the same gamma for every row."""
    expected = f"an int in [0, {MAX_WIDTH}] or {batch_size} such ints (one per active row)"
    gammas = None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        if not 0 <= int(value) <= MAX_WIDTH:      # one width for every row: checked on the host
            raise ValueError(f"{type(policy).__name__}.choose returned {value!r}; expected {expected}.")
        return torch.full((batch_size,), int(value), dtype=torch.long)
    if not isinstance(value, (bool, str, bytes)):
        try:
            gammas = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError):
            gammas = None
        if gammas is not None and gammas.dim() == 0:
            gammas = gammas.expand(batch_size)
    if (
        gammas is None
        or gammas.dtype.is_floating_point
        or gammas.dtype == torch.bool
        or gammas.dim() != 1
        or gammas.numel() != batch_size
        or bool((gammas < 0).any())
        or bool((gammas > MAX_WIDTH).any())
    ):
        raise ValueError(f"{type(policy).__name__}.choose returned {value!r}; expected {expected}.")
    return gammas.long()


def check_policy(policy) -> Policy:
    """The policy as a `Policy`, checked where it enters: a Policy as it is; an object with begin / choose / observe
    that does not subclass Policy, wrapped once (the same wrapper for the same object, so calls that share it share
    its lock) with the contract's defaults for what it lacks; anything else (a config string) refused."""
    if isinstance(policy, Policy):
        return policy
    if not all(callable(getattr(policy, name, None)) for name in ("begin", "choose", "observe")):
        raise TypeError(
            f"assistant_policy must be a spec_adapt Policy object (e.g. FixedLength(4), Nightjar()), got "
            f"{type(policy).__name__} {policy!r}."
        )
    with _LOCKS_GUARD:
        try:
            adapted = _ADAPTED.get(policy)
            if adapted is None:
                adapted = _ADAPTED[policy] = PolicyAdapter(policy)
            return adapted
        except TypeError:           # not weak-referenceable: a wrapper of this call's own
            return PolicyAdapter(policy)


class PolicyAdapter(Policy):
    """A policy that does not subclass Policy, seen through the contract: its own methods where it has them, the
    contract's defaults where it does not."""

    def __init__(self, policy):
        self.policy = policy
        for name in ("begin", "choose", "observe", "admit", "prefilled", "reset", "state_dict", "load_state_dict",
                     "batch_rows", "allows_free"):
            method = getattr(policy, name, None)
            if callable(method):
                setattr(self, name, method)
        self.needs_timing = bool(getattr(policy, "needs_timing", True))
        self.trees = bool(getattr(policy, "trees", False))
        self.width_binds_free = bool(getattr(policy, "width_binds_free", False))

    def __repr__(self) -> str:
        return repr(self.policy)


_LOCKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_ADAPTED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def policy_lock(policy) -> threading.RLock:
    """The lock the loop holds while it calls `policy` (begin, choose, observe, batch_rows). One policy object may be
    shared by calls in several threads: its decisions are serialized, so one call never sees another's half-updated
    tables. What the calls observe goes into the same statistics (that is why one shares a policy). A policy that
    cannot be weakly referenced gets no shared lock: share such a policy across threads only if it is thread-safe."""
    with _LOCKS_GUARD:
        try:
            lock = _LOCKS.get(policy)
        except TypeError:           # not weak-referenceable (__slots__): a lock of this loop's own, not shared
            return threading.RLock()
        if lock is None:
            lock = _LOCKS[policy] = threading.RLock()
        return lock
