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
at once with the server's message.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass


class VLLMServerError(RuntimeError):
    """A vLLM server is unreachable, failed, or rejected a request."""


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
        return json.loads(payload) if payload else {}

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

    def world_size(self) -> int:
        return int(self.request("GET", "/get_world_size")["world_size"])

    def server_info(self) -> dict:
        return self.request("GET", "/server_info?config_format=json")

    # ---- generation --------------------------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], sampling_params: dict) -> list[Completion]:
        """``sampling_params['n']`` completions of one prompt, in choice order."""
        body = {"token_ids": list(prompt_ids), "sampling_params": sampling_params}
        return completions_from_response(self.request("POST", "/inference/v1/generate", body), self.url)

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


def completions_from_response(response: dict, url: str) -> list[Completion]:
    """The choices of a ``/inference/v1/generate`` response in choice order. A null log-prob (vLLM writes a NaN as
    null) becomes NaN: the correction gives such a token ratio 1 and counts it, as GRPOTrainer does."""
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
                versions=token_versions(choice.get("weight_versions"), len(ids)),
                finish_reason=choice.get("finish_reason"),
            )
        )
    return completions
