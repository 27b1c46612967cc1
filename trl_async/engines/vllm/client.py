"""HTTP client for one vLLM server (``vllm serve`` with ``VLLM_SERVER_DEV_MODE=1`` and ``--enable-scale-out``).

Standard library only, so the trainer needs neither vLLM nor an HTTP package. It speaks three groups of endpoints:
  * generation: ``/inference/v1/generate`` (token ids in, token ids out, with each token's log-prob and the
    ``weight_versions`` spans vLLM records: which pushed weights sampled which tokens);
  * pausing: ``/pause?mode=keep|wait`` and ``/resume`` around a weight update;
  * weight transfer: ``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
    ``/finish_weight_update`` (the four methods of vLLM's ``VLLMWeightSyncClient`` protocol, so vLLM's own trainer
    engines can drive this client).
A request that cannot reach the server, times out or gets a 5xx is retried with exponential backoff until
``retry_s`` has passed, then raises ``VLLMServerError`` naming the server; a 4xx (a request the server rejects) raises
at once with the server's message. A generation is the exception to the timeout: it may take as long as it takes
(long reasoning on a busy server), so its reply has no socket timeout; the server's liveness is watched instead
(``GET /health``), and a generation is never sent again while the server may still be running it.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass


class VLLMServerError(RuntimeError):
    """A vLLM server is unreachable, failed, or rejected a request."""


class _NotRunning(Exception):
    """A request the server is not running (never reached it, or it ended with the connection or a 5xx): safe to
    send again."""


@dataclass(frozen=True)
class Completion:
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]  # per token: the pushed weight version that sampled it
    finish_reason: str | None


def token_versions(spans: Sequence[dict] | None, num_tokens: int) -> tuple[int, ...]:
    """Per-token versions from vLLM's ``weight_versions`` spans (``{"version", "start", "end"}`` over output token
    indices). Every token must be covered by a version this trainer pushed (an integer label)."""
    versions: list[int | None] = [None] * num_tokens
    for span in spans or ():
        label = span["version"]
        try:
            version = int(label)
        except (TypeError, ValueError):
            raise VLLMServerError(
                f"tokens {span['start']}..{span['end']} were sampled by weights labelled {label!r}, not by weights "
                "this trainer pushed (is another client updating this server?)"
            ) from None
        for i in range(span["start"], min(span["end"], num_tokens)):
            versions[i] = version
    if None in versions:
        raise VLLMServerError(f"the server's weight_versions spans {spans!r} do not cover all {num_tokens} tokens")
    return tuple(versions)  # type: ignore[arg-type]


class VLLMServer:
    def __init__(self, url: str, request_timeout_s: float = 300.0, retry_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.request_timeout_s = request_timeout_s
        self.retry_s = retry_s

    def __repr__(self) -> str:
        return f"VLLMServer({self.url})"

    # ---- transport ---------------------------------------------------------------------------------------------
    def _once(self, method: str, path: str, body: dict | None, timeout_s: float) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            payload = response.read()
        try:
            return json.loads(payload) if payload else {}
        except json.JSONDecodeError:  # some endpoints answer in plain text (/v1/load_lora_adapter)
            return {"text": payload.decode(errors="replace")}

    def request(
        self, method: str, path: str, body: dict | None = None, timeout_s: float | None = None, retry: bool = True
    ) -> dict:
        timeout_s = self.request_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + (self.retry_s if retry else 0.0)
        delay = 0.25
        while True:
            try:
                return self._once(method, path, body, timeout_s)
            except urllib.error.HTTPError as exc:
                detail = exc.read().decode(errors="replace")[:2000]
                if exc.code < 500:
                    raise VLLMServerError(
                        f"{self.url}{path} rejected the request (HTTP {exc.code}): {detail}"
                    ) from exc
                why = f"HTTP {exc.code}: {detail}"
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
                why = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
            if time.monotonic() + delay > deadline:
                retried = (
                    f"gave up after retrying for {self.retry_s:.0f}s (rollout_vllm_retry_s)"
                    if retry
                    else "not retried"
                )
                raise VLLMServerError(f"vLLM server {self.url} failed {method} {path} ({why}); {retried}")
            time.sleep(delay)
            delay = min(2 * delay, 4.0)

    def post_while_alive(
        self,
        path: str,
        body: dict,
        health_every_s: float = 2.0,
        stopped: Callable[[], bool] | None = None,
        alive: Callable[[], bool] | None = None,
    ) -> dict:
        """POST a request whose reply takes as long as the work it asks for (a generation): no socket timeout on the
        reply. Every ``health_every_s`` the server's liveness is checked instead: ``alive()`` when given (a caller
        that already watches the server, e.g. a lane's health thread), else ``GET /health``; once it has failed for
        ``request_timeout_s`` the request is abandoned (an error, not resent), and at once when ``stopped()``
        (closing the connection makes vLLM cancel the request). Resent, within ``retry_s`` of the first failure, only
        when it cannot be running: the connection was refused or closed by the server, or it answered with a 5xx."""
        deadline, delay = None, 0.25
        while True:
            if stopped is not None and stopped():  # checked before every attempt: a retry may follow a long backoff
                raise VLLMServerError(f"vLLM server {self.url}: POST {path} abandoned, its lane was stopped")
            try:
                return self._post_watched(path, body, health_every_s, stopped, alive)
            except _NotRunning as exc:
                why = str(exc)
            deadline = deadline or time.monotonic() + self.retry_s
            if time.monotonic() + delay > deadline:
                raise VLLMServerError(
                    f"vLLM server {self.url} failed POST {path} ({why}); gave up after retrying for "
                    f"{self.retry_s:.0f}s (rollout_vllm_retry_s)"
                )
            time.sleep(delay)
            delay = min(2 * delay, 4.0)

    def _post_watched(self, path: str, body: dict, health_every_s: float, stopped, alive) -> dict:
        parts = urllib.parse.urlsplit(self.url)
        connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        connection = connection_class(parts.hostname, parts.port, timeout=min(10.0, self.request_timeout_s))
        try:
            connection.connect()
        except OSError as exc:
            raise _NotRunning(f"{type(exc).__name__}: {exc}") from None
        connection.sock.settimeout(None)  # the reply comes when the generation is done
        connection.auto_open = 0  # once abandoned (closed below), a send not yet made fails instead of reconnecting
        reply: dict = {}
        done = threading.Event()

        def send_and_wait() -> None:
            try:
                connection.request(
                    "POST",
                    parts.path.rstrip("/") + path,
                    body=json.dumps(body).encode(),
                    headers={"Content-Type": "application/json"},
                )
                response = connection.getresponse()
                reply["status"], reply["payload"] = response.status, response.read()
            except BaseException as exc:  # noqa: BLE001 - reported on the calling thread
                reply["error"] = exc
            finally:
                done.set()

        threading.Thread(target=send_and_wait, name=f"trl_async-vllm-request-{self.url}", daemon=True).start()
        failing_since = None
        try:
            while not done.wait(health_every_s):
                if stopped is not None and stopped():
                    raise VLLMServerError(f"vLLM server {self.url}: POST {path} abandoned, its lane was stopped")
                if alive is not None:  # the caller's own watch already spans request_timeout_s
                    healthy_long_enough = alive()
                elif self.healthy(timeout_s=min(2.0, health_every_s)):
                    failing_since = None
                    continue
                else:
                    failing_since = failing_since or time.monotonic()
                    healthy_long_enough = time.monotonic() - failing_since <= self.request_timeout_s
                if not healthy_long_enough:
                    raise VLLMServerError(
                        f"vLLM server {self.url} failed its health check (GET /health) for "
                        f"{self.request_timeout_s:.0f}s (rollout_timeout_s) while running POST {path}; the request was "
                        "abandoned, not resent"
                    )
        finally:
            if not done.is_set():  # abandoned: unblock the request's thread
                with contextlib.suppress(OSError):
                    connection.sock.shutdown(socket.SHUT_RDWR)
            connection.close()
        if "error" in reply:  # the server closed the connection (stopped, restarted): it is not running the request
            exc = reply["error"]
            raise _NotRunning(f"{type(exc).__name__}: {exc}")
        status, payload = reply["status"], reply["payload"]
        if status >= 500:
            raise _NotRunning(f"HTTP {status}: {payload.decode(errors='replace')[:2000]}")
        if status >= 400:
            raise VLLMServerError(
                f"{self.url}{path} rejected the request (HTTP {status}): {payload.decode(errors='replace')[:2000]}"
            )
        return json.loads(payload) if payload else {}

    # ---- status ------------------------------------------------------------------------------------------------
    def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            self._once("GET", "/health", None, timeout_s)
            return True
        except Exception:  # noqa: BLE001 - any failure means "not healthy now"
            return False

    def wait_until_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if time.monotonic() > deadline:
                raise VLLMServerError(f"vLLM server {self.url} was not healthy (GET /health) within {timeout_s:.0f}s")
            time.sleep(0.5)

    def has_endpoint(self, path: str, timeout_s: float = 5.0) -> bool:
        """Whether the server routes ``path`` at all (any answer but 404 Not Found to a GET)."""
        try:
            self._once("GET", path, None, timeout_s)
        except urllib.error.HTTPError as exc:
            return exc.code != 404
        except (urllib.error.URLError, OSError) as exc:
            raise VLLMServerError(f"vLLM server {self.url} failed GET {path}: {exc}") from exc
        return True

    def requests_in_flight(self, timeout_s: float = 2.0) -> int:
        """The requests the server is running or has waiting (its Prometheus gauges, summed over its engines)."""
        text = self._once("GET", "/metrics", None, timeout_s).get("text", "")
        names = ("vllm:num_requests_running", "vllm:num_requests_waiting")
        return round(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(names)))

    def world_size(self) -> int:
        return int(self.request("GET", "/get_world_size")["world_size"])

    def server_info(self) -> dict:
        return self.request("GET", "/server_info?config_format=json")

    # ---- generation --------------------------------------------------------------------------------------------
    def generate(
        self, prompt_ids: Sequence[int], sampling_params: dict, stopped=None, alive=None, adapter=None
    ) -> list[Completion]:
        """``sampling_params['n']`` completions of one prompt, in choice order (``stopped``, ``alive``: see
        ``post_while_alive``). ``adapter``: ``(name, version)`` of a loaded LoRA adapter to sample with; every
        token is then that version's (the request runs on its adapter to the end)."""
        body = {"token_ids": list(prompt_ids), "sampling_params": sampling_params}
        if adapter is not None:
            body["model"] = adapter[0]
        reply = self.post_while_alive("/inference/v1/generate", body, stopped=stopped, alive=alive)
        return completions_from_response(reply, self.url, None if adapter is None else adapter[1])

    def pause(self, mode: str) -> None:
        self.request("POST", f"/pause?mode={mode}")

    def reset_prefix_cache(self) -> None:
        """Drop every cached KV block, preempting running requests (they are re-computed with the current weights);
        after a weight update the cache holds keys and values of the old weights."""
        if not self.request("POST", "/reset_prefix_cache?reset_running_requests=true").get("success", False):
            raise VLLMServerError(f"{self.url} could not reset its prefix cache after a weight update")

    def resume(self) -> None:
        self.request("POST", "/resume")

    # ---- weight transfer (vLLM's VLLMWeightSyncClient protocol) ------------------------------------------------
    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.request("POST", "/init_weight_transfer_engine", {"init_info": init_info}, retry=False)

    def start_weight_update(self) -> None:
        self.request("POST", "/start_weight_update", {})

    def update_weights(self, update_info: dict) -> None:
        self.request("POST", "/update_weights", {"update_info": update_info}, retry=False)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.request("POST", "/finish_weight_update", {"weight_version": weight_version})

    # ---- LoRA adapters (engines/vllm/adapters.py; the server needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=True) ---------
    def load_lora_adapter(self, name: str, path: str) -> None:
        # in place: a retry after a load whose reply was lost must not fail as "already loaded" (names are unique)
        self.request("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path, "load_inplace": True})

    def unload_lora_adapter(self, name: str, retry: bool = True, timeout_s: float | None = None) -> None:
        try:
            self.request("POST", "/v1/unload_lora_adapter", {"lora_name": name}, timeout_s=timeout_s, retry=retry)
        except VLLMServerError as exc:
            if "(HTTP 404)" not in str(exc):  # not loaded (any more): a retried unload whose reply was lost
                raise


def completions_from_response(response: dict, url: str, version: int | None = None) -> list[Completion]:
    """The choices of a ``/inference/v1/generate`` response in choice order. A null log-prob (vLLM writes a NaN as
    null) becomes NaN: the correction gives such a token ratio 1 and counts it, as GRPOTrainer does. ``version``: the
    version of the adapter the request named (every token's); otherwise each token's comes from the spans."""
    completions = []
    for choice in sorted(response["choices"], key=lambda c: c["index"]):
        ids = tuple(choice["token_ids"])
        content = (choice.get("logprobs") or {}).get("content") or []
        if len(content) != len(ids):
            raise VLLMServerError(f"{url} returned {len(content)} log-probs for {len(ids)} tokens: request logprobs=0")
        completions.append(
            Completion(
                token_ids=ids,
                logprobs=tuple(math.nan if e["logprob"] is None else float(e["logprob"]) for e in content),
                versions=(version,) * len(ids)
                if version is not None
                else token_versions(choice.get("weight_versions"), len(ids)),
                finish_reason=choice.get("finish_reason"),
            )
        )
    return completions
