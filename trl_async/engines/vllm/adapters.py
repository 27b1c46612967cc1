"""Adapter-only LoRA sync to vLLM servers: each policy version is served as a named adapter.

The frozen base goes to every server once, through the weight push (``weight_push/``). Each version's adapters then
travel as a directory: ``served_adapter`` (weights/lora.py) folds every layer's adapters and scales into one
peft-format adapter, written as ``adapter_model.safetensors`` and ``adapter_config.json``, and every server loads it
with ``POST /v1/load_lora_adapter`` under a name of its own (``trl_async-<run>-v<version>``). A request names the
newest adapter when it starts and runs on it to its end, so every token of a request was sampled by that version,
whatever is loaded meanwhile: no pause, no in-flight switch, and the request's version is the adapter it named.

Why a directory and not memory: vLLM loads an adapter from ``lora_path`` on each worker, and may evict it from its
CPU cache (``--max-cpu-loras``) and load it again from there later, so the files must stay readable at that path
for as long as the adapter is registered. The directory (``rollout_vllm_adapter_dir``) must therefore be one the
servers read at the same path: a local directory for servers on this machine, a shared disk otherwise.

At most ``keep`` versions stay registered (``max_staleness + 2``): after each load, older versions that no running
request uses are unloaded (their names removed from the server; vLLM's own cache of adapter weights is bounded by
``--max-cpu-loras``) and their files deleted; one still in use is unloaded at a later publish.

Before training, a probe adapter with the real shapes and zero B factors is loaded and unloaded on every server
(``ServedAdapters.probe``): a server that cannot load these adapters (no runtime loading, a module it does not adapt)
then falls back to merged pushes, saying why, instead of failing at the first publish."""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.utils import logging

from ...weights.lora_merge import LoraMerge
from .client import VLLMServer
from .weight_push.fan_out import on_all

logger = logging.get_logger(__name__)


def adapter_config(rank: int, targets: Sequence[str]) -> dict:
    """The ``adapter_config.json`` of a ``served_adapter``: scale 1 (``lora_alpha == r``, no rslora), plain LoRA."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": rank,
        "use_rslora": False,
        "use_dora": False,
        "bias": "none",
        "modules_to_save": None,
        "fan_in_fan_out": False,
        "target_modules": sorted(targets),
        "lora_dropout": 0.0,
        "base_model_name_or_path": None,
    }


def write_adapter(directory: Path, tensors: dict[str, torch.Tensor], rank: int) -> Path:
    """Write one adapter (safetensors and config) into ``directory``, atomically: written beside it, then renamed, so
    a server never reads half a file."""
    from safetensors.torch import save_file

    targets = {name.split(".")[-3] for name in tensors}  # base_model.model.<...>.<leaf>.lora_A.weight
    partial = directory.with_name(directory.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # left by a write that failed
    partial.mkdir(parents=True)
    save_file(tensors, str(partial / "adapter_model.safetensors"))
    (partial / "adapter_config.json").write_text(json.dumps(adapter_config(rank, targets), indent=1))
    partial.rename(directory)
    return directory


def _error_of(call: Callable[[], object]) -> Exception | None:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the caller decides (a lost server's, or raised)
        return exc
    return None


@dataclass(frozen=True)
class AdapterPlan:
    """Adapter-only LoRA sync (engines/vllm/adapters.py): the frozen base's specs (pushed once), the published
    adapter tensors' specs, how they combine per layer, where the adapter files go, and how many versions stay."""

    base_specs: dict
    adapter_specs: dict
    merges: tuple[LoraMerge, ...]
    directory: str | None
    keep: int


