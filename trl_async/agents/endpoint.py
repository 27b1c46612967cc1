"""An OpenAI-compatible chat-completions endpoint on loopback, served while training, for agents written against any
client: each episode gets a base URL of its own (``http://127.0.0.1:<port>/episodes/<key>/v1``, the key a random
secret), and every request to it is rendered with the trainer's chat template, sampled by the rollout workers and
recorded with its exact tokens (``episode.py``).

Routes: ``POST .../v1/chat/completions`` and ``GET .../v1/models``. A request takes ``messages`` (text content;
assistant ``tool_calls`` with JSON ``arguments``, and ``reasoning_content``; ``tool`` results), optional ``tools``
(OpenAI function schemas, which the chat template renders), ``max_tokens``/``max_completion_tokens`` and ``stop``
(the completion is cut after the token that completes a stop string: what is kept was sampled as it is). Other
sampling parameters (``temperature``, ``top_p``, ...) and ``tool_choice``/``response_format`` are ignored: the
trainer's sampling applies, since the importance ratio rebuilds it. Streaming, ``n`` > 1, image content and unknown
episodes are refused with an OpenAI-style error. The reply's tool calls are parsed from the sampled tokens as
GRPOTrainer parses them (TRL's ``parse_response``, with the response schema TRL knows for the model's chat template;
for a template TRL does not know, replies are plain text).
"""

from __future__ import annotations

import copy
import json
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .episode import Request, budget_left

MAX_BODY_BYTES = 8 << 20


