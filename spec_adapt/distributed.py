"""Speculation on a target sharded over several processes (transformers' tensor or pipeline parallelism, torchrun).

Every rank runs the same loop on its shard of the target, and the target's collectives need every rank to feed the
same shapes at every step. So every decision the loop takes is taken once, on the group's first rank (the leader),
and broadcast: the policy's plan, the drafter's proposal, the acceptance (the sampled tokens too), the stopping
criteria's verdict and the batch shape after rows finish. The other ranks (followers) run no drafter and no policy
of their own: a rank that would time differently, or a drafter that would fail on one rank only, cannot make them
disagree. A decision that raises on the leader raises on every rank, so none waits for the others forever.

The draft runs on the leader only, with its tokens broadcast. A replicated draft would cost every rank the same time
and memory while the leader drafts; here the followers wait for the proposal instead, hold no draft, and cannot
disagree with the leader about it. The broadcast is small next to a target forward: B x (gamma + a few) integers,
and draft probabilities only under sampling.
"""

from __future__ import annotations

import torch

from .drafters.drafter import JoinsRows, Proposal, Trees
from .policies.policy import Policy


class Solo:
    """One process holds the whole target: every decision is taken here."""

    leader, sharded = True, False

    def decide(self, fn, *args):
        return fn(*args)


class Ranks(Solo):
    """The processes of `group` hold shards of the target: the leader (the group's first rank) decides."""

    def __init__(self, group, device):
        import torch.distributed as dist

        self.dist, self.group, self.device, self.sharded = dist, group, device, True
        self.source = dist.get_global_rank(group, 0) if group is not None else 0
        self.leader = dist.get_rank() == self.source

    def decide(self, fn, *args):
        """The leader runs `fn(*args)` and every rank returns its answer; if it raised, every rank raises."""
        if self.leader:
            try:
                result = fn(*args)
            except Exception as exc:  # noqa: BLE001 - the followers must hear of it, or they wait forever
                self._send(("error", f"{type(exc).__name__}: {exc}"))
                raise
            self._send(("ok", _to(result, "cpu")))
            return result
        kind, answer = self._send(None)
        if kind == "error":
            raise RuntimeError(f"the leading rank failed: {answer}")
        return _to(answer, self.device)

    def _send(self, message):
        box = [message]
        self.dist.broadcast_object_list(box, src=self.source, group=self.group)
        return box[0]


def ranks_of(model) -> Solo:
    """Ranks when `model` is sharded over processes by transformers (a device mesh of more than one rank), else Solo.
    A model replicated per rank (data parallel) is not sharded: each rank speculates on its own."""
    mesh = getattr(model, "_device_mesh", None) or getattr(model, "device_mesh", None)
    if mesh is None:
        return Solo()
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or mesh.size() <= 1:
        return Solo()
    group = mesh.get_group() if mesh.ndim == 1 else None     # a mesh of several dimensions: the whole world
    return Ranks(group, model.device)


class FollowerDrafter(Trees, JoinsRows):
    """A follower's drafter: it never drafts (the leader's proposal is broadcast) and keeps no state."""

    def propose(self, request):
        return Proposal.empty(len(request.gammas), request.tokens.device)

    def add_rows(self, input_ids, attention_mask, rows):
        pass


class FollowerPolicy(Policy):
    """A follower's policy: never asked (the leader's plan is broadcast)."""

    needs_timing = False

    def choose(self, info):
        return 0


def _to(value, device):
    """Tensors inside `value` (nested in tuples, lists, dicts and dataclass-like objects) moved to `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, Proposal):
        return Proposal(_to(value.tokens, device), _to(value.lengths, device), _to(value.probs, device),
                        value.telemetry, _to(value.parents, device))
    return value
