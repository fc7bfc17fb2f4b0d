"""The rows' state, as the loop writes it: the token buffer, per user row its committed length, where its output
starts and the length it may reach, and the active batch. Tensors on the target's device.

- `buffer` [B0, W]: the generate layout (left padding, prompt, generated tokens, pad after a row ends); W grows with
  what the rows generate (`reserve`), never beyond what a row may reach, so a huge max_new_tokens costs nothing up
  front;
- `lengths` [B0]: committed tokens per row (a buffer prefix), so row b's last committed token is buffer[b, len-1];
  they only grow, except where `Stopper.settle` takes back tokens of a row that went past where the batch ends;
- `starts` [B0], `limits` [B0]: where each row's generated tokens start and the buffer length it may reach (serving
  admits rows with their own prompt widths and token budgets; a generate call has one of each);
- `rows` [B]: the user rows still generating (the active batch; it shrinks as rows finish, grows as requests join),
  `finished` [B] which of them finished at the last commit;
- `pads` [B0]: a serving slot's left padding (None in a generate call).

What the loop reads of them on the host (the free columns past the longest row, the least room any row has left) is
kept here and read again only when rows, buffer or limits change: each is keyed by the tensors it was read from.
"""

from __future__ import annotations

import torch


class Rows:
    def __init__(self, buffer, lengths, starts, limits, pad_id: int, pads=None):
        self.buffer, self.lengths, self.starts, self.limits, self.pad_id = buffer, lengths, starts, limits, pad_id
        self.pads = pads
        self.device = buffer.device
        self.rows = torch.arange(len(lengths), device=self.device)
        self.finished = torch.zeros(len(lengths), dtype=torch.bool, device=self.device)
        self._room = None         # (buffer, rows, free columns past the longest row), `reserve`
        self._limits_of = None    # (rows, limits, limits[rows]), `row_limits`
        self._left = None         # [limits, a bound below every active row's room], `min_tokens_left`
        self._widths = {}         # (batch, width) -> [batch] of width, `widths`
        self.vocab: int | None = None    # the target's vocabulary size, set by the loop once known

    @classmethod
    def of_prompts(cls, input_ids, max_length: int, pad_id: int) -> "Rows":
        """A generate call's rows: its prompts [B0, L] (left padded), each row allowed up to `max_length`."""
        batch, prompt_length = input_ids.shape
        width = min(max_length, prompt_length + 32)
        buffer = torch.full((batch, width), pad_id, dtype=torch.long, device=input_ids.device)
        buffer[:, :prompt_length] = input_ids
        lengths = torch.full((batch,), prompt_length, dtype=torch.long, device=input_ids.device)
        return cls(buffer, lengths, lengths.clone(), torch.full_like(lengths, max_length), pad_id)

    @classmethod
    def empty(cls, device, pad_id: int) -> "Rows":
        """A serving engine's rows before any request: no slot, requests placed by `place`."""
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return cls(torch.full((0, 1), pad_id, dtype=torch.long, device=device), empty, empty.clone(), empty.clone(),
                   pad_id, pads=empty.clone())

    # -- the active batch ----------------------------------------------------------------------------------------------
    def leave(self) -> torch.Tensor:
        """The rows that finished leave the active batch; returns the positions (in the batch as it was) of those
        that stay."""
        keep = (~self.finished).nonzero().squeeze(1)
        self.rows, self.finished = self.rows[keep], self.finished[keep]
        return keep

    def join(self, rows, finished) -> None:
        """Freshly placed `rows` (their first token committed, `finished` [n]) join the end of the active batch: what
        is kept of the limits is read again."""
        self.rows = torch.cat([self.rows, rows])
        self.finished = torch.cat([self.finished, finished])
        self.limits_written()

    def clear(self) -> None:
        """No row is active any more (a serving batch reset after a failure)."""
        self.rows, self.finished = self.rows[:0], self.finished[:0]

    # -- serving slots -------------------------------------------------------------------------------------------------
    def take_slots(self, n: int) -> torch.Tensor:
        """The n lowest slots no active row holds (new ones at the end when all are held). A free slot's contents are
        no one's: the engine has handed every row that left its tokens before it admits."""
        held = torch.zeros(self.buffer.shape[0], dtype=torch.bool, device=self.device)
        held[self.rows] = True
        free = (~held).nonzero().squeeze(1)[:n]
        more = torch.arange(self.buffer.shape[0], self.buffer.shape[0] + n - len(free), device=self.device)
        return torch.cat([free, more])

    def place(self, slots, ids, mask, limits) -> None:
        """Write joining prompts `ids` [n, L] (left padded, `mask`) into their slots, with the buffer lengths they may
        reach. The buffer is as wide as the active rows and the prompts need (a long request that left widens
        nothing), and grows from there as tokens come (`reserve`)."""
        running = int(self.lengths[self.rows].max()) if len(self.rows) else 0
        width = max(running, ids.shape[1] + 1, 64)
        if self.buffer.shape[1] > 2 * width:
            self.buffer = self.buffer[:, :width].clone()
        elif width > self.buffer.shape[1]:
            more = self.buffer.new_full((self.buffer.shape[0], width - self.buffer.shape[1]), self.pad_id)
            self.buffer = torch.cat([self.buffer, more], 1)
        grow = int(slots.max()) + 1 - self.buffer.shape[0]
        if grow > 0:
            self.buffer = torch.cat([self.buffer, self.buffer.new_full((grow, self.buffer.shape[1]), self.pad_id)])
            more = torch.zeros(grow, dtype=torch.long, device=self.device)
            self.lengths, self.starts = torch.cat([self.lengths, more]), torch.cat([self.starts, more.clone()])
            self.limits, self.pads = torch.cat([self.limits, more.clone()]), torch.cat([self.pads, more.clone()])
        self.buffer[slots] = self.pad_id
        self.buffer[slots, : ids.shape[1]] = ids
        self.lengths[slots] = self.starts[slots] = ids.shape[1]
        self.limits[slots] = limits
        self.limits_written()
        self.pads[slots] = (mask == 0).sum(dim=1)

    # -- room: the buffer's and the limits' -----------------------------------------------------------------------------
    def reserve(self, extra: int) -> None:
        """Room in the buffer for `extra` more tokens in every active row, past its limit too (`Stopper._write`
        writes a step's whole block, the columns past what a row keeps getting their own contents back): the buffer
        grows with what is generated, doubling up to the furthest limit, never with the budget. The lengths are read
        once per growth, not every step: a row gains at most `extra` tokens a step, so after a read that found
        `free` columns past the longest row, steps whose extras add up to `free` fit. Anything that moves rows or
        buffer (rows that leave or join, a growth) makes the next call read again."""
        if not len(self.rows):
            return
        known = self._room
        if known is not None and known[0] is self.buffer and known[1] is self.rows and known[2] >= extra:
            self._room = (self.buffer, self.rows, known[2] - extra)
            return
        # The longest row and the furthest limit, in one host read.
        longest, furthest = torch.stack([self.lengths[self.rows].max(), self.row_limits().max()]).tolist()
        need = longest + extra
        width = self.buffer.shape[1]
        if need > width:
            grown = max(need, min(2 * width, furthest))
            more = self.buffer.new_full((self.buffer.shape[0], grown - width), self.pad_id)
            self.buffer = torch.cat([self.buffer, more], dim=1)
        self._room = (self.buffer, self.rows, self.buffer.shape[1] - longest - extra)

    def limits_written(self) -> None:
        """Whoever writes limits in place, or brings rows in, says so here: what is kept of them (`row_limits`,
        `min_tokens_left`) is made again."""
        self._limits_of = self._left = None

    def row_limits(self) -> torch.Tensor:
        """limits[rows], made again when the rows or the limits tensor change (see `limits_written`)."""
        known = self._limits_of
        if known is None or known[0] is not self.rows or known[1] is not self.limits:
            self._limits_of = known = (self.rows, self.limits, self.limits[self.rows])
        return known[2]

    def min_tokens_left(self) -> int:
        """A bound, known on the host, below what every active row may still generate: read once, then lowered by
        each commit's width (no row gains more), so a drafting step need not read whether a row drafts. Rows that
        leave keep it a bound; rows that join, or limits written, make it read again."""
        known = self._left
        if known is None or known[0] is not self.limits:
            least = int((self.row_limits() - self.lengths[self.rows]).min()) if len(self.rows) else 0
            known = self._left = [self.limits, least]
        return known[1]

    def set_lengths(self, rows, lengths, width: int) -> None:
        """The rows' new lengths, from a commit of at most `width` tokens a row (the one writer of lengths in a step):
        what every row may still generate falls by at most that (`min_tokens_left`)."""
        self.lengths[rows] = lengths
        if self._left is not None:
            self._left[1] -= width

    def widths(self, batch: int, width: int) -> torch.Tensor:
        """[batch] of `width`: one width for every row, 0 for a step without drafts. One tensor per batch size and
        width, kept (a step plain and the next drafting reuse theirs) and never written."""
        if len(self._widths) >= 64:    # batch sizes and widths are few; a long-running engine stays bounded
            self._widths = {}
        tensor = self._widths.get((batch, width))
        if tensor is None:
            tensor = self._widths[(batch, width)] = torch.full((batch,), width, dtype=torch.long, device=self.device)
        return tensor