class RequestRefused(Exception):
    """A request the endpoint answers with an error (``status``), and the agent sees as an API error."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Episode:
    """One agent run: where its requests are sampled, and what they recorded."""

    key: str
    generate: Callable  # rollout_generate: one completion per token-id list (completion_ids, logprobs, versions)
    tokenizer: object  # this episode's own copy (a fast tokenizer is not shared across threads)
    chat_template: str | None
    chat_template_kwargs: dict
    max_completion_length: int
    max_requests: int
    stop_ids: tuple[int, ...] = ()  # the tokens generation stops at (the trainer's EOS ids)
    requests: list[Request] = field(default_factory=list)
    refused: str | None = None  # why the episode cannot be trained on (it flooded the endpoint)
    closed: bool = False  # ended: a request still in flight records nothing
    lock: threading.Lock = field(default_factory=threading.Lock)

    def close(self) -> list[Request]:
        """End the episode; its requests, as they stand now."""
        with self.lock:
            self.closed = True
            return list(self.requests)

    def complete(self, body: dict) -> dict:
        """Answer one chat-completions request (``RequestRefused`` for a bad one). Requests of one episode are
        answered one at a time: each may extend the one before."""
        messages, tools, limit, stops = parse_request(body)
        with self.lock:
            if self.closed:
                raise RequestRefused(HTTPStatus.NOT_FOUND, "this episode has ended")
            if len(self.requests) >= self.max_requests:
                self.refused = f"more than max_requests={self.max_requests} requests"
                raise RequestRefused(HTTPStatus.TOO_MANY_REQUESTS, f"this episode sent {self.refused}")
            try:
                rendered = self.tokenizer.apply_chat_template(
                    messages, tools=tools or None, chat_template=self.chat_template, add_generation_prompt=True,
                    tokenize=True, return_dict=True, **self.chat_template_kwargs,
                )  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - the template refused these messages: the agent's error
                raise RequestRefused(
                    HTTPStatus.BAD_REQUEST, f"the chat template cannot render these messages: {exc}"
                ) from exc
            prompt_ids = tuple(int(t) for t in rendered["input_ids"])
            budget = budget_left(self.requests, prompt_ids, self.max_completion_length)
            if budget <= 0:  # what the agent added used up the sample's max_completion_length: nothing recorded
                return reply(body, self.key, len(self.requests), prompt_ids, (), {"role": "assistant", "content": ""},
                             "length")  # fmt: skip
            try:
                out = self.generate([list(prompt_ids)], max_new_tokens=min(budget, limit or budget))
            except ValueError as exc:  # a context longer than the model takes
                raise RequestRefused(HTTPStatus.BAD_REQUEST, str(exc)) from exc
            completion = tuple(int(t) for t in out["completion_ids"][0])
            logprobs = tuple(float(x) for x in out["logprobs"][0])
            versions = tuple(int(v) for v in out["versions"][0])
            stopped = bool(completion) and completion[-1] in self.stop_ids
            cut = stop_cut(self.tokenizer, completion, stops)
            if cut is not None:  # a stop string: the tokens up to it, sampled as they are (the rest is not kept)
                completion, logprobs, versions, stopped = completion[:cut], logprobs[:cut], versions[:cut], True
            if self.closed:
                raise RequestRefused(HTTPStatus.NOT_FOUND, "this episode has ended")
            self.requests.append(Request(prompt_ids, completion, logprobs, versions))
            number = len(self.requests)
            message = reply_message(self.tokenizer, prompt_ids, completion, tools, f"{self.key[:8]}_{number}", stops)
        reason = ("tool_calls" if message.get("tool_calls") else "stop") if stopped else "length"
        return reply(body, self.key, number, prompt_ids, completion, message, reason)


def reply(body: dict, key: str, number: int, prompt_ids, completion, message: dict, reason: str) -> dict:
    return {
        "id": f"chatcmpl-{key[:8]}-{number}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": str(body.get("model") or "policy"),
        "choices": [{"index": 0, "message": message, "finish_reason": reason, "logprobs": None}],
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(completion),
            "total_tokens": len(prompt_ids) + len(completion),
        },  # fmt: skip
    }


def stop_cut(tokenizer, completion_ids, stops: list[str]) -> int | None:
    """The fewest leading tokens whose text contains one of ``stops`` (``None``: none does)."""
    if not stops or not completion_ids:
        return None
    text = lambda k: tokenizer.decode(list(completion_ids[:k]), skip_special_tokens=True)  # noqa: E731
    if not any(s in text(len(completion_ids)) for s in stops):
        return None
    low, high = 1, len(completion_ids)  # the text of more tokens contains that of fewer: bisect the first
    while low < high:
        middle = (low + high) // 2
        if any(s in text(middle) for s in stops):
            high = middle
        else:
            low = middle + 1
    return low


def parse_request(body) -> tuple[list[dict], list[dict], int | None, list[str]]:
    """``(messages for the chat template, tools, max tokens, stop strings)`` of a request body, or
    ``RequestRefused``."""
    bad = HTTPStatus.BAD_REQUEST
    if not isinstance(body, dict):
        raise RequestRefused(bad, "the request body must be a JSON object")
    if body.get("stream"):
        raise RequestRefused(bad, "stream=true is not supported: send stream=false")
    if body.get("n") not in (None, 1):
        raise RequestRefused(bad, f"n={body.get('n')!r}: one completion per request (n=1)")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestRefused(bad, "'messages' must be a non-empty list of messages")
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(
        isinstance(t, dict) and isinstance(t.get("function"), dict) for t in tools
    ):
        raise RequestRefused(bad, "'tools' must be a list of {'type': 'function', 'function': {...}} schemas")
    limit = body.get("max_completion_tokens")
    limit = body.get("max_tokens") if limit is None else limit
    if limit is not None and not (isinstance(limit, int) and limit >= 1):
        raise RequestRefused(bad, f"max_tokens={limit!r}: give a positive integer")
    stops = body.get("stop") or []
    stops = [stops] if isinstance(stops, str) else stops
    if not (isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)):
        raise RequestRefused(bad, "'stop' must be a string or a list of non-empty strings")
    return [template_message(m, i) for i, m in enumerate(messages)], tools, limit, stops


def template_message(message, index: int) -> dict:
    """An OpenAI chat message as chat templates take it: text content, tool-call arguments as objects."""
    bad = HTTPStatus.BAD_REQUEST
    if not isinstance(message, dict) or message.get("role") not in (
        "system",
        "developer",
        "user",
        "assistant",
        "tool",
    ):
        raise RequestRefused(bad, f"messages[{index}] needs a role of system, user, assistant or tool")
    out = {"role": "system" if message["role"] == "developer" else message["role"]}
    content = message.get("content")
    if isinstance(content, list):
        if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
            raise RequestRefused(bad, f"messages[{index}]: only text content parts are supported")
        content = "".join(str(p.get("text", "")) for p in content)
    if content is not None and not isinstance(content, str):
        raise RequestRefused(bad, f"messages[{index}].content must be text")
    out["content"] = content or ""
    calls = message.get("tool_calls")
    if calls:
        try:
            out["tool_calls"] = [
                {
                    "type": "function",
                    "id": c.get("id"),
                    "function": {
                        "name": c["function"]["name"],
                        "arguments": arguments(c["function"].get("arguments")),
                    },
                }  # fmt: skip
                for c in calls
            ]
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
            raise RequestRefused(bad, f"messages[{index}].tool_calls: {exc!r}") from None
    for key in ("tool_call_id", "name", "reasoning_content"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


def arguments(value) -> dict:
    """Tool-call arguments as chat templates take them: an object (OpenAI sends a JSON string)."""
    if isinstance(value, dict):
        return value
    parsed = json.loads(value or "{}")
    if not isinstance(parsed, dict):
        raise TypeError(f"arguments must be a JSON object, got {value!r}")
    return parsed


def reply_message(tokenizer, prompt_ids, completion_ids, tools, call_prefix: str, stops=()) -> dict:
    """The assistant message of the sampled tokens, tool calls in the OpenAI format (content ``None`` beside them,
    as OpenAI sends it), any reasoning as ``reasoning_content``, the text cut before a stop string."""
    from trl.chat_template_utils import parse_response

    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        parsed = {"content": tokenizer.decode(list(completion_ids), skip_special_tokens=True)}
    else:
        parsed = parse_response(tokenizer, list(completion_ids), prefix=list(prompt_ids), tools=tools or None)
    content = parsed.get("content") or ""
    for stop in stops:
        content = content.split(stop, 1)[0]
    message = {"role": "assistant", "content": content}
    if parsed.get("reasoning_content"):
        message["reasoning_content"] = parsed["reasoning_content"]
    calls = [c for c in parsed.get("tool_calls") or [] if isinstance(c, dict) and "function" in c]
    if calls:
        message["content"] = content or None
        message["tool_calls"] = [
            {
                "id": f"call_{call_prefix}_{i}",
                "type": "function",
                "function": {
                    "name": str(c["function"].get("name")),
                    "arguments": json.dumps(c["function"].get("arguments") or {}),
                },
            }  # fmt: skip
            for i, c in enumerate(calls)
        ]
    return message


def with_response_schema(tokenizer):
    """A copy of ``tokenizer`` that parses tool calls where TRL knows its chat template (as GRPOTrainer sets it up
    for ``tools``); unchanged otherwise (replies are then plain text)."""
    from trl.chat_template_utils import add_response_schema

    tokenizer = copy.deepcopy(tokenizer)
    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        try:
            tokenizer = add_response_schema(tokenizer)
        except (ValueError, KeyError):  # a template TRL does not know: no tool-call parsing
            pass
    return tokenizer


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # the listen backlog: socketserver's 5 resets connections under a burst of agents

    def handle_error(self, request, client_address) -> None:
        pass  # a client gone mid-reply (its agent timed out): nothing to report


class Endpoint:
    """The HTTP server (loopback, a free port) and its open episodes."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._episodes: dict[str, Episode] = {}
        self._lock = threading.Lock()
        self._server = _Server((host, port), _handler(self))
        self.url = f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="trl_async-agent-endpoint", daemon=True
        )
        self._thread.start()

    def open(self, **episode) -> tuple[Episode, str]:
        """A new episode and its base URL."""
        key = secrets.token_urlsafe(18)
        opened = Episode(key=key, **episode)
        with self._lock:
            self._episodes[key] = opened
        return opened, f"{self.url}/episodes/{key}/v1"

    def close_episode(self, episode: Episode) -> list[Request]:
        """End ``episode``: its requests as they stand; later ones, and any still in flight, record nothing and get
        404 (an agent still running after its episode ended)."""
        with self._lock:
            self._episodes.pop(episode.key, None)
        return episode.close()

    def episode(self, key: str) -> Episode | None:
        with self._lock:
            return self._episodes.get(key)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def _handler(endpoint: Endpoint):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = 600  # an idle keep-alive connection's thread ends after this

        def log_message(self, format, *args):  # noqa: A002 - the base class's name
            pass

        def _reply(self, status: HTTPStatus, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: HTTPStatus, message: str) -> None:
            kind = "invalid_request_error" if status < 500 else "server_error"
            code = {413: "request_too_large", 429: "rate_limit_exceeded", 404: "not_found"}.get(int(status), kind)
            self._reply(status, {"error": {"message": message, "type": kind, "code": code}})

        def _route(self, suffix: str) -> Episode | None:
            parts = self.path.split("?")[0].strip("/").split("/")
            if len(parts) < 3 or parts[0] != "episodes" or "/".join(parts[2:]) != suffix:
                self._error(HTTPStatus.NOT_FOUND, f"no route {self.path}: use /episodes/<key>/{suffix}")
                return None
            episode = endpoint.episode(parts[1])
            if episode is None:
                self._error(HTTPStatus.NOT_FOUND, "no such episode (it has ended, or the key is wrong)")
            return episode

        def do_GET(self):  # noqa: N802 - http.server's name
            if self._route("v1/models") is not None:
                self._reply(HTTPStatus.OK, {"object": "list", "data": [{"id": "policy", "object": "model",
                                                                         "owned_by": "trl_async"}]})  # fmt: skip

        def do_POST(self):  # noqa: N802 - http.server's name
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                self.close_connection = True
                return self._error(HTTPStatus.BAD_REQUEST, "Content-Length is not a number")
            if length > MAX_BODY_BYTES:
                self.close_connection = True
                return self._error(
                    HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"bodies are limited to {MAX_BODY_BYTES} bytes"
                )
            body = self.rfile.read(length)
            episode = self._route("v1/chat/completions")
            if episode is None:
                return None
            try:
                return self._reply(HTTPStatus.OK, episode.complete(json.loads(body or b"null")))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                return self._error(HTTPStatus.BAD_REQUEST, f"the body is not JSON: {exc}")
            except RequestRefused as exc:
                return self._error(exc.status, str(exc))
            except BaseException as exc:  # noqa: BLE001 - sampling stopped (training ended) or failed
                return self._error(HTTPStatus.SERVICE_UNAVAILABLE, f"the policy cannot sample now: {exc!r}")

    return Handler
