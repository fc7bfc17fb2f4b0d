"""An OpenAI-compatible HTTP front end for the serving Engine (`spec-adapt serve`, or `create_app` in your own app).

Routes: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (the tokenizer's chat template),
`GET /health`, `GET /metrics` (Prometheus text). Bodies follow OpenAI's schema; `stream: true` answers server-sent
events ending with `data: [DONE]`. Each request carries its own `max_tokens` (`max_completion_tokens`),
`temperature` (0 = greedy), `top_p`, `seed` and `stop` strings into the one running batch (spec_adapt.serving.sampling).
An extension, `return_token_ids: true`, adds the generated token ids to each choice (`token_ids`).

Boundaries: the body is read up to `max_body_bytes` (413 past it) and checked field by field before anything is
queued; a wrong field answers 400 in OpenAI's error schema naming it (`error.param`), and so does a field the server
does not serve (`n` > 1, tools, logprobs, ...). A full waiting queue answers 429 with `Retry-After`. A request the
target failed on answers 500 (the engine serves on); a drafter that fails falls back as in `generate`. A client that
disconnects cancels its request: its row leaves the batch at the next engine step.
"""


import asyncio
import json
import math
import numbers
import queue
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from .engine import Engine, EngineError, QueueFull, RequestError

COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n", "user",
          "return_token_ids"}
ALLOWED = {"completions": COMMON | {"prompt"},
           "chat": COMMON | {"messages", "max_completion_tokens"}}
# Fields OpenAI defines that this server does not serve: refused by name, never silently ignored.
UNSERVED = {"tools", "tool_choice", "functions", "function_call", "response_format", "logprobs", "top_logprobs",
            "logit_bias", "presence_penalty", "frequency_penalty", "best_of", "echo", "suffix", "audio",
            "modalities", "prediction", "parallel_tool_calls", "reasoning_effort", "web_search_options"}
DRAIN = 64 << 20     # bytes of an over-long body read (and dropped) before its 413, so the client reads the answer
WAKE = 0.25           # seconds a request waits for tokens before it looks whether its client left


class ApiError(Exception):
    """An answer in OpenAI's error schema: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Query:
    """One checked request: the prompt's token ids and everything the engine and the answer need."""

    kind: str                          # "completions" or "chat"
    ids: list[int]
    max_tokens: int
    sampling: dict
    stop: list[str]
    stream: bool
    usage_in_stream: bool
    token_ids: bool
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class Counters:
    """What /metrics counts besides the engine's statistics (the HTTP side)."""

    requests: dict = field(default_factory=lambda: {s: 0 for s in ("ok", "stopped", "failed", "cancelled",
                                                                   "rejected", "invalid")})
    prompt_tokens: int = 0
    generation_tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, status: str, prompt: int = 0, generated: int = 0) -> None:
        with self.lock:
            self.requests[status] += 1
            self.prompt_tokens += prompt
            self.generation_tokens += generated


def create_app(engine: Engine, tokenizer, model_name: str, *, max_body_bytes: int = 1 << 20,
               default_max_tokens: int = 256, start: bool = True):
    """The ASGI app (FastAPI) serving `engine` under the model id `model_name`. `start`: the app's lifespan starts
    the engine's thread and stops it at shutdown (`Engine.stop`: requests not finished fail); False when you drive
    the engine yourself."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    if engine.tokenizer is None:
        engine.tokenizer = tokenizer
    server = Server(engine, tokenizer, model_name, default_max_tokens)

    @asynccontextmanager
    async def lifespan(app):
        if start:
            engine.start()
        yield
        if start:
            engine.stop()

    app = FastAPI(title="spec_adapt", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.get("/health")
    async def health():
        alive = engine.driven() or not start
        return JSONResponse({"status": "ok" if alive else "stopped"}, status_code=200 if alive else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": server.created,
                                            "owned_by": "spec_adapt"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.metrics(), media_type="text/plain; version=0.0.4")

    async def answer(request: Request, kind: str):
        try:
            body = await read_json(request, max_body_bytes)
            query = server.check(body, kind)
        except ApiError as exc:
            server.counters.count("invalid")
            raise exc
        handle = server.submit(query)
        if query.stream:
            return StreamingResponse(server.events(handle, query), media_type="text/event-stream")
        return JSONResponse(await server.whole(handle, query, request))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, "completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await answer(request, "chat")

    return app


async def read_json(request, limit: int) -> dict:
    """The body as a JSON object, kept up to `limit` bytes: a longer one answers 413, after it is read (a client
    still sending would see its connection reset instead) unless it runs past DRAIN bytes."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > DRAIN:
            break
        if size <= limit:
            chunks.append(chunk)
    if size > limit:
        raise ApiError(413, f"The body exceeds {limit} bytes, the most this server takes.", code="too_large")
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"The body is not valid JSON ({exc}).") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"The body must be a JSON object, got {type(body).__name__}.")
    return body


