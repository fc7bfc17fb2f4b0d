"""`spec-adapt serve` through the real `openai` client: a server process on a free localhost port (started once for
the module) over a tiny random-weight pair and a character tokenizer. Identity with stock greedy `generate` under 16
concurrent clients, streamed and not; seeded sampling; disconnects; overload; hostile bodies; and, in process, a
drafter that fails and a target that fails."""

from __future__ import annotations

import json
import os
import socket
import string
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

openai = pytest.importorskip("openai")

from spec_adapt import FixedLength, ScriptedDrafter  # noqa: E402
from spec_adapt.tools.synthetic import perturbed_copy  # noqa: E402

from conftest import PAD, tiny_model  # noqa: E402

NAME = "tiny-pair"
MAX_BATCH, MAX_WAITING = 4, 16


def char_tokenizer():
    """A character-level tokenizer over the tiny models' 96 ids (0-2 pad, bos, eos) with a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(string.ascii_letters + string.digits + " \n" + string.punctuation)[:93]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    inner.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    inner.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}")
    return tok


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("served")
    target = tiny_model("llama", seed=3)
    draft = perturbed_copy(target, 0.3, seed=1)
    tok = char_tokenizer()
    for model, name in ((target, "target"), (draft, "draft")):
        model.generation_config.pad_token_id = PAD
        model.save_pretrained(folder / name)
        tok.save_pretrained(folder / name)
    return target, draft, tok, folder


@pytest.fixture(scope="module")
def server(pair):
    _, _, _, folder = pair
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "spec_adapt.tools.cli", "serve", "--model", str(folder / "target"), "--draft",
         str(folder / "draft"), "--served-name", NAME, "--port", str(port), "--max-batch", str(MAX_BATCH),
         "--max-waiting", str(MAX_WAITING), "--max-tokens", "24", "--max-body-bytes", str(1 << 20)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                break
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError("the server exited:\n" + proc.stdout.read())
            time.sleep(0.2)
    else:
        proc.kill()
        raise RuntimeError("the server did not answer /health in 120 s")
    yield url, proc
    if proc.poll() is None:
        proc.terminate()
        proc.wait(30)


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def stock(target, ids, n):
    """Stock greedy generate's tokens after `ids`, up to and including EOS, at most n."""
    ids = torch.tensor([ids])
    out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                          pad_token_id=PAD)[0, ids.shape[1]:].tolist()
    return out[: out.index(2) + 1] if 2 in out else out


def ask(c, kind, text, stream, n=12, **kw):
    """(text, token ids, finish_reason, usage) of one request through the openai client."""
    extra = {"return_token_ids": True}
    if kind == "chat":
        args = dict(model=NAME, messages=[{"role": "user", "content": text}], max_tokens=n, temperature=0,
                    extra_body=extra, **kw)
        if not stream:
            r = c.chat.completions.create(**args)
            return r.choices[0].message.content, r.choices[0].token_ids, r.choices[0].finish_reason, r.usage
        parts, last, usage = [], None, None
        for chunk in c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args):
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                last = chunk.choices[0]
        return "".join(parts), last.token_ids, last.finish_reason, usage
    args = dict(model=NAME, prompt=text, max_tokens=n, temperature=0, extra_body=extra, **kw)
    if not stream:
        r = c.completions.create(**args)
        return r.choices[0].text, r.choices[0].token_ids, r.choices[0].finish_reason, r.usage
    parts, last, usage = [], None, None
    for chunk in c.completions.create(stream=True, stream_options={"include_usage": True}, **args):
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices:
            parts.append(chunk.choices[0].text)
            last = chunk.choices[0]
    return "".join(parts), last.token_ids, last.finish_reason, usage


def prompt_ids(tok, kind, text):
    if kind == "chat":
        return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       tokenize=True, return_dict=True)["input_ids"]
    return tok(text).input_ids


def test_sixteen_concurrent_clients_get_stocks_greedy_tokens_streamed_or_not(server, pair):
    """16 clients, 4 requests each (completions and chat, streamed and not) at once: every answer's tokens are stock
    greedy generate's for its prompt; the text is their decoding; streamed text joins to the non-streamed text."""
    url, _ = server
    target, _, tok, _ = pair
    texts = [f"def f{i}(x):\n    return x * {i} + " + "abc" * (i % 4) for i in range(16)]
    results, errors = {}, []

    def run(i):
        try:
            c = client(url)
            for kind in ("completions", "chat"):
                for stream in (False, True):
                    results[i, kind, stream] = ask(c, kind, texts[i], stream, n=10 + i % 5)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors[:3]
    assert len(results) == 64
    for (i, kind, stream), (text, ids, finish, usage) in results.items():
        prompt = prompt_ids(tok, kind, texts[i])
        expected = stock(target, prompt, 10 + i % 5)
        assert ids == expected, (i, kind, stream)
        assert text == tok.decode(expected, skip_special_tokens=True)
        assert finish == ("stop" if expected[-1] == 2 else "length")
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), len(expected))
        assert text == results[i, kind, not stream][0]


