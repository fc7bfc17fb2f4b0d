"""Serving under live load: requests join and leave a running speculative batch.

`Engine(model, drafter=..., assistant_policy=..., max_batch=...)`; `submit(prompt) -> Handle`; `handle.result()`,
`handle.stream()`, `handle.cancel()`. Drive it with `engine.step()` / `engine.run_until_idle()` (deterministic), or
`engine.start()` for a background thread that serves while other threads submit.

One engine iteration:
1. cancellations: waiting requests are dropped; running rows leave the batch (their tokens so far are kept);
2. admission (`ServingLoop.admit`): up to `max_batch - running` waiting requests are prefilled together (their own
   KV ledger, left padded), take the lowest free slots, their first token is committed, and their rows are appended
   to the running batch: the target's ledger and every draft ledger gain rows (`KVLedger.add_rows`,
   `JoinsRows.add_rows`), and the policy forgets what it kept for those slots (`Policy.admit`). The prefill, the first
   token and the drafter's begin are a generate call's own (`SpeculativeLoop._prefill`, `_first_tokens`,
   `_drafter_joins`);
3. one speculative step, exactly `SpeculativeLoop.step` (choose, propose, verify, accept, commit, observe, retire);
4. delivery: new tokens go to each request's handle; finished rows complete their handle;
5. the report: `engine.stats` as a generate call's end fills it (`SpeculativeLoop.report`: compactions, kernel paths,
   the verifier's counters, the drafter's events), counting everything served so far.

A step deadline (`Engine(step_timeout=s)`): the drafter's calls of one iteration run in a thread of their own and
get s seconds together; a call that overruns them is abandoned and the drafter dropped, as after a failure
(`ServingLoop._guard`), so no request waits on it. The target's forwards have no deadline: Python cannot interrupt
them, and `stop(timeout=...)` returns on time regardless.

The loop's step never sees admission: the phases read the active rows, whatever their number. A row's number (its
slot) is its request's for the request's life; drafters and policies key per-row state by it, and a later request
may reuse it.

Per request: the prompt, max_new_tokens, and its sampling (`submit(..., temperature=, top_k=, top_p=, seed=)`,
defaulting to the engine's `do_sample` / `temperature` / `top_k` / `top_p`): greedy and sampled requests share one
batch, each row processed by its own parameters (spec_adapt.serving.sampling). Per engine: one set of EOS ids. Under
sampling a request's tokens depend on its seed and prompt, or without a seed on the engine's seed and its admission
number (spec_adapt.noise), never on which requests share its steps nor on the widths; so a seeded request repeats
exactly, and unseeded runs repeat where requests are admitted in the same order (a deterministic drive: `step()` with
a fixed submission schedule).

The end (`stop()`): the requests not finished fail, the drafter ends and the statistics are final (`stats.time_total`
counts from the engine's construction), as at the end of a generate call; a later `start()` begins the drafter again.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from ..api import check_parts
from ..distributed import ranks_of
from ..drafters.drafter import join_rows
from ..acceptor import Acceptor
from ..ledger import KVLedger, positions_from_cache
from ..loop import SpeculativeLoop, target_ledger
from ..rows import Rows
from ..stopping import Stopper
from ..metrics import SpecStats
from ..noise import call_seed, mix64, prompt_digest, prompt_key
from ..policies.adaptive import Adaptive
from ..running_estimates import ProbeBackoff
from ..processors import ScoreProcessor
from .sampling import RowSampling, Sampling


UNPROCESSED = ScoreProcessor(None)     # greedy rows alone: no processor (it keeps no state, so one serves every loop)


class RequestError(ValueError):
    """A request the engine refused; it is set on the request's handle and raised by `result()`."""


class QueueFull(RequestError):
    """A request refused because the waiting queue holds `Engine(max_waiting=...)` requests: retry later."""


class EngineError(RuntimeError):
    """The engine could not finish a request: the target (or a policy) failed in a step the request was part of, or
    the engine was stopped or died. Set on the request's handle and raised by `result()`."""