class Server:
    """The checks, the engine's requests and the answers (see the module docstring)."""

    def __init__(self, engine: Engine, tokenizer, model_name: str, default_max_tokens: int):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.default_max_tokens = default_max_tokens
        self.created = int(time.time())
        self.counters = Counters()
        self.context = engine.max_positions

    # -- checks ----------------------------------------------------------------------------------------------------
    def check(self, body: dict, kind: str) -> Query:
        for name in body:
            if name in UNSERVED or name not in ALLOWED[kind]:
                if name in UNSERVED and body[name] in (None, False, 0, [], {}):
                    continue                           # a client's explicit default asks for nothing
                raise ApiError(400, f"'{name}' is not served by this server (it serves {sorted(ALLOWED[kind])}).",
                               param=name, code="unsupported_parameter")
        model = body.get("model")
        if not isinstance(model, str):
            raise ApiError(400, "'model' is required: a string naming the model (GET /v1/models).", param="model")
        if model != self.model_name:
            raise ApiError(400, f"The model '{model}' is not served here; this server serves '{self.model_name}'.",
                           param="model", code="model_not_found")
        if body.get("n", 1) != 1 or isinstance(body.get("n"), bool):
            raise ApiError(400, f"'n' must be 1 (one choice per request), got {body.get('n')!r}.", param="n")
        ids = self._prompt(body) if kind == "completions" else self._messages(body)
        limit_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        default = 16 if kind == "completions" else self.default_max_tokens
        max_tokens = _int(body, limit_name, 1, 1 << 20, default)
        if self.context is not None:
            if len(ids) >= self.context:
                raise ApiError(400, f"The prompt is {len(ids)} tokens; the model's context is {self.context}.",
                               param="prompt" if kind == "completions" else "messages",
                               code="context_length_exceeded")
            if body.get(limit_name) is None:
                max_tokens = min(max_tokens, self.context - len(ids))
            elif len(ids) + max_tokens > self.context:
                raise ApiError(400, f"The prompt ({len(ids)} tokens) plus {limit_name} ({max_tokens}) exceeds the "
                               f"model's context of {self.context} tokens.", param=limit_name,
                               code="context_length_exceeded")
        sampling = {"temperature": _real(body, "temperature", 0.0, 2.0),
                    "top_p": _real(body, "top_p", 0.0, 1.0, open_low=True),
                    "seed": _int(body, "seed", 0, (1 << 63) - 1, None)}
        stream = _bool(body, "stream")
        options = body.get("stream_options")
        if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}
                                    or not isinstance(options.get("include_usage", False), bool)):
            raise ApiError(400, "'stream_options' takes {\"include_usage\": true|false}.", param="stream_options")
        return Query(kind, ids, max_tokens, {k: v for k, v in sampling.items() if v is not None}, _stops(body),
                     stream, bool((options or {}).get("include_usage")), _bool(body, "return_token_ids"))

    def _prompt(self, body) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]                        # a batch of one prompt
        if isinstance(prompt, str) and prompt:
            return self.tokenizer(prompt).input_ids
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in prompt):
            if not all(0 <= t < self.engine.vocab for t in prompt):
                raise ApiError(400, f"Token ids in 'prompt' must lie in [0, {self.engine.vocab}).", param="prompt")
            return list(prompt)
        raise ApiError(400, "'prompt' must be a non-empty string or a non-empty list of token ids (one prompt per "
                       "request).", param="prompt")

    def _messages(self, body) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects.", param="messages")
        turns = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                    or message["role"] not in ("system", "developer", "user", "assistant"):
                raise ApiError(400, f"messages[{i}] needs a role among system, developer, user and assistant.",
                               param=f"messages[{i}].role")
            turns.append({"role": "system" if message["role"] == "developer" else message["role"],
                          "content": _content(message.get("content"), i)})
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ApiError(400, "This model's tokenizer has no chat template: use /v1/completions.",
                           param="messages")
        try:
            ids = self.tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True)["input_ids"]
        except Exception as exc:  # noqa: BLE001 - a template's own rule (e.g. roles that must alternate)
            raise ApiError(400, f"The model's chat template refused these messages: {exc}", param="messages") \
                from None
        return list(ids)

    # -- the engine's side ------------------------------------------------------------------------------------------
    def submit(self, query: Query):
        handle = self.engine.submit(query.ids, max_new_tokens=query.max_tokens, **query.sampling)
        if handle.state == "failed":
            error = handle.error
            if isinstance(error, QueueFull):
                self.counters.count("rejected")
                raise ApiError(429, f"The server is at capacity ({error}).", code="rate_limit_exceeded",
                               kind="rate_limit_error", headers={"Retry-After": "1"})
            if isinstance(error, RequestError):
                self.counters.count("invalid")
                raise ApiError(400, str(error))
            self.counters.count("failed")
            raise ApiError(503, f"The engine takes no requests: {error}", kind="server_error")
        return handle

    async def tokens(self, handle, query: Query, disconnected=None):
        """Yield (text delta, done) as the request's tokens come: text decoded from the start each time (multi-byte
        characters whole), held back while it may end in a stop string; at a stop string the request is cancelled."""
        text, sent, reply = "", 0, Reply(self, handle, query)
        woken, loop = asyncio.Event(), asyncio.get_running_loop()
        handle.on_update = lambda: loop.call_soon_threadsafe(woken.set)
        hold = max((len(s) for s in query.stop), default=1) - 1
        while True:
            got = reply.drain()
            if got or reply.ended:
                text = reply.text()
                cut = reply.find_stop(text)
                if cut is not None:
                    text = text[:cut]
                    handle.cancel()
                    reply.stopped = True
                end = reply.ended or reply.stopped
                safe = len(text) if end else len(text.rstrip("\ufffd")) - hold
                if safe > sent:
                    yield text[sent:safe], False
                    sent = safe
                if end:
                    self.counters.count(reply.status(), len(query.ids), len(reply.tokens))
                    yield reply, True
                    return
            elif disconnected is not None and await disconnected():
                handle.cancel()
                self.counters.count("cancelled", len(query.ids), len(reply.tokens))
                return
            else:                        # until the engine hands tokens, or a while to look for a disconnect
                try:
                    await asyncio.wait_for(woken.wait(), WAKE)
                except asyncio.TimeoutError:
                    pass
                woken.clear()

    async def whole(self, handle, query: Query, request) -> dict:
        parts, reply = [], None
        try:
            async for delta, done in self.tokens(handle, query, request.is_disconnected):
                if done:
                    reply = delta
                else:
                    parts.append(delta)
        finally:
            if reply is None:
                handle.cancel()
        if reply is None:
            return {}                                  # the client left; nobody reads this
        reply.raise_failure()
        choice = {"index": 0, "finish_reason": reply.finish_reason(), "logprobs": None}
        if query.kind == "chat":
            choice["message"] = {"role": "assistant", "content": "".join(parts)}
        else:
            choice["text"] = "".join(parts)
        if query.token_ids:
            choice["token_ids"] = reply.tokens
        return {**self._head(query, chunk=False), "choices": [choice], "usage": reply.usage()}

    async def events(self, handle, query: Query):
        """Server-sent events: the chunks, the usage chunk if asked, then [DONE]. A client that leaves cancels."""
        finished = False
        try:
            if query.kind == "chat":
                yield self._chunk(query, {"delta": {"role": "assistant", "content": ""}})
            async for delta, done in self.tokens(handle, query):
                if not done:
                    yield self._chunk(query, {"delta": {"content": delta}} if query.kind == "chat"
                                      else {"text": delta})
                    continue
                reply, finished = delta, True
                if reply.failure() is not None:
                    error = reply.failure()
                    yield f"data: {json.dumps(error.body())}\n\n"
                else:
                    last = {"delta": {}} if query.kind == "chat" else {"text": ""}
                    last["finish_reason"] = reply.finish_reason()
                    if query.token_ids:
                        last["token_ids"] = reply.tokens
                    yield self._chunk(query, last)
                    if query.usage_in_stream:
                        yield f"data: {json.dumps({**self._head(query, chunk=True), 'choices': [], 'usage': reply.usage()})}\n\n"
                yield "data: [DONE]\n\n"
        finally:
            if not finished:
                handle.cancel()
                self.counters.count("cancelled", len(query.ids))

    def _head(self, query: Query, chunk: bool) -> dict:
        kind = {("chat", False): "chat.completion", ("chat", True): "chat.completion.chunk",
                ("completions", False): "text_completion", ("completions", True): "text_completion"}
        prefix = "chatcmpl-" if query.kind == "chat" else "cmpl-"
        return {"id": prefix + query.id, "object": kind[query.kind, chunk], "created": query.created,
                "model": self.model_name}

    def _chunk(self, query: Query, choice: dict) -> str:
        choice = {"index": 0, "logprobs": None, "finish_reason": None, **choice}
        return f"data: {json.dumps({**self._head(query, chunk=True), 'choices': [choice]})}\n\n"

    # -- metrics ----------------------------------------------------------------------------------------------------
    def metrics(self) -> str:
        """Prometheus text: requests by outcome, tokens, running and waiting rows, and per drafting source the
        drafted and accepted tokens, row-steps and mean acceptance length; the widths chosen (row-steps per width)."""
        engine, c = self.engine, self.counters
        stats = engine.stats
        lines = _family("spec_adapt_requests_total", "counter", "Requests by outcome.",
                        [({"outcome": k}, v) for k, v in sorted(c.requests.items())])
        lines += _family("spec_adapt_prompt_tokens_total", "counter", "Prompt tokens of answered requests.",
                         [({}, c.prompt_tokens)])
        lines += _family("spec_adapt_generation_tokens_total", "counter", "Tokens generated for answered requests.",
                         [({}, c.generation_tokens)])
        lines += _family("spec_adapt_requests_running", "gauge", "Requests in the running batch.",
                         [({}, len(engine.running))])
        lines += _family("spec_adapt_requests_waiting", "gauge", "Requests waiting for a row.",
                         [({}, len(engine.waiting))])
        sources = dict(stats.per_source) or {"all": {"rows": stats.drafting_row_steps, "drafted": stats.drafted,
                                                     "accepted": stats.accepted}}
        lines += _family("spec_adapt_spec_decode_draft_tokens_total", "counter", "Tokens drafted, per source.",
                         [({"source": s}, v["drafted"]) for s, v in sorted(sources.items())])
        lines += _family("spec_adapt_spec_decode_accepted_tokens_total", "counter", "Drafted tokens the target "
                         "accepted, per source.", [({"source": s}, v["accepted"]) for s, v in sorted(sources.items())])
        lines += _family("spec_adapt_spec_decode_drafts_total", "counter", "Row-steps that drafted, per source.",
                         [({"source": s}, v["rows"]) for s, v in sorted(sources.items())])
        lines += _family("spec_adapt_spec_decode_acceptance_length", "gauge", "Mean tokens committed per drafting "
                         "row-step (accepted drafts + 1), per source.",
                         [({"source": s}, 1 + v["accepted"] / v["rows"] if v["rows"] else 0.0)
                          for s, v in sorted(sources.items())])
        lines += _family("spec_adapt_spec_decode_width_total", "counter", "Row-steps by the width (draft length) "
                         "the policy chose.", [({"width": str(w)}, n) for w, n in sorted(dict(stats.widths).items())])
        lines += _family("spec_adapt_speculation_fallback", "gauge", "1 when the drafter was dropped.",
                         [({}, int(engine.fallback is not None))])
        lines += _family("spec_adapt_suffix_index_contexts", "gauge", "Contexts the suffix index holds (it grows "
                         "with the tokens served, up to its max_contexts, then starts afresh).",
                         [({}, sum(len(index.next) for index in _suffix_indexes(engine.loop.given_drafter)))])
        return "\n".join(lines) + "\n"