class ServedAdapters:
    """The versions loaded on the servers, which requests use them, and which may go. Thread-safe: lanes'
    request threads acquire and release; the trainer's publish loads and prunes."""

    def __init__(self, servers: Sequence[VLLMServer], keep: int, directory: str | None = None) -> None:
        self.servers = list(servers)
        self.keep = keep
        self.run = uuid.uuid4().hex[:8]  # names of this run only: a server may outlive a trainer
        # absolute: vLLM resolves a relative path against the server's own directory (then tries the Hub)
        self.directory = Path(directory or tempfile.gettempdir()).resolve() / f"trl_async_adapters_{self.run}"
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self.current: int | None = None
        self.resident: list[int] = []  # loaded versions, oldest first
        self.held_back: list[int] = []  # past the bound at the last prune, but a request was still using them
        self._in_use: dict[int, int] = {}
        self._closed = False  # training ended: no request may name an adapter any more

    def name(self, version: int) -> str:
        return f"trl_async-{self.run}-v{version}"

    def publish(self, tensors: dict[str, torch.Tensor], rank: int, version: int, servers=None) -> list[bool]:
        """Write ``version``'s adapter, load it on every server (or on ``servers``: those attached or coming back),
        make it the one new requests use, and unload what is past the bound. Returns, per server, whether it loaded
        it: a server that failed to and no longer answers is lost (its lane is replaced and waits for it); one that
        answers and failed raises. Publishing a version again (a server came back while none worked) reuses its
        files."""
        targets = list(servers or self.servers)
        path = self.directory / f"v{version}"
        with self._lock:
            again = version in self.resident
        if not again:
            write_adapter(path, tensors, rank)
            with self._lock:
                self.resident.append(version)  # before the loads: if one fails, close() still unloads the others
        errors = on_all(targets, lambda s: _error_of(lambda: s.load_lora_adapter(self.name(version), str(path))))
        for server, error in zip(targets, errors, strict=True):
            if error is not None and server.healthy(timeout_s=2.0):
                raise error
        with self._lock:
            self.current = version
            self._ready.notify_all()
        loaded = [error is None for error in errors]
        if any(loaded):
            self.prune([s for s, ok in zip(targets, loaded, strict=True) if ok])
        return loaded

    def acquire(self, timeout_s: float | None = None) -> tuple[str, int]:
        """The newest version's adapter name and version, held until ``release``."""
        with self._lock:
            if not self._ready.wait_for(lambda: self.current is not None or self._closed, timeout_s):
                raise TimeoutError("no adapter was published to the vLLM servers")
            if self._closed:
                raise RuntimeError("the served adapters are closed: training ended")
            version = self.current
            self._in_use[version] = self._in_use.get(version, 0) + 1
            return self.name(version), version

    def release(self, version: int) -> None:
        with self._lock:
            self._in_use[version] -= 1
            if not self._in_use[version]:
                del self._in_use[version]
                self._ready.notify_all()

    def prune(self, servers=None) -> list[int]:
        """Unload (and delete) every version older than the newest ``keep`` that no request uses, on every server
        (or on ``servers``; one that came back after a loss never had the old ones); returns them."""
        with self._lock:
            old = self.resident[: max(0, len(self.resident) - self.keep)]
            gone = [v for v in old if v not in self._in_use]
            self.held_back = [v for v in old if v in self._in_use]
            self.resident = [v for v in self.resident if v not in gone]
        for version in gone:
            on_all(servers or self.servers, lambda s, v=version: s.unload_lora_adapter(self.name(v)))
            shutil.rmtree(self.directory / f"v{version}", ignore_errors=True)
        return gone

    def probe(self, tensors: dict[str, torch.Tensor], rank: int) -> str | None:
        """Load and unload ``tensors`` (a served adapter) on every server; why one failed, or None."""
        path = write_adapter(self.directory / "probe", tensors, rank)
        try:
            for server in self.servers:
                try:
                    server.load_lora_adapter(self.name(-1), str(path))
                    server.unload_lora_adapter(self.name(-1))
                except Exception as exc:  # noqa: BLE001 - reported as the reason for merged pushes
                    return (
                        f"vLLM server {server.url} could not load a LoRA adapter of these shapes: {exc} (a 404 "
                        "means no runtime LoRA loading: start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, as "
                        "`trl-async-vllm-serve` does)"
                    )
            return None
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def close(self, drain_s: float = 30.0) -> None:
        """Unload this run's adapters (best effort: a server may be gone) and delete their files, once none of our
        requests can still need them. vLLM loads an adapter from its files when a request naming it is scheduled,
        and its engine dies if they are gone (LoRAAdapterNotFoundError or FileNotFoundError, both seen in tests). So,
        in order: no adapter is handed out any more; the lanes' request threads let go of theirs (a stopped lane
        abandons its requests at once, but one may be about to send); then each server runs none (``_drained``).
        Past ``drain_s`` (a server shared with another client, a thread stuck) the files are kept, with a warning
        naming the directory."""
        deadline = time.monotonic() + drain_s
        with self._lock:
            self._closed = True
            self._ready.notify_all()
            let_go = self._ready.wait_for(lambda: not self._in_use, max(0.0, deadline - time.monotonic()))
        # a thread that held on past the deadline may yet send its request: its files are kept, as for a busy server
        busy = [s.url for s in self.servers if not let_go or not _drained(s, deadline)]
        for version in list(self.resident):
            for server in self.servers:
                try:
                    server.unload_lora_adapter(self.name(version), retry=False, timeout_s=5.0)
                except Exception:  # noqa: BLE001 - cleanup of a server that may have stopped
                    pass
        self.resident = []
        if busy:
            why = f"vLLM servers {busy} still run requests" if let_go else "a request thread still holds an adapter"
            logger.warning(
                "%s %.0fs after training ended: this run's adapter files are left in %s for them (delete it "
                "when they are done)",
                why,
                drain_s,
                self.directory,
            )
            return
        shutil.rmtree(self.directory, ignore_errors=True)


def _drained(server: VLLMServer, deadline: float, settled_reads: int = 2) -> bool:
    """Whether ``server`` runs no request (or is gone) by ``deadline``. Its gauges change only when its engine steps:
    a request that has just arrived, or one being cancelled, is not in them yet. So each read follows a one-token
    request of the base model that makes it step, and it counts as drained after ``settled_reads`` such reads in a
    row show nothing running or waiting."""
    nudge = {"token_ids": [1, 2, 3], "sampling_params": {"n": 1, "max_tokens": 1, "temperature": 0.0}}
    settled = 0
    while True:
        try:
            server.request("POST", "/inference/v1/generate", nudge, timeout_s=10.0, retry=False)
            settled = settled + 1 if server.requests_in_flight() == 0 else 0
        except Exception:  # noqa: BLE001 - a server that is gone runs nothing of ours to protect; a busy or paused
            # one that answers /health may (the nudge timed out, or was refused): not drained
            if not server.healthy(timeout_s=2.0):
                return True
            settled = 0
        if settled >= settled_reads:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