@dataclass
class Handle:
    """One request. `tokens`: generated so far; `state`: waiting, running, done, cancelled or failed."""

    id: int
    prompt: torch.Tensor
    max_new_tokens: int
    engine: "Engine"
    sampling: Sampling = Sampling()
    state: str = "waiting"
    tokens: list = field(default_factory=list)
    error: Exception | None = None
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    finished: float | None = None
    _done: threading.Event = field(default_factory=threading.Event)
    _stream: queue.Queue = field(default_factory=queue.Queue)
    # Called (in the engine's thread, without arguments) after new tokens or the end reach the handle: an event loop
    # waiting on the request wakes then instead of polling (spec_adapt.serving.openai_api).
    on_update: object = None

    def result(self, timeout: float | None = None) -> list[int]:
        """The generated tokens (up to and including EOS), once the request is done or cancelled. Raises the
        request's error if it failed, TimeoutError after `timeout` seconds, and EngineError at once when nobody
        drives the engine (neither `start()`ed nor stepped lately), where waiting would never end."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        while not self._done.is_set():
            left = None if deadline is None else deadline - time.perf_counter()
            if left is not None and left <= 0:
                raise TimeoutError(f"request {self.id} not finished after {timeout} s")
            if not self.engine.driven():
                raise EngineError(f"request {self.id} is {self.state} and nobody drives the engine: call "
                                  "engine.start() to serve from a thread, or engine.step() / run_until_idle().")
            self._done.wait(0.05 if left is None else min(0.05, left))
        if self.error is not None:
            raise self.error
        return list(self.tokens)

    def stream(self, timeout: float | None = None):
        """Yield tokens as they are committed (several per step when drafts are accepted)."""
        while True:
            item = self._stream.get(timeout=timeout)
            if item is None:
                return
            yield item

    def cancel(self) -> None:
        self.engine.cancel(self)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def _push(self, tokens: list[int]) -> None:
        if self._done.is_set():           # failed by a stop that did not wait for the step: its end stays
            return
        if tokens and self.first_token is None:
            self.first_token = time.perf_counter()
        self.tokens.extend(tokens)
        for t in tokens:
            self._stream.put(t)
        if tokens:
            self._notify()

    def _finish(self, state: str, error: Exception | None = None) -> None:
        if self._done.is_set():           # the first end a request is given is its end
            return
        self.state, self.error, self.finished = state, error, time.perf_counter()
        self._stream.put(None)
        self._done.set()
        self._notify()

    def _notify(self) -> None:
        if self.on_update is None:
            return
        try:
            self.on_update()
        except Exception:  # noqa: BLE001 - a listener that is gone (its event loop closed) never reaches the engine
            self.on_update = None


class ServingLoop(SpeculativeLoop):
    """SpeculativeLoop with an admission phase. It starts with no rows; `admit` appends rows, `step` is inherited.

    Rows are slots: a request takes the lowest slot no running request holds, so the buffer, the per-row counters
    and whatever drafters and policies keep per row number are bounded by the most requests ever running at once,
    not by the requests served. A drafter that failed is tried again after a back-off (`restarts`)."""

    closed = False    # requests join as others leave: a step is worth the tokens it commits (throughput)

    def __init__(self, model, *, drafter, policy, eos, pad_id, max_length, acceptor, verifier,
                 step_timeout: float | None = None, samples: bool = False):
        self._set_parts(model, drafter=drafter, policy=policy, processor=UNPROCESSED, sampling=False,
                        acceptor=acceptor, verifier=verifier, stats=SpecStats())
        # Each request's own sampling parameters, per slot; the loop samples while some running row does.
        self.row_sampling = RowSampling(self.device)
        self.sampled = ScoreProcessor([self.row_sampling])
        self.stopper = Stopper([], max_length, self.device)
        self.stopper.eos = eos
        self.rows_state = Rows.empty(self.device, pad_id)      # slots, each with the left padding of its row
        # Sampling's keyed noise (spec_adapt.noise): per slot the key of the request it holds: from the request's
        # own seed and prompt, or else from the engine's seed (drawn once from torch's global generator) and the
        # request's admission number, so a request's tokens do not depend on which requests shared its steps, nor on
        # the widths they were drafted at. `samples`: whether requests sample unless they say otherwise (the seed is
        # then drawn now, else when the first request that samples without a seed of its own is admitted).
        self.seed = call_seed() if samples else None
        self.choice.keys = []
        self.admitted = 0
        self.target: KVLedger | None = None          # made by the first admission
        self.clock.start()
        self._begin(0)
        self.policy.begin(0)
        self.rows_state.vocab = model.get_output_embeddings().weight.shape[0]
        # After a drafter fails: steps to wait before restarting it (doubling while it keeps failing soon after a
        # restart) and the steps it has run since its last (re)start.
        self.restarts, self.healthy = ProbeBackoff(16, 1024), 1 << 30
        # step_timeout: the seconds the drafter's calls of one engine step may take together (`draft_time` counts
        # them; the engine zeroes it at each step). The calls then run in a thread of their own, so that the engine
        # can stop waiting for one; `late` is the thread left running a call it stopped waiting for, or the
        # drafter's end after a drop, and the drafter restarts only once that thread is idle.
        self.step_timeout, self.draft_time = step_timeout, 0.0
        self.calls = _DrafterThread() if step_timeout is not None else None
        self.late: _DrafterThread | None = None

    def set_sampling(self, on: bool) -> None:
        """Sample (each row by its own parameters, greedy rows by their argmax) or run the greedy path, from the next
        phase on: the engine samples while some running or joining request does."""
        self.choice.set(self.sampled if on else UNPROCESSED, on, self.acceptor.rule)

    def admit(self, prompts: list[torch.Tensor], budgets: list[int],
              samplings: list[Sampling] | None = None) -> torch.Tensor:
        """Prefill `prompts` (1-D token tensors) together, commit their first token and append their rows to the
        running batch. `samplings`: each request's parameters (default greedy). Returns the slots (user-row numbers)
        they take."""
        samplings = samplings or [Sampling()] * len(prompts)
        n, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((n, width), self.rows_state.pad_id, dtype=torch.long, device=self.device)
        mask = torch.zeros(n, width, dtype=torch.long, device=self.device)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):], mask[i, width - len(p):] = p.to(self.device), 1
        # The prefill first: if the target fails there, nothing of the running batch has changed yet.
        joining = target_ledger(self.model, self.given_drafter, self.acceptor.mode)
        logits = self._prefill(joining, ids, mask)                                  # [n, 1, V]
        new_rows = self.rows_state.take_slots(n)
        limits = width + torch.tensor(budgets, dtype=torch.long, device=self.device)
        self.rows_state.place(new_rows, ids, mask, limits)
        self.stats.admit(new_rows.tolist())
        self.policy.admit(new_rows.tolist())
        self.row_sampling.set(new_rows.tolist(), samplings)
        self._key_rows(new_rows.tolist(), prompts, samplings)
        finished = self._first_tokens(new_rows, logits)
        first_rows = self.target is None
        if first_rows:
            self.target = joining
        else:
            self.target.add_rows(joining)
        self.rows_state.join(new_rows, finished)
        # The first rows begin the drafter as a call's batch does (nothing runs: the slots taken are 0..n-1, the rows
        # a call's begin numbers); later ones join it.
        self._drafter_joins("admission", ids, mask, None if first_rows else new_rows, joining.hidden)
        self._retire()
        return new_rows

    def _key_rows(self, slots: list[int], prompts, samplings) -> None:
        """Each admitted request's noise key in its slot: a seeded request's is the key its prompt has in a generate
        call with that seed (so it repeats whatever runs beside it); the others' the engine's seed and their
        admission number."""
        keys = self.choice.keys
        keys.extend([0] * (max(slots) + 1 - len(keys)))
        for slot, prompt, sampling in zip(slots, prompts, samplings):
            seed = sampling.seed
            if seed is None and sampling.samples and self.seed is None:
                self.seed = call_seed()
            keys[slot] = (mix64((self.seed or 0) ^ mix64(self.admitted)) if seed is None
                          else prompt_key(seed, prompt_digest(prompt), 0))
            self.admitted += 1

    def step(self) -> None:
        self._restart_drafter()
        super().step()
        if self.drafter is not None:
            self.healthy += 1

    def _guard(self, what, fn, *args):
        """The loop's guard; under a step deadline the call runs in the drafter's thread and is waited for up to what
        is left of the step's draft budget. A call that overruns it runs on there, its result unread, and the
        drafter is dropped as after a failure."""
        if self.calls is None:
            return super()._guard(what, fn, *args)
        began = time.perf_counter()
        call = self.calls.submit(fn, args)
        done = call.done.wait(max(self.step_timeout - self.draft_time, 0.0))
        self.draft_time += time.perf_counter() - began
        if not done:
            self._drop_drafter(f"draft {what} overran the step deadline (step_timeout={self.step_timeout:g} s of "
                               "drafter calls per step)")
            return None
        if call.error is not None:
            return super()._guard(what, _reraise, call.error)
        return call.result

    def _drop_drafter(self, why: str) -> None:
        if self.calls is not None and self.drafter is not None:
            # The drafter's thread may still be inside the call the engine stopped waiting for: the drafter's end
            # runs there after it, never beside it, and later calls go to a new thread.
            self.late, self.calls = self.calls, _DrafterThread()
            self.drafter = _EndAfter(self.drafter, self.late)
        super()._drop_drafter(why)
        self.restarts.result(won=self.healthy >= self.restarts.max_gap)   # back off, longer if it failed soon again
        self.healthy = 0

    def _restart_drafter(self) -> None:
        """After the back-off, the drafter that failed starts again on the running rows (their tokens so far as its
        prompts; a draft model catches up on them at its first proposal). If it fails again, the wait doubles."""
        if self.drafter is not None or self.given_drafter is None or not len(self.rows_state.rows):
            return
        self.restarts.wait()
        if not self.restarts.due():
            return
        if self.late is not None:
            if not self.late.idle():      # a call the drafter was dropped in still runs: one call at a time
                return
            self.late = None
        rows = self.rows_state.rows
        width = int(self.rows_state.lengths[rows].max())
        ids = self.rows_state.buffer[rows, :width]
        mask = (torch.arange(width, device=self.device)[None, :] >= self.rows_state.pads[rows, None]).long()
        self.drafter = self.given_drafter
        if self._guard("restart", self._begin_drafter, self.drafter, ids, mask, rows.tolist()):
            self.stats.restarts += 1

    @staticmethod
    def _begin_drafter(drafter, ids, mask, rows) -> bool:
        drafter.begin(ids[:0], mask[:0])
        join_rows(drafter, ids, mask, rows)
        return True

    def drafter_idle(self) -> bool:
        """Whether no drafter call runs on after the engine stopped waiting for it (nor the end that follows it)."""
        return self.late is None or self.late.idle()

    def reset_rows(self) -> None:
        """Forget every running row after a failure that left the batch's state unknown: the next admission starts a
        new target batch. The drafter is dropped like after its own failure, and restarted after the back-off."""
        self.rows_state.clear()
        self._let_go_target()
        if self.drafter is not None:
            self._drop_drafter("the batch was reset after a failure")

    def end(self) -> None:
        """The engine stopped, no row running: the drafter ends and the statistics are final as at the end of a
        generate call; the next admission starts a new target batch and begins the drafter again. Nothing begun
        since the last end (no admission): only the statistics."""
        if self.target is None:
            self.report()
            self.stats.time_total = self.clock.elapsed()
            return
        self._let_go_target()
        super().end()

    def _let_go_target(self) -> None:
        """The target batch is let go (the next admission starts a new one); what it compacted stays counted."""
        if self.target is not None:
            count, path = self.compacted
            self.compacted = (count + self.target.compactions, self.target.compact_path or path)
        self.target = None

    def drop(self, rows: list[int]) -> None:
        """Cancelled rows leave the batch now (what they committed stays theirs)."""
        state = self.rows_state
        state.finished = state.finished | torch.isin(state.rows, torch.tensor(rows, device=self.device))
        self._retire()


class Engine:
    """A speculative serving engine over one target model (see the module docstring)."""

    def __init__(self, model, drafter=None, assistant_policy=None, max_batch: int = 8, max_new_tokens: int = 64,
                 do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, eos_token_id="model", pad_token_id: int | None = None,
                 verifier=None, acceptor: Acceptor | None = None, tokenizer=None, seed: int | None = None,
                 memory=None, timeline: bool = False, step_timeout: float | None = None,
                 max_waiting: int | None = None):
        step_timeout = _check_step_timeout(step_timeout)
        if max_waiting is not None and (isinstance(max_waiting, bool) or not isinstance(max_waiting, int)
                                        or max_waiting < 0):
            raise ValueError(f"max_waiting must be None (no bound) or an int >= 0, got {max_waiting!r}.")
        if do_sample and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                          or not temperature > 0):
            raise ValueError(f"temperature must be > 0 when sampling, got {temperature!r}.")
        # What a request samples with unless it says otherwise (greedy when do_sample is False).
        self.sampling = Sampling(float(temperature) if do_sample else 0.0, top_k or 0,
                                 1.0 if top_p is None else top_p)
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be a positive int, got {max_batch!r}.")
        if ranks_of(model).sharded:
            raise ValueError("The Engine serves a model held by one process; a target sharded over processes "
                             "speculates in model.generate (docs/distributed.md), and serving at scale is vLLM's "
                             "or SGLang's job (docs/serving.md).")
        reason = positions_from_cache(model)
        if reason is not None:
            raise ValueError(f"The Engine places requests that join at different cache columns, but {reason}: "
                             "serve this model with model.generate (batches run in lockstep there).")
        self.model, self.tokenizer, self.max_batch = model, tokenizer, max_batch
        self.max_new_tokens = _check_budget(max_new_tokens)
        policy = assistant_policy if assistant_policy is not None else Adaptive()
        drafter, policy, verifier = check_parts(model, drafter, policy, verifier)
        if seed is not None:
            torch.manual_seed(seed)
        # eos_token_id: "model" = the model's generation config; None = no EOS (every request runs to its budget).
        eos = model.generation_config.eos_token_id if eos_token_id == "model" else eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        pad = pad_token_id if pad_token_id is not None else (model.generation_config.pad_token_id or
                                                              (eos[0] if eos else 0))
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self.vocab = model.get_output_embeddings().weight.shape[0]
        self.loop = ServingLoop(
            model, drafter=drafter, policy=policy, eos=torch.tensor(eos, device=model.device) if eos else None,
            pad_id=int(pad), max_length=1 << 30, acceptor=acceptor or Acceptor(), verifier=verifier,
            step_timeout=step_timeout, samples=self.sampling.samples)
        self.max_waiting = max_waiting
        self.waiting: list[Handle] = []
        self.running: dict[int, Handle] = {}        # user row -> handle
        self.delivered: dict[int, int] = {}         # user row -> buffer length already delivered
        self.cancelled: set[int] = set()
        self.lock = threading.Lock()
        self.ids = itertools.count()
        self.timeline: list[dict] = []
        self.record_timeline(timeline)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._closed: str | None = None             # why the engine takes no more requests (stopped, died)
        self.error: BaseException | None = None     # what killed the engine's thread, if anything did
        self._last_step = -float("inf")             # perf_counter of the last step begun or ended (see `driven`)
        self._stepping = 0                          # steps running now, in whichever thread drives the engine
        # memory: a MemoryBudget (spec_adapt.serving.memory); admission then also waits for memory, not only max_batch.
        self.memory = memory
        if memory is not None:
            memory.bind(self)

    # -- the user's side -----------------------------------------------------------------------------------------------
    def submit(self, prompt, max_new_tokens: int | None = None, **sampling) -> Handle:
        """Queue a request: a 1-D token tensor / list of ids, or text when the engine has a tokenizer. `sampling`:
        this request's own `temperature` (0 = greedy), `top_k`, `top_p` and `seed` (spec_adapt.serving.sampling),
        each defaulting to the engine's. A request the engine cannot serve is returned already failed, with the reason
        in `handle.error` (QueueFull when `max_waiting` requests wait already)."""
        handle = Handle(next(self.ids), torch.zeros(0, dtype=torch.long), self.max_new_tokens, self)
        try:
            handle.prompt, handle.max_new_tokens = self._check(prompt, max_new_tokens)
            handle.sampling = self._check_sampling(sampling)
        except RequestError as exc:
            handle._finish("failed", exc)
            return handle
        with self.lock:
            if self._closed is not None:
                handle._finish("failed", EngineError(f"the engine takes no requests: {self._closed}"))
                return handle
            if self.max_waiting is not None and len(self.waiting) >= self.max_waiting:
                handle._finish("failed", QueueFull(f"{len(self.waiting)} requests wait already (max_waiting="
                                                   f"{self.max_waiting}): retry later."))
                return handle
            self.waiting.append(handle)
        self._wake.set()
        return handle

    def cancel(self, handle: Handle) -> None:
        with self.lock:
            if handle in self.waiting:
                self.waiting.remove(handle)
                handle._finish("cancelled")
            elif not handle.done:
                self.cancelled.add(handle.id)

    def _check_sampling(self, given: dict) -> Sampling:
        unknown = set(given) - {"temperature", "top_k", "top_p", "seed"}
        if unknown:
            raise RequestError(f"Unknown request parameters {sorted(unknown)}: a request takes temperature, top_k, "
                               "top_p and seed besides its prompt and max_new_tokens.")
        try:
            return dataclasses.replace(self.sampling, **{k: v for k, v in given.items() if v is not None})
        except ValueError as exc:
            raise RequestError(str(exc)) from exc

    def _check(self, prompt, max_new_tokens):
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("A text prompt needs Engine(..., tokenizer=...); or submit token ids.")
            prompt = self.tokenizer(prompt, return_tensors="pt").input_ids[0]
        try:
            ids = torch.as_tensor(prompt)
        except Exception as exc:  # noqa: BLE001 - whatever a user hands in fails its own handle, never submit()
            raise RequestError(f"A prompt is a 1-D list/tensor of token ids or a string, got {type(prompt).__name__}"
                               ) from exc
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise RequestError(f"A prompt is a non-empty 1-D sequence of integer token ids, got shape "
                               f"{tuple(ids.shape)} of {ids.dtype}.")
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab:
            raise RequestError(f"Prompt token ids must lie in [0, {self.vocab}), got {int(ids.min())}.."
                               f"{int(ids.max())}.")
        try:
            budget = _check_budget(self.max_new_tokens if max_new_tokens is None else max_new_tokens)
        except ValueError as exc:
            raise RequestError(str(exc)) from exc
        if self.max_positions is not None and len(ids) + budget > self.max_positions:
            raise RequestError(f"Prompt ({len(ids)} tokens) + max_new_tokens ({budget}) exceeds the model's "
                               f"{self.max_positions} positions: shorten the prompt or lower max_new_tokens.")
        if self.memory is not None and not self.memory.fits_alone(len(ids) + budget):
            raise RequestError(f"Prompt ({len(ids)} tokens) + max_new_tokens ({budget}) needs more KV memory than "
                               f"the engine's budget holds even alone: shorten the prompt, lower max_new_tokens or "
                               f"raise the budget.")
        return ids.long(), budget

    # -- the engine's side -----------------------------------------------------------------------------------------------
    @torch.inference_mode()          # no autograd graph on the cache, in whichever thread drives the engine
    def step(self) -> bool:
        """One iteration: cancellations, admission, one speculative step, delivery. Returns whether work remains.

        A failure of the target or the policy fails the requests of that admission or step, with the error on their
        handles; the engine's ledgers are back where they were accounted, and it goes on serving.
        Refused (EngineError) while the engine's own thread serves, or still finishes a step after `stop`: two
        drivers would race on the batch."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread() and thread.is_alive():
            raise EngineError("the engine's thread is running (or still finishing a step after stop()): step() and "
                              "run_until_idle() drive an engine no thread serves; call stop(timeout=None) first.")
        self._last_step = time.perf_counter()
        self._stepping += 1
        self.loop.draft_time = 0.0          # each step's drafter calls get the whole step_timeout
        try:
            busy = self._step()
            self.loop.report()      # in the thread that steps, so nothing reported changes while it is read out
            return busy
        finally:
            self.loop.draft_time = 0.0      # and a call between steps (a stop failing the rows) gets it too
            self._stepping -= 1
            self._last_step = time.perf_counter()

    def _step(self) -> bool:
        with self.lock:
            cancelled, self.cancelled = self.cancelled, set()
            room = self.max_batch - len(self.running)
            if self.memory is not None:
                room = self.memory.admissible(self.waiting[:room])
            joining, self.waiting = self.waiting[:room], self.waiting[room:]
        self._cancel_running(cancelled)
        self.loop.set_sampling(any(h.sampling.samples for h in [*joining, *self.running.values()]))
        if joining:
            try:
                rows = self.loop.admit([h.prompt for h in joining], [h.max_new_tokens for h in joining],
                                       [h.sampling for h in joining])
            except Exception as exc:  # noqa: BLE001 - the requests of this admission fail; the rest go on
                for handle in joining:
                    handle._finish("failed", EngineError(f"admission failed ({type(exc).__name__}: {exc})"))
                rows = None
            if rows is not None:
                for row, handle in zip(rows.tolist(), joining):
                    handle.state = "running"
                    self.running[row] = handle
                    self.delivered[row] = int(self.loop.rows_state.starts[row])
                self._deliver()
        if len(self.loop.rows_state.rows):
            try:
                self.loop.step()
            except Exception as exc:  # noqa: BLE001 - the running requests fail; the engine serves on
                self._fail_running(EngineError(f"a step failed ({type(exc).__name__}: {exc})"))
                with self.lock:
                    return bool(self.running or self.waiting)
            if self._timeline:
                record, drafter = self.loop.stats.trace[-1], self.loop.drafter
                self.timeline.append({"time": time.perf_counter(), "batch_size": record.batch_size,
                                      "gammas": record.gammas, "waiting": len(self.waiting), "draft_resident":
                                      drafter is not None and not drafter.offloaded})
            self._deliver()
        with self.lock:
            return bool(self.running or self.waiting)

    def record_timeline(self, on: bool = True) -> None:
        """Keep every StepRecord and a per-step timeline (time, batch size, gammas, waiting, draft residency), as
        serve-bench does. Off (the default), the engine keeps its last few StepRecords only, so its memory does not
        grow with the steps it has run."""
        self._timeline = bool(on)
        self.loop.stats.trace_limit = None if on else 64

    def run_until_idle(self, max_steps: int | None = None) -> None:
        for _ in itertools.count() if max_steps is None else range(max_steps):
            if not self.step():
                return

    def start(self) -> "Engine":
        """Serve from a background thread until `stop()`."""
        def serve():
            try:
                while not self._stop.is_set():
                    if not self.step():
                        self._wake.wait(0.01)
                        self._wake.clear()
                # Stopped: a stop() that returned before this step ended has failed the requests; their rows leave
                # the batch here, so the engine is clean for start() (or step()) whoever comes next.
                self._close(self._closed or "the engine was stopped")
            except BaseException as exc:  # noqa: BLE001 - a dead engine must fail its handles, not leave them waiting
                self.error = exc
                self._close(f"the engine's thread died ({type(exc).__name__}: {exc})")
        if self._thread is not None and self._thread.is_alive():
            raise EngineError("the engine's thread is running (or still finishing a step after stop()): call "
                              "stop(timeout=None) to wait for it, then start() again.")
        with self.lock:
            self._closed = None
        self._stop.clear()
        self._thread = threading.Thread(target=serve, name="spec_adapt-engine", daemon=True)
        self._thread.start()
        return self

    stop_timeout = 5.0     # seconds `stop()` waits for the current step at most, unless given its own timeout

    def stop(self, timeout: float | None | str = "engine") -> None:
        """Stop serving: the thread ends after its current step, and every request not finished fails with an
        EngineError (as does any request submitted later, until `start()` again).

        `timeout`: return after at most this many seconds even if the current step has not ended (a drafter or a
        target blocked in a call); by default the engine's `stop_timeout` (5 s), None = wait for the step however
        long it takes. A stop that returns first fails the requests at once; the thread ends the step's rows and
        exits when its step returns, and until then `start()` and `step()` are refused (a later `stop()` waits
        for it as above)."""
        if timeout == "engine":
            timeout = self.stop_timeout
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():           # the step still runs: fail the handles, leave its state to the thread
                self._fail_handles("the engine was stopped while a step was still running")
                return
        self._close("the engine was stopped")

    def _fail_handles(self, why: str) -> None:
        with self.lock:
            self._closed = why
            handles, self.waiting = self.waiting + list(self.running.values()), []
        for handle in handles:
            handle._finish("failed", EngineError(f"request not finished: {why}"))

    def driven(self) -> bool:
        """Whether anything drives the engine: its thread is alive, a step is running now (however long a target's
        verification takes), or one ended in the last second (a caller's loop between two steps)."""
        thread = self._thread
        return ((thread is not None and thread.is_alive()) or self._stepping > 0
                or time.perf_counter() - self._last_step < 1.0)

    def _close(self, why: str) -> None:
        with self.lock:
            self._closed = why
            waiting, self.waiting = self.waiting, []
        for handle in waiting:
            handle._finish("failed", EngineError(f"request not served: {why}"))
        if self.running:
            self._fail_running(EngineError(f"request not finished: {why}"))
        self.loop.end()          # the drafter ends and the statistics are final, as at a generate call's end

    def _fail_running(self, error: EngineError) -> None:
        """Every running request ends with `error` (the tokens it was given so far stay on its handle), and its
        row leaves every ledger."""
        self._deliver()
        rows = list(self.running)
        try:
            self.loop.drop(rows)
        except Exception:  # noqa: BLE001 - the rows are gone either way: start the batch afresh
            self.loop.reset_rows()
        for row in rows:
            handle = self.running.pop(row)
            self.delivered.pop(row, None)
            handle._finish("failed", error)

    def _deliver(self, cancelled: frozenset = frozenset()) -> None:
        """New tokens to their handles; rows that left the batch complete theirs (done, or cancelled)."""
        state = self.loop.rows_state
        active = set(state.rows.tolist())
        for row in list(self.running):
            length = int(state.lengths[row])
            handle = self.running[row]
            if length > self.delivered[row]:
                handle._push(state.buffer[row, self.delivered[row] : length].tolist())
                self.delivered[row] = length
            if row not in active:
                del self.running[row]
                del self.delivered[row]
                handle._finish("cancelled" if row in cancelled else "done")

    def _cancel_running(self, ids: set[int]) -> None:
        rows = [row for row, h in self.running.items() if h.id in ids]
        if rows:
            self.loop.drop(rows)
            self._deliver(frozenset(rows))

    @property
    def stats(self) -> SpecStats:
        return self.loop.stats

    @property
    def fallback(self) -> str | None:
        return self.loop.stats.fallback