class Reply:
    """What one request has been given so far, read from its handle's queue."""

    def __init__(self, server: Server, handle, query: Query):
        self.server, self.handle, self.query = server, handle, query
        self.tokens: list[int] = []
        self.ended = self.stopped = False

    def drain(self) -> bool:
        got = False
        while True:
            try:
                token = self.handle._stream.get_nowait()
            except queue.Empty:
                return got
            if token is None:
                self.ended = True
                return True
            self.tokens.append(token)
            got = True

    def text(self) -> str:
        return self.server.tokenizer.decode(self.tokens, skip_special_tokens=True)

    def find_stop(self, text: str) -> int | None:
        found = [text.find(s) for s in self.query.stop if s in text]
        return min(found) if found else None

    def finish_reason(self) -> str:
        if self.stopped:
            return "stop"
        eos = self.server.engine.loop.stopper.eos
        ends_on_eos = self.tokens and eos is not None and self.tokens[-1] in eos.tolist()
        return "stop" if ends_on_eos or len(self.tokens) < self.query.max_tokens else "length"

    def failure(self) -> ApiError | None:
        if self.stopped or self.handle.state != "failed":
            return None
        error = self.handle.error
        if isinstance(error, EngineError):
            return ApiError(500, f"The request failed in the engine: {error}", kind="server_error")
        return ApiError(400, str(error))

    def raise_failure(self) -> None:
        error = self.failure()
        if error is not None:
            raise error

    def status(self) -> str:
        if self.stopped:
            return "stopped"
        return {"done": "ok", "failed": "failed"}.get(self.handle.state, "cancelled")

    def usage(self) -> dict:
        p, n = len(self.query.ids), len(self.tokens)
        return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}


