"""The random numbers of sampling, keyed by (call seed, row, position) so that no draw depends on another.

Sampling here is the Gumbel-max rule (spec_adapt.acceptance_rules.coupled_accept): the target's token at a row's
generated position t is argmax(scores_t + g_t), scores_t the processed scores (temperature, top-k, top-p as stock
applies them, masked tokens -inf) and g_t [V] i.i.d. standard Gumbel noise. A draft is accepted iff it equals that
token. The output is then the same function of the noise whatever was drafted, by which source, at which width, in which
step, so what a policy learned or chose cannot change a seeded call's tokens, and a row's tokens do not depend on the
other rows of its batch.

Where the noise comes from:
- a call's seed: one integer drawn from torch's global CPU generator when the call starts (`call_seed`), so
  `torch.manual_seed(s)` then a call repeats, and successive calls differ, as stock's do;
- a row's key (`row_keys`): the seed, the row's prompt tokens (without its padding) and how many earlier rows of
  the call had the same prompt. So a row samples what the same prompt run alone samples under the same seed (the
  first row with a prompt is that prompt's stream 0, a repeat of it stream 1, ...), rows of one call never share a
  stream (a batch of one prompt repeated gives independent samples), and the key does not depend on where in the
  batch a row sits;
- position t's noise: a torch generator seeded with a hash of (row key, t) draws V uniforms u, and
  g = -log(-log(u)), in float64 (53 random bits per entry) then float32. Each (row, position) seeds its own draw,
  so position t's noise never depends on how many draws came before it.

The draws run on one device, the target's (a torch generator's stream differs between the CPU and CUDA), and a
drafter on another device gets them moved: the draft's noise is the target's, which is what makes them agree.
"""

from __future__ import annotations

import hashlib

import torch

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1


def mix64(x: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit integers whose output bits each depend on every input bit."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def call_seed() -> int:
    """A call's seed: one 63-bit integer from torch's global CPU generator (the one `torch.manual_seed` seeds)."""
    return int(torch.randint(0, _MASK63, (), dtype=torch.int64))


def row_keys(seed: int, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[int]:
    """Each row's key (see the module docstring): the seed, the row's prompt tokens without padding, and how many
    earlier rows had the same prompt. One host read of the prompts per call."""
    ids = input_ids.cpu()
    mask = attention_mask.cpu().bool() if attention_mask is not None else None
    seen: dict[bytes, int] = {}
    keys = []
    for b in range(ids.shape[0]):
        digest = prompt_digest(ids[b] if mask is None else ids[b][mask[b]])
        repeat = seen.get(digest, 0)
        seen[digest] = repeat + 1
        keys.append(prompt_key(seed, digest, repeat))
    return keys


def prompt_key(seed: int, digest: bytes, repeat: int) -> int:
    """The key of the `repeat`-th row (0 = the first) with the prompt whose 8-byte digest is `digest`."""
    return mix64(mix64(seed ^ int.from_bytes(digest, "little")) ^ mix64(repeat + 0x9E3779B97F4A7C15))


def prompt_digest(tokens: torch.Tensor) -> bytes:
    """The 8-byte digest of a prompt's tokens (1-D, without padding), as `row_keys` takes it."""
    return hashlib.blake2b(tokens.cpu().to(torch.int64).numpy().tobytes(), digest_size=8).digest()


class StepNoise:
    """The Gumbel noise of one step's active rows: `at(k)` [B, V] at each row's position base[b] + k, where base[b]
    is the number of tokens the row had generated when the step began (so k = 0 scores the step's first draft, or
    gives its next token). Each position is drawn once per step and kept, so the drafter and the accept phase read
    the same numbers."""

    def __init__(self, keys: list[int], base: list[int], vocab: int, device, generator: torch.Generator | None = None):
        self.keys, self.base, self.vocab = keys, base, vocab
        self.device = torch.device(device)
        self.generator = generator if generator is not None else torch.Generator(self.device)
        self._kept: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.keys)

    def at(self, k: int) -> torch.Tensor:
        """[B, V] float32 Gumbel noise at each row's position base[b] + k."""
        kept = self._kept.get(k)
        if kept is None:
            kept = self._kept[k] = gumbel([(key, t + k) for key, t in zip(self.keys, self.base)], self.vocab,
                                          self.device, self.generator)
        return kept

    def window(self, start: int, width: int) -> torch.Tensor:
        """[B, width, V]: `at(start)` .. `at(start + width - 1)`."""
        if width == 0:
            return torch.zeros(len(self.keys), 0, self.vocab, device=self.device)
        return torch.stack([self.at(start + j) for j in range(width)], dim=1)

    def select(self, index: list[int]) -> "StepNoise":
        """The same step's noise for a subset of its rows (their indices in this one), sharing what was drawn."""
        out = StepNoise([self.keys[i] for i in index], [self.base[i] for i in index], self.vocab, self.device,
                        self.generator)
        out._kept = {k: v[torch.tensor(index, dtype=torch.long, device=v.device)] for k, v in self._kept.items()}
        return out


def gumbel(streams: list[tuple[int, int]], vocab: int, device, generator: torch.Generator) -> torch.Tensor:
    """[len(streams), vocab] float32: standard Gumbel noise of each (row key, position), each from a generator
    seeded by the pair's hash alone."""
    u = torch.empty(len(streams), vocab, dtype=torch.float64, device=device)
    for i, (key, position) in enumerate(streams):
        generator.manual_seed(mix64(key ^ mix64(position)) & _MASK63)
        torch.rand(vocab, generator=generator, dtype=torch.float64, device=device, out=u[i])
    return u.log().neg().log().neg().float()       # u = 0 (probability 2^-53) gives -inf: never the argmax


def fresh_gumbel(shape, device) -> torch.Tensor:
    """Gumbel noise from torch's global generator, for an accept phase called without keyed noise (a caller outside
    the loop): still an exact sample, only not keyed."""
    u = torch.rand(shape, dtype=torch.float64, device=device)
    return u.log().neg().log().neg().float()
