"""A draft model: a smaller causal LM sharing the target's tokenizer, with its own KV ledger."""

from __future__ import annotations

import torch

from .. import compat
from ..running_estimates import ema
from ..inputs import ModelInputs, encoder_decoder
from ..ledger import KVLedger, positions_from_cache, worth_apart
from .drafter import (CatchUp, ChecksTarget, DraftRequest, JoinsRows, Proposal, TakesInputs, Trees, left_padding,
                   sample_drafts)
from .head import ShortHead, check_short_head


def head_vocab_size(model) -> int:
    """Rows of the model's output head (its logits' width); the config's vocabulary where this process holds no
    head (a pipeline stage before the last)."""
    weight = getattr(model.get_output_embeddings(), "weight", None)
    return weight.shape[0] if weight is not None else model.config.get_text_config().vocab_size


class ModelDrafter(Trees, CatchUp, JoinsRows, ChecksTarget, TakesInputs):
    """Drafts autoregressively with `model`, keeping its cache in step with the committed tokens.

    The draft's cache holds a prefix of each row's buffer (`ledger.n_cached`). Proposing first feeds the tokens it
    has not seen yet (the prompt at the first proposal, one after a normal step, two after an all-accepted step,
    more after steps run at gamma = 0: the catch-up Nightjar's switching cost measures), then drafts one token per
    forward. Inputs move to the draft's
    device and proposals move back, so a draft on another device (or offloaded) works the same.
    """

    def __init__(self, model, confidence_threshold: float | None = None, head_tokens: int | None = None,
                 branch: int = 4, prompt_inputs: dict | None = None):
        """`confidence_threshold`: Elastic Speculation's early exit. A row stops drafting once the draft's top
        probability (after the logits processors) falls below it; its remaining draft slots are holes that write
        no KV. None = always draft the full length.

        `head_tokens`: score drafts over a subset of the vocabulary (spec_adapt.drafters.head): the `head_tokens`
        lowest ids, the special tokens, the call's prompt tokens and every token committed in earlier calls. Lossless
        (the target verifies with its full head); cheaper per draft token. None = the whole vocabulary.

        `branch`: under a tree plan (FixedTree, or a policy whose plan has a depth), each depth expands the `branch`
        most likely nodes and gives each its `branch` most likely children (spec_adapt.drafters.model_tree).

        `prompt_inputs`: what a multimodal draft takes with the prompt besides its tokens (`pixel_values`,
        `image_grid_thw`, ..., for the batch the call generates): the draft then reads the prompt at the start of
        the call, with them, as its own `prepare_inputs_for_generation` says (after `enable`, the inputs a call
        passes that the draft's forward names are handed on this way). Of an encoder-decoder draft (a smaller T5 or
        Whisper), its encoder's inputs for the call's rows: `{draft.main_input_name: ..., "attention_mask": ...}`
        (`input_ids` for T5 and BART, `input_features` for Whisper). Its encoder runs on them once per call, and its
        decoder drafts the target's decoder tokens attending to them (after `enable`, the call's encoder inputs are
        handed on this way)."""
        if prompt_inputs is not None and not isinstance(prompt_inputs, dict):
            raise TypeError(f"prompt_inputs must be a dict of the draft's inputs, got {type(prompt_inputs).__name__}.")
        self.prompt_inputs = prompt_inputs or {}
        if isinstance(branch, bool) or not isinstance(branch, int) or branch < 1:
            raise ValueError(f"branch must be an int >= 1, got {branch!r}.")
        self.branch = branch
        self.tree_fed = None         # the last tree's nodes: their column in the ledger's pending region, or -1
        self.tree_expected = None    # [B] the last tree's expected accepted count (sum of path probabilities), -1: none
        self.calib = None            # [B, 2] per active row: EMA of accepted tree tokens, EMA of expected ones
        if confidence_threshold is not None and not 0.0 <= confidence_threshold <= 1.0:
            raise ValueError(f"confidence_threshold must be within [0, 1], got {confidence_threshold!r}.")
        if head_tokens is not None and (isinstance(head_tokens, bool) or not isinstance(head_tokens, int)):
            raise ValueError(f"head_tokens must be an int (a count of token ids) or None, got {head_tokens!r}.")
        self.model = model
        self.short = ShortHead(model, head_tokens) if head_tokens is not None else None
        self.threshold = confidence_threshold
        self.ledger: KVLedger | None = None
        self.by_column = False       # numbers tokens by cache column, under a lockstep target (validate): `_align`
        self.target_inputs = None    # the call's target inputs (share_inputs): a shared encoder's outputs
        self.unencoded = None        # an encoder-decoder draft's rows of prompt_inputs until its encoder runs
        self.vocab = None
        self._kv_writes = 0         # draft tokens whose KV was written (all calls), to measure early exit: an int
                                    # and the device counts not yet read (`kv_writes` reads them)
        self._writes: list[torch.Tensor] = []
        self._fresh = False         # rows that joined may have nothing cached yet (until a step feeds every row)

    def _count_writes(self, count: torch.Tensor) -> None:
        """Add a step's written-token count, kept on the device; many are summed there into one (no host read),
        so a long serving run holds a few tensors, not one per step."""
        self._writes.append(count)
        if len(self._writes) >= 64:
            self._writes = [torch.stack(self._writes).sum()]

    @property
    def kv_writes(self) -> int:
        """Draft tokens whose KV was written, over every call. Counted on the device as the draft runs (a host read
        per step would wait on it) and read here."""
        if self._writes:
            self._kv_writes += int(torch.stack(self._writes).sum())
            self._writes = []
        return self._kv_writes

    def validate(self, target) -> None:
        if encoder_decoder(self.model):
            self._check_encoder_inputs(target)
        target_vocab, draft_vocab = head_vocab_size(target), head_vocab_size(self.model)
        if draft_vocab < target_vocab:
            raise ValueError(
                f"The draft model's vocabulary ({draft_vocab} tokens) is smaller than the target's ({target_vocab}): "
                "they do not share a tokenizer. Use a draft trained with the target's tokenizer, or a model-free "
                "drafter such as prompt lookup."
            )
        for name in ("bos_token_id", "eos_token_id"):
            t, d = getattr(target.config, name, None), getattr(self.model.config, name, None)
            if t is not None and d is not None and t != d:
                raise ValueError(
                    f"Draft and target disagree on {name} ({d} vs {t}): they do not share a tokenizer. "
                    "Use a draft that uses the target's tokenizer."
                )
        # A larger draft vocabulary is a padded superset (embedding rows rounded up): its logits are sliced.
        self.vocab = target_vocab
        self.by_column = positions_from_cache(target) is not None and positions_from_cache(self.model) is not None
        if self.short is not None:
            check_short_head(self.short)

    def _check_encoder_inputs(self, target) -> None:
        """An encoder-decoder draft runs its own encoder on the call's encoder inputs: the target must have an
        encoder, and the draft those inputs (generate hands a custom_generate function the target's encoder outputs,
        not the inputs they came from)."""
        name, main = type(self.model).__name__, self.model.main_input_name
        if not encoder_decoder(target):
            raise ValueError(
                f"The draft {name} is an encoder-decoder model, but the target {type(target).__name__} is "
                "decoder-only: its call has no encoder inputs for the draft's encoder. Draft with a causal LM of the "
                "target's vocabulary, or with prompt lookup.")
        if main not in self.prompt_inputs:
            raise ValueError(
                f"The draft {name} is an encoder-decoder model: it runs its own encoder on the call's encoder inputs, "
                "which generate does not hand a custom_generate function (only the target's encoder outputs). Call "
                "spec_adapt.enable(model) and pass the draft as model.generate(**inputs, assistant_model=draft), or "
                f"pass drafter=ModelDrafter(draft, prompt_inputs={{'{main}': ..., 'attention_mask': ...}}) with the "
                "call's encoder inputs.")
        if self.short is not None:
            raise ValueError(f"head_tokens cuts a causal LM's head; the draft {name} is an encoder-decoder model: "
                             "leave head_tokens=None.")

    @property
    def runner(self):
        """What the ledger runs: the model, or the model with its head cut to `head_tokens`."""
        return self.short if self.short is not None else self.model

    def begin(self, input_ids, attention_mask):
        # Nothing is cached yet: the prompt is fed by the first proposal's catch-up. So a call (or a batch size)
        # the policy keeps plain never runs the draft at all (an encoder-decoder draft's encoder included); an eager
        # prefill of the prompt can cost more than the call's drafts save.
        self._learn(input_ids)
        self.ledger = KVLedger.empty(self.runner, left_padding(input_ids, attention_mask), self.model.device)
        self.ledger.lockstep = self.by_column        # never compacted: that would move tokens to other columns
        self._fresh = True
        self.calib = torch.ones(len(input_ids), 2, device=self.ledger.device)
        if encoder_decoder(self.model):              # its own encoder's outputs, at its first forward (`_encode`)
            given = len(self.prompt_inputs[self.model.main_input_name])
            if given != len(input_ids):
                raise ValueError(f"prompt_inputs hold the encoder inputs of {given} rows, but the call generates "
                                 f"{len(input_ids)}: pass the call's own encoder inputs.")
            self.unencoded = torch.arange(given)
            return
        self.ledger.use_inputs(ModelInputs.shared_encoder(self.runner, self.target_inputs))
        if self.prompt_inputs:    # a multimodal draft reads its prompt now, with the images of exactly these rows
            self._read_prompt(input_ids.to(self.ledger.device), attention_mask)

    def _encode(self) -> None:
        """Run an encoder-decoder draft's own encoder on the encoder inputs of the rows still in the batch, once per
        call (as stock assisted generation runs such an assistant's), and attend to its outputs from now on."""
        rows, device, dtype = self.unencoded, self.model.device, self.model.dtype
        given = len(self.prompt_inputs[self.model.main_input_name])
        inputs = {k: _rows_on(v, rows, given, device, dtype) for k, v in self.prompt_inputs.items()}
        with torch.no_grad():
            outputs = self.model.get_encoder()(**inputs, return_dict=True)
        own = {"encoder_outputs": outputs, "attention_mask": inputs.get("attention_mask")}
        self.ledger.use_inputs(ModelInputs.shared_encoder(self.runner, None, own))
        self.unencoded = None

    def _read_prompt(self, input_ids, attention_mask) -> None:
        ledger = self.ledger
        mask = attention_mask.to(ledger.device) if attention_mask is not None else None
        inputs = {k: v.to(ledger.device) if torch.is_tensor(v) else v for k, v in self.prompt_inputs.items()}
        # The positions generate would give this model for the call (Qwen2-VL's M-RoPE places image tokens on a grid
        # and the text after them past it), so its drafts see the positions the target verifies them at.
        positions = compat.generation_positions(self.model, input_ids, dict(inputs, attention_mask=mask))
        ledger.use_inputs(ModelInputs.of_call(self.runner, input_ids, mask, ledger.cache, inputs, positions))
        _forward_pending(ledger, input_ids, input_ids.shape[1] - ledger.pad)

    def share_inputs(self, inputs):
        self.target_inputs = inputs

    def add_rows(self, input_ids, attention_mask, rows):
        if encoder_decoder(self.model) or self.ledger.inputs is not None and self.ledger.inputs.cross:
            raise NotImplementedError(f"{type(self.model).__name__} drafts attending to encoder outputs, which rows "
                                      "joining a running batch do not bring.")
        # Positional: the draft's ledger follows the active rows; row numbers only matter to the processors.
        self._learn(input_ids)
        self.calib = torch.cat([self.calib, self.calib.new_ones(len(input_ids), 2)])
        self._fresh = True
        self.ledger.add_rows(KVLedger.empty(self.runner, left_padding(input_ids, attention_mask), self.model.device))

    def _learn(self, tokens):
        if self.short is not None:
            self.short.add(tokens)

    def propose(self, request: DraftRequest) -> Proposal:
        device, target_device = self.ledger.device, request.tokens.device
        tokens = request.tokens.to(device)
        lengths, gammas = request.lengths.to(device), request.gammas.to(device)
        batch = tokens.shape[0]
        if self.unencoded is not None:
            self._encode()
        if self.by_column:
            self._align(lengths, gammas > 0)
        # Catch up on committed tokens the draft has not cached yet (rows that draft nothing skip it).
        pending = torch.where(gammas > 0, lengths - self.ledger.n_cached, 0)             # [B]
        # The widths' and the catch-up's ends, in one host read.
        least, most, even, behind = torch.stack([*torch.aminmax(gammas), *torch.aminmax(pending)]).tolist()
        # Greedy chains read one column more where a row has two or more tokens pending: the hindsight below.
        back = 2 if behind >= 2 and not (request.sampling or request.depths is not None) else 1
        last = self._catch_up(tokens, pending, behind, even, back)          # [B, back or 1, V']
        hindsight = self._hindsight(request, tokens, lengths, pending, last[:, 0]) if last.shape[1] == 2 else None
        last = last[:, -1]
        if least > 0:                 # every row was fed: none is left with nothing cached
            self._fresh = False
        self._count_writes(pending.sum())
        if request.depths is not None:
            from .model_tree import draft_tree

            return draft_tree(self, request, tokens, lengths, gammas, last)
        # A chain's buffers, sized by its plan (a tree plan's gammas are node budgets, never allocated here).
        context = tokens.clone()                                          # committed tokens + drafts so far
        drafts = torch.zeros(batch, most, dtype=torch.long, device=device)
        probs = torch.zeros(batch, most, self.vocab, device=device) if request.wants_probs else None
        confidence = torch.zeros(batch, most, device=device)     # the draft's probability of each drafted token
        survival = torch.ones(batch, device=device)              # of the row's drafts so far (request.stop)
        ruled_in = torch.ones(batch, dtype=torch.bool, device=device)    # rows the plan's rule lets go on
        drafted = torch.zeros_like(gammas)            # per row: tokens drafted so far
        # Without an early exit or a stop rule each row drafts exactly its gamma: which rows go on is known on the
        # host, and where every row drafts as many, each forward feeds every row (the ledger's `ones`).
        planned = self.threshold is None and request.stop is None
        every_row = self.ledger.ones(batch) if planned and least == most else None
        for k in range(most):
            scores = request.process(last[:, : self.vocab].float(), context, lengths + k, request.rows.to(device))
            q = scores.softmax(dim=-1)
            token = sample_drafts(scores, q, request, k) if request.sampling else scores.argmax(dim=-1)
            drafting = (drafted == k) & (k < gammas) & ruled_in
            if self.threshold is not None:            # early exit: stop before a low-confidence token
                drafting &= q.max(dim=-1).values >= self.threshold
            confidence[:, k] = q.gather(1, token[:, None]).squeeze(1)
            if probs is not None:
                probs[:, k] = q
            drafts[:, k] = torch.where(drafting, token, 0)
            drafted += drafting.long()
            context.scatter_(1, (lengths + k)[:, None].clamp(max=context.shape[1] - 1), drafts[:, k : k + 1])
            feed = drafting & (k + 1 < gammas)        # the last draft token is not fed: pending if accepted
            if request.stop is not None:    # the plan's rule: a row whose survival fell below it drafts no more, so
                survival = request.stop.survival(survival, confidence[:, k])    # its last token is not fed either
                ruled_in &= request.stop.keeps(survival, k + 1)
                feed &= ruled_in
            if k + 1 == most or not (planned or bool(feed.any())):
                break
            self._count_writes(feed.sum())
            last = self.ledger.forward(drafts[:, k : k + 1], every_row if every_row is not None else feed.long())[:, 0]

        out_probs = probs.to(target_device) if probs is not None else None
        width = most if planned else int(drafted.max())
        return Proposal(drafts.to(target_device), drafted.to(target_device), out_probs,
                        {"hindsight": hindsight} if hindsight is not None else None,
                        confidence=confidence[:, :width].to(target_device))

    def _hindsight(self, request: DraftRequest, tokens, lengths, pending, before) -> torch.Tensor:
        """[B] per row with two or more tokens pending: 1 where the draft's own greedy token after the second-last of
        them is the last one, else 0; -1 for the other rows. After a step whose drafts were all accepted, the pending
        tokens are the last draft and the target's token after it, so this says whether one more draft would have
        been accepted: the policy measures the position past the width it asked, for free (`Adaptive._hindsight`)."""
        scores = request.process(before[:, : self.vocab].float(), tokens, lengths - 1, request.rows.to(tokens.device))
        last = tokens.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1)
        agree = (scores.argmax(dim=-1) == last).long()
        return torch.where(pending >= 2, agree, -1).to(request.tokens.device)

    def _align(self, lengths, fed) -> None:
        """Keep each row's token i at cache column i, the position a draft that numbers tokens by cache column
        (Bart's, T5's and Whisper's decoders) must see. A lockstep target's rows hold as many tokens each, so the rows
        that catch up (`fed`) all restart from the column of the one furthest behind: the forward has its width
        anyway, and no row gets holes that would shift its later tokens. Rows of different lengths (left padding)
        cannot share columns: their positions stay off, which costs acceptance, never correctness."""
        ledger = self.ledger
        done, todo = (ledger.n_cached - ledger.pad)[fed], (lengths - ledger.pad)[fed]
        if not len(done) or bool((todo != todo[0]).any()):
            return
        start = int(done.min())
        if ledger.physical_length != start:
            ledger.rollback(ledger.pad + start)

    def _catch_up(self, tokens, pending, behind: int, even: int, back: int = 1) -> torch.Tensor:
        """Feed each row its pending committed tokens; the logits after each row's last `back` of them [B, back, V']
        where every row runs in one forward, else after the last alone [B, 1, V'].

        One forward is [B, max pending] wide, holes included. When rows that joined a running batch (nothing cached
        yet: a whole prompt pending) catch up next to rows that are one or two tokens behind, that width would be
        paid by every row, so the fresh rows run apart in a ledger of their own and rejoin the batch afterwards
        (at batch 4 a joiner's 147-token prompt then costs one row's forward, not four). On a CPU, a whole batch of
        fresh rows whose prompts differ enough in length (`ledger.worth_apart`) runs a row at a time, as the target's
        prefill does. `behind` and `even`: the most and the fewest tokens a row has pending (read by the caller)."""
        ledger = self.ledger
        if not self._fresh:           # every row has its prompt cached: one forward
            return _forward_pending(ledger, tokens, pending, behind, even, back)
        fresh = (ledger.n_cached == ledger.pad) & (pending > 0)
        some = bool(fresh.any())
        every = some and bool(fresh.all())                     # one host read on a step with no fresh row
        # A ledger with inputs (encoder outputs) holds them for its rows together: its rows are never run apart.
        if every and ledger.inputs is None and not ledger.lockstep and worth_apart(ledger.device, pending.tolist()):
            return self._catch_up_apart(tokens, pending)
        together = ledger.inputs is not None or every or not some
        if together or int(pending[~fresh].max()) >= int(pending[fresh].max()):
            return _forward_pending(ledger, tokens, pending, back=back)
        joined, others = fresh.nonzero().squeeze(1), (~fresh).nonzero().squeeze(1)
        apart = KVLedger.empty(self.runner, ledger.pad[joined], ledger.device)
        ledger.select_rows(others)
        first = _forward_pending(apart, tokens[joined], pending[joined])
        last = first.new_zeros(len(pending), *first.shape[1:])     # rows drafting nothing: never read
        last[joined] = first
        if bool((pending[others] > 0).any()):
            last[others] = _forward_pending(ledger, tokens[others], pending[others])
        ledger.add_rows(apart)
        ledger.select_rows(torch.cat([others, joined]).argsort())      # back to the batch's row order
        return last

    def _catch_up_apart(self, tokens, pending) -> torch.Tensor:
        """Every row's pending prompt in a ledger of its own, the rows then joined back in order (`add_rows`)."""
        ledger, last, pads = self.ledger, [], self.ledger.pad
        ledger.select_rows(pads[:0])
        for b in range(len(pending)):
            row = KVLedger.empty(self.runner, pads[b:b + 1], ledger.device)
            last.append(_forward_pending(row, tokens[b:b + 1], pending[b:b + 1]))
            ledger.add_rows(row)
        return torch.cat(last)

    def lag(self, lengths):
        if self.ledger is None:
            return None
        return lengths.to(self.ledger.device) - self.ledger.n_cached

    def calibration(self) -> torch.Tensor:
        """[B] log(observed / expected) accepted tree tokens per active row: how much the row's path probabilities
        over- or under-state its acceptance (0 until it has drafted trees)."""
        return (self.calib[:, 0] / self.calib[:, 1]).log()

    def keep_tree(self, path):
        """Keep the cached entries of the accepted nodes this draft fed (the deepest ones were never fed), and
        update the rows' calibration."""
        expected, self.tree_expected = self.tree_expected, None
        if expected is not None:
            drafted = expected >= 0
            seen = torch.stack([path.to(expected.device).long().sum(1).float(), expected.clamp(min=1e-3)], dim=1)
            self.calib = torch.where(drafted[:, None], ema(self.calib, seen, 0.1), self.calib)
        fed, self.tree_fed = self.tree_fed, None
        if fed is None or self.ledger.tree is None:
            return
        path = path.to(fed.device)[:, : fed.shape[1]]
        columns = self.ledger.tree_width
        kept = torch.zeros(len(fed), columns + 1, dtype=torch.bool, device=fed.device)
        on_path = path & (fed >= 0)
        kept.scatter_(1, torch.where(on_path, fed, columns), on_path)
        self.ledger.keep_tree(kept[:, :columns])

    def rollback(self, keep_len):
        self.ledger.rollback(keep_len)

    def select_rows(self, index):
        self.ledger.select_rows(index)
        if self.unencoded is not None:
            self.unencoded = self.unencoded[index.cpu()]
        self.calib = self.calib[index.to(self.calib.device)]

    def end(self, tokens=None, lengths=None):
        if tokens is not None and lengths is not None:      # what the target committed: scored in later calls
            written = torch.arange(tokens.shape[1], device=tokens.device)[None, :] < lengths.to(tokens.device)[:, None]
            self._learn(tokens[written])
        self.ledger = self.unencoded = None