def test_a_seeded_request_repeats_and_stop_strings_cut(server, pair):
    url, _ = server
    c = client(url)
    kw = dict(model=NAME, prompt="Once upon a time", max_tokens=16, temperature=1.0, top_p=0.9)
    a, b = (c.completions.create(seed=7, **kw).choices[0].text for _ in range(2))
    other = c.completions.create(seed=8, **kw).choices[0].text
    assert a == b and a != other
    full = c.completions.create(model=NAME, prompt="abc", max_tokens=16, temperature=0).choices[0].text
    stop = full[5:7]
    cut = c.completions.create(model=NAME, prompt="abc", max_tokens=16, temperature=0, stop=[stop]).choices[0]
    assert cut.text == full[:full.index(stop)] and cut.finish_reason == "stop"


def metrics(url) -> dict:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_clients_that_disconnect_free_their_rows(server):
    """MAX_BATCH streams of 400 tokens are opened and dropped after their first chunk: their rows leave the batch,
    and a request sent next is answered at once."""
    url, _ = server
    body = json.dumps({"model": NAME, "prompt": "x", "max_tokens": 400, "stream": True, "temperature": 0}).encode()
    responses = []
    for _ in range(MAX_BATCH):
        request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        response = urllib.request.urlopen(request, timeout=30)
        response.readline()
        responses.append(response)
    for response in responses:
        response.close()
    deadline = time.time() + 30
    while metrics(url)["spec_adapt_requests_running"] > 0 and time.time() < deadline:
        time.sleep(0.1)
    assert metrics(url)["spec_adapt_requests_running"] == 0
    began = time.time()
    answer = client(url).completions.create(model=NAME, prompt="y", max_tokens=4, temperature=0)
    assert answer.usage.completion_tokens >= 1 and time.time() - began < 30


def test_twice_the_capacity_gets_answers_or_429_and_nothing_hangs(server):
    url, _ = server
    capacity = MAX_BATCH + MAX_WAITING
    codes, lock = [], threading.Lock()

    def one(i):
        # Long answers: no row finishes while the burst arrives, so the queue fills whatever the machine's speed.
        body = json.dumps({"model": NAME, "prompt": f"load {i}", "max_tokens": 200, "temperature": 0}).encode()
        request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as r:
                code, data = r.status, json.loads(r.read())
                assert data["choices"][0]["text"] is not None
        except urllib.error.HTTPError as exc:
            code = exc.code
            error = json.loads(exc.read())["error"]
            assert exc.headers["Retry-After"] == "1" and error["type"] == "rate_limit_error"
        with lock:
            codes.append(code)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2 * capacity)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads)
    assert len(codes) == 2 * capacity and set(codes) <= {200, 429}
    # The queue's worth is taken however the burst meets the engine's steps (rows are admitted between them).
    assert codes.count(200) >= MAX_WAITING and 429 in codes


def post(url, path, data: bytes, content_type="application/json"):
    request = urllib.request.Request(url + path, data, {"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


HOSTILE = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", json.dumps({"model": NAME, "prompt": "a", "max_tokens": "ten"}), 400, "max_tokens"),
    ("/v1/completions", json.dumps({"model": NAME, "prompt": 5}), 400, "prompt"),
    ("/v1/completions", json.dumps({"model": NAME, "prompt": "a", "temperature": "hot"}), 400, "temperature"),
    ("/v1/completions", json.dumps({"model": NAME, "prompt": "a", "max_tokens": -1}), 400, "max_tokens"),
    ("/v1/completions", json.dumps({"model": NAME, "prompt": "a", "max_tokens": 10**12}), 400, "max_tokens"),
    ("/v1/completions", json.dumps({"model": NAME, "prompt": "a", "max_tokens": 600}), 400, "max_tokens"),
    ("/v1/completions", json.dumps({"model": NAME, "prompt": "a" * 600}), 400, "prompt"),
    ("/v1/completions", json.dumps({"model": NAME, "prompt": [1, 2, 999]}), 400, "prompt"),
    ("/v1/completions", json.dumps({"model": "gpt-4", "prompt": "a"}), 400, "model"),
    ("/v1/completions", json.dumps({"model": NAME, "prompt": "a", "n": 2}), 400, "n"),
    ("/v1/completions", json.dumps({"model": NAME, "prompt": "a", "logprobs": 3}), 400, "logprobs"),
    ("/v1/completions", json.dumps({"model": NAME, "prompt": "a", "stop": [1]}), 400, "stop"),
    ("/v1/completions", json.dumps({"model": NAME, "prompt": "a", "stream": "yes"}), 400, "stream"),
    ("/v1/chat/completions", json.dumps({"model": NAME, "messages": []}), 400, "messages"),
    ("/v1/chat/completions", json.dumps({"model": NAME, "messages": [{"role": "wizard", "content": "a"}]}), 400,
     "messages[0].role"),
    ("/v1/chat/completions", json.dumps({"model": NAME, "messages": [{"role": "user", "content": "a"}],
                                         "tools": [{"type": "function"}]}), 400, "tools"),
    ("/v1/chat/completions", json.dumps({"model": NAME, "messages": [{"role": "user", "content": "a"}],
                                         "seed": -4}), 400, "seed"),
    ("/v1/chat/completions", json.dumps({"model": NAME, "messages": [{"role": "user", "content": None}]}), 400,
     "messages[0].content"),
    ("/v1/completions", json.dumps({"model": NAME, "prompt": ["a", "b"]}), 400, "prompt"),
    ("/v1/chat/completions", b'{"model": "' + NAME.encode() + b'", "messages": "' + b"a" * (10 << 20) + b'"}',
     413, None),
]


@pytest.mark.parametrize("path,data,status,param", HOSTILE, ids=[f"{i}" for i in range(len(HOSTILE))])
def test_hostile_bodies_get_openais_error_and_the_server_serves_on(server, path, data, status, param):
    url, _ = server
    code, body = post(url, path, data if isinstance(data, bytes) else data.encode())
    assert code == status
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]
    assert body["error"]["param"] == param
    ok, answer = post(url, "/v1/completions", json.dumps({"model": NAME, "prompt": "ok", "max_tokens": 2}).encode())
    assert ok == 200 and answer["usage"]["completion_tokens"] >= 1


