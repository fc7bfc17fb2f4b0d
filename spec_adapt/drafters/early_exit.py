"""Self-speculation: the target's first k decoder layers and its own head draft for the whole model (LayerSkip;
stock transformers' `assistant_early_exit=k`). The drafting model shares the target's modules, so it costs no memory
beyond its own KV cache; models trained with early-exit losses (e.g. LayerSkip checkpoints) accept the most drafts.
"""

from __future__ import annotations

import copy
import threading
import weakref

from torch import nn

_SHALLOW: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def early_exit_model(target, layers: int):
    """A causal LM that runs `target`'s embeddings, its first `layers` decoder layers, its final norm and its head,
    all shared with `target` (no weight is copied). Made once per (target, layers) and kept while the target lives,
    so the process's default policy for it learns across calls."""
    body = getattr(target, "base_model", None)
    stack = getattr(body, "layers", None)
    if body is None or body is target or not isinstance(stack, nn.ModuleList):
        raise ValueError(f"assistant_early_exit needs a decoder whose body keeps its layers in `.layers` "
                         f"(Llama, Qwen2, Mistral, ...); {type(target).__name__} has none. Pass a drafter instead.")
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers < len(stack):
        raise ValueError(f"assistant_early_exit must be an int in [1, {len(stack) - 1}] (fewer layers than the "
                         f"target's {len(stack)}), got {layers!r}.")
    with _LOCK:
        per_target = _SHALLOW.setdefault(target, {})
        if layers not in per_target:
            per_target[layers] = _shallow(target, body, stack, layers)
        return per_target[layers]


def _shallow(target, body, stack, layers: int):
    config = copy.deepcopy(target.config)
    text = config.get_text_config()
    text.num_hidden_layers = layers
    if getattr(text, "layer_types", None):
        text.layer_types = list(text.layer_types[:layers])
    shallow_body = _sharing_copy(body, config=text)
    shallow_body._modules["layers"] = nn.ModuleList(list(stack[:layers]))
    shallow = _sharing_copy(target, config=config)
    shallow._modules[target.base_model_prefix] = shallow_body
    return shallow.eval()


def _sharing_copy(module: nn.Module, config) -> nn.Module:
    """A new module object holding the same submodules, parameters and buffers as `module` (its own dicts of them,
    so replacing one child does not touch `module`)."""
    twin = copy.copy(module)
    twin.__dict__.update(_modules=dict(module._modules), _parameters=dict(module._parameters),
                         _buffers=dict(module._buffers), config=config)
    return twin