def _rows_on(value, rows: torch.Tensor, batch: int, device, dtype):
    """A prompt input's `rows` (a tensor of `batch` rows), on the draft's device, floats in its dtype."""
    if not torch.is_tensor(value):
        return value
    if value.dim() and value.shape[0] == batch:
        value = value[rows.to(value.device)]
    return value.to(device, dtype) if value.is_floating_point() else value.to(device)


def _forward_pending(ledger: KVLedger, tokens: torch.Tensor, pending: torch.Tensor, behind: int | None = None,
                     even: int = 0, back: int = 1) -> torch.Tensor:
    """One forward feeding row b its next pending[b] buffer tokens; the logits after the last `back` of them
    [B, back, V'] (columns before a row's first pending token read its first).
    `behind`: pending's largest value, where the caller has read it; `even`: its smallest, so that where every row
    is as far behind, the forward feeds every column of every row (the ledger's `filled`: no hole check)."""
    behind = int(pending.max()) if behind is None else behind
    offset = torch.arange(behind, device=tokens.device)[None, :]
    # A row's holes (past its pending tokens) take its own leading columns: in a prompt read, its left padding. So
    # every row holds the tokens of its stock prompt, and a model that counts image tokens over the whole forward
    # (LFM2-VL, DeepSeek-VL) finds as many as there are images, whatever tokens end the prompt.
    index = torch.where(offset < pending[:, None], ledger.n_cached[:, None] + offset, offset - pending[:, None])
    index = index.clamp(0, tokens.shape[1] - 1)
    n_valid = ledger.filled(len(pending), behind) if behind > 0 and even == behind else pending
    columns = (pending[:, None] - back + torch.arange(back, device=pending.device)[None, :]).clamp(min=0)
    return ledger.forward(tokens.gather(1, index), n_valid, columns=columns)