def test_models_health_and_metrics(server):
    url, _ = server
    assert [m.id for m in client(url).models.list().data] == [NAME]
    m = metrics(url)
    assert m['spec_adapt_requests_total{outcome="ok"}'] > 0
    assert m["spec_adapt_generation_tokens_total"] > 0 and m["spec_adapt_requests_waiting"] == 0
    drafted = {k: v for k, v in m.items() if k.startswith("spec_adapt_spec_decode_draft_tokens_total")}
    assert drafted and sum(drafted.values()) > 0
    assert any(k.startswith("spec_adapt_spec_decode_width_total") for k in m)


def test_sigterm_finishes_in_flight_requests_and_exits_0(pair):
    """A server of its own: SIGTERM while a request runs; the request is answered and the process exits 0."""
    _, _, _, folder = pair
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "spec_adapt.tools.cli", "serve", "--model", str(folder / "target"), "--drafter",
         "none", "--served-name", NAME, "--port", str(port)], env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                time.sleep(0.2)
        got, began = [], time.time()
        t = threading.Thread(target=lambda: got.append(post(url, "/v1/completions", json.dumps(
            {"model": NAME, "prompt": "z", "max_tokens": 200, "temperature": 0}).encode())))
        t.start()
        while metrics(url)["spec_adapt_requests_running"] < 1:      # SIGTERM once the request runs, not before
            assert t.is_alive() and time.time() < began + 60
            time.sleep(0.05)
        proc.terminate()
        t.join(60)
        assert proc.wait(60) == 0
        assert got and got[0][0] == 200
    finally:
        if proc.poll() is None:
            proc.kill()


# -- in process: faults ---------------------------------------------------------------------------------------------
def in_process(target, tok, drafter, policy=None):
    from starlette.testclient import TestClient

    from spec_adapt.serving.engine import Engine
    from spec_adapt.serving.openai_api import create_app

    engine = Engine(target, drafter=drafter, assistant_policy=policy or FixedLength(3), max_batch=4,
                    tokenizer=tok)
    return TestClient(create_app(engine, tok, NAME))


def test_a_drafter_that_raises_on_some_steps_still_gives_stocks_answers(pair):
    target, _, tok, _ = pair
    calls = [0]

    def flaky(row, context, gamma):
        calls[0] += 1
        if calls[0] % 7 == 0:
            raise RuntimeError("drafter fault")
        return [int(context[-1])] * gamma

    with in_process(target, tok, ScriptedDrafter(flaky)) as http:
        c = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
        for text in ("alpha beta", "gamma delta epsilon", "zeta"):
            r = c.completions.create(model=NAME, prompt=text, max_tokens=12, temperature=0,
                                     extra_body={"return_token_ids": True})
            assert r.choices[0].token_ids == stock(target, tok(text).input_ids, 12)


def fails_once(model, at):
    """A copy of the model whose forward raises once, at its `at`-th call."""
    import copy
    import functools

    model = copy.deepcopy(model)
    inner, calls = model.forward, [0]

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at:
            raise RuntimeError("simulated target fault")
        return inner(*args, **kwargs)

    model.forward = forward
    return model


def test_a_target_fault_answers_500_to_its_requests_and_the_server_serves_on(pair):
    target, _, tok, _ = pair
    with in_process(fails_once(target, at=3), tok, None, FixedLength(0)) as http:
        body = {"model": NAME, "prompt": "abc", "max_tokens": 8, "temperature": 0}
        first = http.post("/v1/completions", json=body)
        assert first.status_code == 500 and first.json()["error"]["type"] == "server_error"
        again = http.post("/v1/completions", json={**body, "return_token_ids": True})
        assert again.status_code == 200
        assert again.json()["choices"][0]["token_ids"] == stock(target, tok("abc").input_ids, 8)
