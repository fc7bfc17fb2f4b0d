"""`spec-adapt serve`: the OpenAI-compatible server (spec_adapt.serving.openai_api) over an Engine, run by uvicorn.

    spec-adapt serve --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --port 8000

The drafter: with `--draft`, the draft model beside prompt lookup and the suffix index (the default `generate` takes
for `assistant_model=`); else `--drafter lookup` (the default), `suffix` or `none` (no speculation: the same server
decoding plainly). The policy is `Adaptive`, which drafts less as the batch grows. The models are prepared
(`spec_adapt.prepare`, as the demo's; `--no-prepare` serves them eagerly) and the draft computes in the fastest dtype
this CPU has (`--draft-dtype`); neither changes an answer. SIGTERM or Ctrl-C: uvicorn stops
taking connections, waits up to `--shutdown-timeout` seconds for the requests in flight, then the engine stops
(requests still unfinished fail) and the process exits 0.
"""

from __future__ import annotations

import argparse
import signal
import sys

import torch

DRAFTERS = ("lookup", "suffix", "none")


def build_engine(model, draft=None, drafter: str = "lookup", max_batch: int = 8, max_waiting: int = 64,
                 policy=None, tokenizer=None):
    """The Engine `serve` runs: the drafter as the module docstring says, Adaptive unless a policy is given."""
    from spec_adapt import Adaptive, FixedLength, ModelDrafter, PromptLookupDrafter
    from spec_adapt.api import with_sources
    from spec_adapt.drafters.suffix import SuffixDrafter, SuffixIndex
    from spec_adapt.serving.engine import Engine

    if draft is not None:
        chosen = with_sources(model, ModelDrafter(draft))
    else:
        chosen = {"lookup": PromptLookupDrafter, "suffix": lambda: SuffixDrafter(SuffixIndex()),
                  "none": lambda: None}[drafter]()
    if policy is None:
        policy = FixedLength(0) if chosen is None else Adaptive()
    return Engine(model, drafter=chosen, assistant_policy=policy, max_batch=max_batch, max_waiting=max_waiting,
                  tokenizer=tokenizer)


def serve_cmd(args) -> None:
    import uvicorn

    from spec_adapt.serving.openai_api import create_app

    model, tokenizer, draft = load_models(args)
    engine = build_engine(model, draft, args.drafter, args.max_batch, args.max_waiting, tokenizer=tokenizer)
    app = create_app(engine, tokenizer, args.served_name or args.model, max_body_bytes=args.max_body_bytes,
                     default_max_tokens=args.max_tokens)
    print(f"spec-adapt serve: {args.served_name or args.model} on http://{args.host}:{args.port}/v1 "
          f"(drafter: {'draft ' + args.draft if args.draft else args.drafter}, max batch {args.max_batch})",
          flush=True)
    # uvicorn shuts down gracefully on SIGTERM and then raises the signal again under the handler found before it:
    # this one makes that a normal exit (status 0) rather than a death by the signal.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=args.shutdown_timeout)


def load_models(args):
    """(target, tokenizer, draft or None) as the options say: the draft in --draft-dtype (unset: fastest, or with
    --draft-quant the quantized draft's own), both prepared unless --no-prepare."""
    from spec_adapt.tools.models import draft_from_args, load_model

    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype))
    fastest = args.draft_dtype is None and not args.draft_quant
    draft = draft_from_args(model, argparse.Namespace(**{**vars(args), **({"draft_dtype": "fastest"} if fastest else {})}))
    if args.prepare:
        from spec_adapt import prepare

        model, draft = prepare(model), prepare(draft) if draft is not None else None
    return model, tokenizer, draft


def add_parser(sub, options) -> None:
    from spec_adapt.tools.models import draft_options

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions")
    p.add_argument("--model", required=True, help="a known name (as demo and bench take), a folder or a hub id")
    p.add_argument("--draft", help="a draft model: drafts beside prompt lookup and the suffix index")
    p.add_argument("--drafter", choices=DRAFTERS, default="lookup", help="without --draft: the model-free drafter "
                   "(none = no speculation)")
    p.add_argument("--served-name", help="the model id clients send (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=options.port, default=8000)
    p.add_argument("--max-batch", type=options.batch_size, default=8)
    p.add_argument("--max-waiting", type=options.count, default=64, help="requests that may wait; more get 429")
    p.add_argument("--max-tokens", type=options.tokens, default=256, help="a chat request's default max_tokens")
    p.add_argument("--max-body-bytes", type=options.count, default=1 << 20)
    p.add_argument("--shutdown-timeout", type=options.seconds, default=10.0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    draft_options(p, default_help="fastest; with --draft-quant, the quantized draft's")
    p.add_argument("--no-prepare", dest="prepare", action="store_false",
                   help="serve the models eagerly (default: spec_adapt.prepare on target and draft, as the demo)")
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info"], default="warning")
    p.set_defaults(func=serve_cmd, draft_layers=None)
