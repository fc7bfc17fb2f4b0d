"""Stopping criteria for multi-token commits: where each row of a step stops, written into the loop's token buffer."""

from __future__ import annotations

import torch

from .compat import EosTokenCriteria, MaxLengthCriteria
from .positions import offsets


class Stopper:
    """Stopping criteria for multi-token commits: a row stops at the first committed token after which stock
    generate would have stopped it. EOS and max length are vectorized; other criteria are asked token by token with
    that row's sequence (as a batch of one).

    Without an EOS id, stock pads no finished row: a row another criterion stopped goes on writing its own tokens,
    and the call ends when every row has stopped, every row then as long as the one that stopped last. With
    `together` (a generate call's batch) that is what happens here: `cut` notes where each row stopped (`reach`) and
    lets it go on; once every row has, `settle` ends the rows at the longest reach, taking back tokens a row had
    committed past it (a negative count), and the rows short of it generate up to it. A serving engine's rows are
    requests of their own: they stop where they stop."""

    def __init__(self, criteria, max_length: int, device, together: bool = False):
        criteria = list(criteria or [])
        lengths = [c.max_length for c in criteria if isinstance(c, MaxLengthCriteria)] + [max_length]
        self.max_length = min(x for x in lengths if x is not None)
        eos = [c.eos_token_id.to(device).flatten() for c in criteria if isinstance(c, EosTokenCriteria)]
        self.eos = torch.cat(eos) if eos else None
        self.others = [c for c in criteria if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))]
        self.together = together
        self.reach = None     # [B0] per user row: the length at which it stopped, -1 = not yet (`waits` only)

    @property
    def waits(self) -> bool:
        """Whether a row a criterion stopped goes on until every row has stopped (no EOS id, as stock)."""
        return self.together and self.eos is None and bool(self.others)

    def cut(self, buffer, rows, old, new, n_new, pad_id, limits, every_one: bool = False):
        """Write each row's committed tokens new[b, :n] into the buffer, row b up to its buffer length limits[b];
        return (n [B], finished [B]). `every_one`: new is [B, 1] and n_new all ones (a plain step whose verifier kept
        every row's position)."""
        if every_one:
            n, finished = n_new, self._write_each(buffer, rows, old, new[:, 0], limits)
        else:
            write = self._write_one if new.shape[1] == 1 else self._write
            n, finished = write(buffer, rows, old, new, torch.minimum(n_new, limits - old), limits)
        if self.others:
            n, finished = self._ask_others(buffer, rows, old, n, finished, pad_id)
        return n, finished

    def _write(self, buffer, rows, old, new, n, limits):
        """Row b's first n[b] tokens of new [B, W] into the buffer, cut after an EOS: (n, finished). The buffer holds
        columns old[b] .. old[b] + W - 1 of every row (`Rows.reserve`)."""
        pos = offsets(new.shape[1], new.device)
        finished = None
        if self.eos is not None:
            is_eos = torch.isin(new, self.eos) & (pos < n[:, None])
            finished = is_eos.any(dim=1)
            n = torch.where(finished, is_eos.long().argmax(dim=1) + 1, n)
        at_limit = old + n >= limits
        finished = at_limit if finished is None else finished | at_limit
        # The whole [B, W] block, each column past what a row keeps given its own contents back: no index list built
        # from the mask (on a GPU, a wait). `Rows.reserve` keeps every column of the block inside the buffer.
        columns = old[:, None] + pos
        at = (rows[:, None], columns)
        buffer[at] = torch.where(pos < n[:, None], new, buffer[at])
        return n, finished

    def _write_one(self, buffer, rows, old, new, n, limits):
        """`_write` for one token a row (a step without drafts), in a few whole-batch operations: the token goes to
        column old[b] of the rows that keep it, with no index list built from the mask."""
        token, keeps = new[:, 0], n > 0
        finished = old + n >= limits
        if self.eos is not None:
            finished = finished | (torch.isin(token, self.eos) & keeps)
        column = old.clamp(max=buffer.shape[1] - 1)            # a row at the buffer's end keeps nothing
        buffer[rows, column] = torch.where(keeps, token, buffer[rows, column])
        return n, finished

    def _write_each(self, buffer, rows, old, token, limits):
        """`_write_one` where every row keeps its token: a row in the batch is short of its limit (one that reaches
        it finishes and leaves), so nothing is cut or masked. Returns finished [B]."""
        finished = old + 1 >= limits
        if self.eos is not None:
            finished = finished | torch.isin(token, self.eos)
        buffer[rows, old] = token
        return finished

    def _ask_others(self, buffer, rows, old, n, finished, pad_id):
        n, finished = n.clone(), finished.clone()
        waits = self.waits
        if waits and self.reach is None:
            self.reach = torch.full((buffer.shape[0],), -1, dtype=torch.long)
        for b, row in enumerate(rows.tolist()):
            start = int(old[b])
            if waits and self.reach[row] >= 0:        # stopped already: goes on until every row has
                continue
            for j in range(int(n[b])):
                sequence = buffer[row : row + 1, : start + j + 1]
                # A criterion may answer with a bool tensor or (as stock generate accepts) a Python bool.
                if any(bool(torch.as_tensor(c(sequence, None)).any()) for c in self.others):
                    if waits:
                        self.reach[row] = start + j + 1
                        break
                    buffer[row, start + j + 1 : start + int(n[b])] = pad_id
                    n[b], finished[b] = j + 1, True
                    break
        return n, finished

    def settle(self, buffer, rows, old, n, finished, limits, lengths, pad_id):
        """With `waits`: once every row has stopped, the rows end at the longest reach (see the class docstring).
        `limits` and `lengths` [B0] are the loop's own: the rows short of the end get it as their limit, and a row
        that already left past it (at its limit) is cut back to it. Returns (n, finished, [(row, tokens taken back)]
        of the rows that had left)."""
        if not self.waits or self.reach is None or not len(rows):
            return n, finished, []
        host = rows.cpu()
        ended = (finished & (self.reach[host] < 0).to(finished.device)).cpu()   # at their limit: stop there
        self.reach[host[ended]] = (old + n).cpu()[ended]
        if not bool((self.reach[host] >= 0).all()):
            return n, finished, []
        end = int(self.reach.max())
        n, finished = n.clone(), finished.clone()
        left = torch.ones(len(lengths), dtype=torch.bool)
        left[host] = False
        taken = []
        for row in (left & (lengths.cpu() > end)).nonzero().flatten().tolist():
            taken.append((row, int(lengths[row]) - end))
            buffer[row, end:int(lengths[row])] = pad_id
            lengths[row] = end
        for b, row in enumerate(host.tolist()):
            length = int(old[b] + n[b])
            if length >= end:
                buffer[row, end:length] = pad_id
                n[b], finished[b] = end - int(old[b]), True
            else:
                limits[row] = end
        return n, finished, taken