class _Call:
    """One drafter call for the drafter's thread: run under the grad and inference modes (thread-local) of the thread
    that made it; its result or error, once `done` is set."""

    def __init__(self, fn, args):
        self.fn, self.args = fn, args
        self.inference, self.grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()
        self.done = threading.Event()
        self.result, self.error = None, None

    def run(self) -> None:
        try:
            with torch.set_grad_enabled(self.grad), torch.inference_mode(self.inference):
                self.result = self.fn(*self.args)
        except BaseException as exc:  # noqa: BLE001 - handed to the engine's thread, which decides
            self.error = exc
        finally:
            self.fn = self.args = None
            self.done.set()


class _DrafterThread:
    """Runs drafter calls one at a time, in order, in a daemon thread, so that the engine can stop waiting for one
    (which then runs on, and whatever was queued after it). The thread ends after a few idle seconds and starts
    again with the next call, so an engine that is dropped leaves none behind."""

    idle_seconds = 5.0

    def __init__(self):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pending = 0                           # calls queued or running

    def submit(self, fn, args=()) -> _Call:
        call = _Call(fn, args)
        with self._lock:
            self._pending += 1
            self._calls.put(call)
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="spec_adapt-drafter", daemon=True)
                self._thread.start()
        return call

    def idle(self) -> bool:
        with self._lock:
            return self._pending == 0

    def _serve(self) -> None:
        while True:
            try:
                call = self._calls.get(timeout=self.idle_seconds)
            except queue.Empty:
                with self._lock:             # a call submitted meanwhile is served by this thread, not lost
                    if self._pending == 0:
                        self._thread = None
                        return
                continue
            call.run()
            del call
            with self._lock:
                self._pending -= 1


class _EndAfter:
    """A dropped drafter as the loop's drop sees it: its `end` is queued in the drafter's thread, after whatever call
    still runs there, and not waited for."""

    def __init__(self, drafter, thread: _DrafterThread):
        self.drafter, self.thread = drafter, thread

    def end(self, *args) -> None:
        self.thread.submit(self.drafter.end, args)


def _reraise(error: BaseException):
    raise error


def _check_budget(n) -> int:
    """A positive whole number of tokens: a Python, NumPy or 0-d torch integer."""
    if torch.is_tensor(n) and n.dim() == 0 and not n.dtype.is_floating_point and n.dtype != torch.bool:
        n = int(n)
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {n!r}.")
    return int(n)


def _check_step_timeout(seconds) -> float | None:
    """None, or a positive, finite number of seconds (a Python or NumPy real; a bool is no duration)."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not math.isfinite(seconds) \
            or seconds <= 0:
        raise ValueError(f"step_timeout must be None or a positive, finite number of seconds, got {seconds!r}.")
    return float(seconds)
