"""The argument types every `spec-adapt` subcommand shares: each parses one value or refuses it with argparse's own
error, so a value out of range never reaches a model load, a loop or an allocation it would size. Under `spec-adapt`
a refusal is one line, `spec-adapt: error: argument --option: takes ..., got '...'`, and exit status 2.

The upper bounds are the sizes nothing here can run, not preferences: a batch beyond the largest batch a learned
policy is exported for, a token count beyond any model's context, a serving schedule that would hold millions of
arrivals in memory before its first request.
"""

from __future__ import annotations

import argparse
import math
from typing import Callable, Iterable

from ..policies.adaptive import MAX_EXPORT_BATCH as MAX_BATCH     # the largest batch a policy is exported for

MAX_TOKENS = 1 << 20         # no model here has a context of a million tokens
MAX_CYCLES = 10_000          # the lab builds cycles x recorded requests up front, and replays them per policy
MAX_ARRIVALS = 1_000_000     # serve-bench draws a schedule's every arrival before the first one is served
MAX_SEED = (1 << 64) - 1     # torch.manual_seed's range


def whole(low: int, high: int | None = None, what: str = "a whole number") -> Callable[[str], int]:
    """An int in [low, high] (high None: no upper bound)."""
    span = f"from {low} to {high}" if high is not None else f"of at least {low}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"takes {what} {span}, got {text!r}")
        return value

    return parse


def finite(what: str) -> Callable[[str], float]:
    """A finite float above 0 (nan and inf are not finite: a loop or a schedule sized by them never ends)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"takes {what}, finite and above 0, got {text!r}")
        return value

    return parse


def name_in(names: Iterable[str], what: str, key: Callable[[str], object] = str) -> Callable[[str], str]:
    """One of `names` (two names are the same where `key` says so: aliases); returns the name as `names` spell it."""
    names = list(names)

    def parse(text: str) -> str:
        for name in names:
            if key(name) == key(text):
                return name
        raise argparse.ArgumentTypeError(f"takes {what}: {', '.join(names)}; got {text!r}")

    return parse


count = whole(1)             # prompts, rows, repeats, requests: a larger one is only a longer run
batch_size = whole(1, MAX_BATCH, what="a batch size")
tokens = whole(1, MAX_TOKENS, what="a number of tokens")
draft_length = whole(0, MAX_TOKENS, what="a number of draft tokens")
cycles = whole(1, MAX_CYCLES, what="a number of cycles")
bound_width = whole(1, 32, what="the widest draft of the bound's schedules")      # bench --bound
seed = whole(0, MAX_SEED, what="a seed")
megabytes = whole(1, what="a number of MiB")
port = whole(0, 65535, what="a TCP port (0 = any free one)")
rate = finite("a rate in requests per second")
seconds = finite("a number of seconds")
budget_mb = finite("a number of MB")
temperature = finite("a sampling temperature")


class Schedule(str):
    """A lab schedule as written (`static:B`, `batches:B`, `poisson:RATE`, `curve:RATE`), with its `kind` and
    parsed `value`; it is its own text wherever a string is wanted (report keys, printed headings)."""

    kind: str
    value: float


SCHEDULE_VALUES = {"static": batch_size, "batches": batch_size, "poisson": rate, "curve": rate}
CURVE_RATE = "20"            # `curve` alone: the curve's busy half at 20 requests per second


def schedule(text: str) -> Schedule:
    """The lab's --schedules: B a batch size, RATE a rate (`curve` alone: 20)."""
    kind, _, value = text.partition(":")
    if kind not in SCHEDULE_VALUES:
        raise argparse.ArgumentTypeError(f"takes schedules static:B, batches:B, poisson:RATE or curve:RATE, "
                                         f"got {text!r}")
    try:
        parsed = SCHEDULE_VALUES[kind](value or (CURVE_RATE if kind == "curve" else ""))
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{kind}: {exc}") from None
    out = Schedule(text)
    out.kind, out.value = kind, parsed
    return out


def phases(text: str) -> str:
    """RATE:SECONDS pairs (serve-bench's --phases), each rate and duration finite and positive, the schedule at
    most MAX_ARRIVALS expected arrivals; returned as written (serve_bench.parse_phases reads it)."""
    from .serve_bench import parse_phases

    try:
        pieces = parse_phases(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes RATE:SECONDS pairs joined by commas, each rate and duration finite "
                                         f"and above 0, got {text!r}") from None
    expected = sum(r * d for r, d in pieces)
    if expected > MAX_ARRIVALS:
        raise argparse.ArgumentTypeError(f"{ARRIVALS}, got {text!r} ({expected:.3g} arrivals)")
    return text


ARRIVALS = f"takes a schedule of at most {MAX_ARRIVALS} expected arrivals (rate x seconds)"
