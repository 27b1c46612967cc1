"""An OpenAI-compatible chat-completions endpoint on loopback, served while training, for agents written against any
client: each episode gets a base URL of its own (``http://127.0.0.1:<port>/episodes/<key>/v1``, the key a random
secret), and every request to it is rendered with the trainer's chat template, sampled by the rollout workers and
recorded with its exact tokens (``episode.py``).

Routes: ``POST .../v1/chat/completions`` and ``GET .../v1/models``. A request takes ``messages`` (text content;
assistant ``tool_calls`` with JSON ``arguments``; ``tool`` results), optional ``tools`` (OpenAI function schemas, which
the chat template renders) and ``max_tokens``/``max_completion_tokens``. Sampling parameters of the request
(``temperature``, ``top_p``, ...) are ignored: the trainer's apply, since the importance ratio rebuilds them. Streaming,
``n`` > 1, image content and unknown episodes are refused with an OpenAI-style error. The reply's tool calls are
parsed from the sampled tokens as GRPOTrainer parses them (TRL's ``parse_response``, with the response schema TRL
knows for the model's chat template).
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
    requests: list[Request] = field(default_factory=list)
    refused: str | None = None  # why the episode cannot be trained on (it flooded the endpoint)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def complete(self, body: dict) -> dict:
        """Answer one chat-completions request (``RequestRefused`` for a bad one)."""
        messages, tools, limit = parse_request(body)
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
        with self.lock:  # one request of an episode at a time: they extend each other
            if len(self.requests) >= self.max_requests:
                self.refused = f"more than max_requests={self.max_requests} requests"
                raise RequestRefused(HTTPStatus.TOO_MANY_REQUESTS, f"this episode sent {self.refused}")
            budget = budget_left(self.requests, prompt_ids, self.max_completion_length)
            budget = min(budget, limit) if limit is not None else budget
            if budget <= 0:
                completion, logprobs, versions = (), (), ()
            else:
                try:
                    out = self.generate([list(prompt_ids)], max_new_tokens=budget)
                except ValueError as exc:  # a context longer than the model takes
                    raise RequestRefused(HTTPStatus.BAD_REQUEST, str(exc)) from exc
                completion = tuple(int(t) for t in out["completion_ids"][0])
                logprobs = tuple(float(x) for x in out["logprobs"][0])
                versions = tuple(int(v) for v in out["versions"][0])
            self.requests.append(Request(prompt_ids, completion, logprobs, versions))
            number = len(self.requests)
        message = reply_message(self.tokenizer, prompt_ids, completion, tools, f"{self.key[:8]}_{number}")
        eos = getattr(self.tokenizer, "eos_token_id", None)
        finished = bool(completion) and eos is not None and completion[-1] == eos
        reason = ("tool_calls" if message.get("tool_calls") else "stop") if finished else "length"
        return {
            "id": f"chatcmpl-{self.key[:8]}-{number}",
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


def parse_request(body) -> tuple[list[dict], list[dict], int | None]:
    """``(messages for the chat template, tools, max tokens)`` of a request body, or ``RequestRefused``."""
    bad = HTTPStatus.BAD_REQUEST
    if not isinstance(body, dict):
        raise RequestRefused(bad, "the request body must be a JSON object")
    if body.get("stream"):
        raise RequestRefused(bad, "stream=true is not supported: send stream=false")
    if body.get("n", 1) != 1:
        raise RequestRefused(bad, f"n={body.get('n')!r}: one completion per request (n=1)")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestRefused(bad, "'messages' must be a non-empty list of messages")
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(
        isinstance(t, dict) and isinstance(t.get("function"), dict) for t in tools
    ):
        raise RequestRefused(bad, "'tools' must be a list of {'type': 'function', 'function': {...}} schemas")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None and not (isinstance(limit, int) and limit >= 1):
        raise RequestRefused(bad, f"max_tokens={limit!r}: give a positive integer")
    return [template_message(m, i) for i, m in enumerate(messages)], tools, limit


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
                        "arguments": json.loads(c["function"].get("arguments") or "{}"),
                    },
                }  # fmt: skip
                for c in calls
            ]
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
            raise RequestRefused(bad, f"messages[{index}].tool_calls: {exc!r}") from None
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


def reply_message(tokenizer, prompt_ids, completion_ids, tools, call_prefix: str) -> dict:
    """The assistant message of the sampled tokens, tool calls in the OpenAI format."""
    from trl.chat_template_utils import parse_response

    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        text = tokenizer.decode(list(completion_ids), skip_special_tokens=True)
        return {"role": "assistant", "content": text}
    parsed = parse_response(tokenizer, list(completion_ids), prefix=list(prompt_ids), tools=tools or None)
    message = {"role": "assistant", "content": parsed.get("content") or ""}
    calls = [c for c in parsed.get("tool_calls") or [] if isinstance(c, dict) and "function" in c]
    if calls:
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
    request_queue_size = 1024  # the listen backlog: socketserver's 5 resets connections when many agents connect at once


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

    def close_episode(self, episode: Episode) -> None:
        """Later requests of the episode get 404 (an agent still running after its episode ended)."""
        with self._lock:
            self._episodes.pop(episode.key, None)

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
            self._reply(status, {"error": {"message": message, "type": kind, "code": int(status)}})

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
            length = int(self.headers.get("Content-Length") or 0)
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
            except json.JSONDecodeError as exc:
                return self._error(HTTPStatus.BAD_REQUEST, f"the body is not JSON: {exc}")
            except RequestRefused as exc:
                return self._error(exc.status, str(exc))
            except BaseException as exc:  # noqa: BLE001 - sampling stopped (training ended) or failed
                return self._error(HTTPStatus.SERVICE_UNAVAILABLE, f"the policy cannot sample now: {exc!r}")

    return Handler