def _suffix_indexes(drafter) -> list:
    """The suffix indexes a drafter (or the sources of a several-source drafter) drafts from."""
    from ..drafters.suffix import SuffixIndex

    sources = [drafter, *getattr(drafter, "free", [])]
    return [s.index for s in sources if isinstance(getattr(s, "index", None), SuffixIndex)]


def _family(name: str, kind: str, help_text: str, samples: list) -> list[str]:
    out = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        label = ",".join(f'{k}="{v}"' for k, v in labels.items())
        out.append(f"{name}{{{label}}} {value}" if label else f"{name} {value}")
    return out


def _int(body, name, low, high, default):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ApiError(400, f"'{name}' must be an integer in [{low}, {high}], got {value!r}.", param=name)
    return value


def _real(body, name, low, high, open_low=False):
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and \
        (low < value if open_low else low <= value) and value <= high
    if not ok:
        bound = f"({low}, {high}]" if open_low else f"[{low}, {high}]"
        raise ApiError(400, f"'{name}' must be a number in {bound}, got {value!r}.", param=name)
    return float(value)


def _bool(body, name) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be true or false, got {value!r}.", param=name)
    return value


def _stops(body) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, "'stop' must be a non-empty string or a list of up to 4 of them.", param="stop")
    return stops


def _content(content, i: int) -> str:
    """A message's text: a string, or a list of {"type": "text", "text": ...} parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts (this server serves text).",
                   param=f"messages[{i}].content")
