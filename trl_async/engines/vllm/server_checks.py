"""Before any training: what each vLLM server is and whether it was started the way the trainer needs.

``survey_servers`` asks every server (health, ``/server_info``, its endpoints, and with adapter-only LoRA sync a zero
adapter loaded and unloaded) and returns what they said; each check fails early with the flag to add. The pure
checks (``served_transport``, ``lora_blocker``) read a server's ``/server_info``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...weights.lora_merge import served_adapter, served_rank
from .adapters import AdapterPlan, ServedAdapters
from .client import VLLMServer, VLLMServerError
from .weight_push.recovery import identity


@dataclass
class ServerSurvey:
    """What the servers said before training."""

    servers: list[VLLMServer]  # a client each (requests retried within rollout_vllm_retry_s)
    transport: str  # the weight transport they share: 'nccl' or 'gloo'
    identities: list[dict]  # what each must still be to be taken back after a loss (recovery.identity)
    adapter_blocker: str | None = None  # adapter-only LoRA sync asked for: why the servers cannot serve it
    served: ServedAdapters | None = None  # adapter-only LoRA sync on: the servers' named adapters


def survey_servers(
    specs, startup_timeout_s: float, transport: str, trainer_device: str, adapters: AdapterPlan | None = None
) -> ServerSurvey:
    """Wait for every server in ``specs`` (``VLLMLaneSpec``s) to be healthy, check how each was started, and agree on
    the weight transport (``transport``: 'auto', 'nccl' or 'gloo'). With ``adapters``, whether the servers can serve
    them: a zero adapter of the real shapes is loaded and unloaded on each."""
    servers = [VLLMServer(s.url, s.request_timeout_s, s.retry_s) for s in specs]
    infos = [check_server(server, startup_timeout_s) for server in servers]
    survey = ServerSurvey(
        servers,
        served_transport(transport, infos, [s.url for s in servers], trainer_device),
        [identity(info) for info in infos],
    )
    if adapters is None:
        return survey
    rank = served_rank(adapters.merges, adapters.adapter_specs)
    leaves = {m.weight.split(".")[-2] for m in adapters.merges}
    reasons = [lora_blocker(info, s.url, rank, leaves) for info, s in zip(infos, servers, strict=True)]
    survey.adapter_blocker = next(filter(None, reasons), None)
    if survey.adapter_blocker is None:
        served = ServedAdapters(servers, adapters.keep, adapters.directory)
        zeros = {n: torch.zeros(shape, dtype=dtype) for n, (shape, dtype) in adapters.adapter_specs.items()}
        survey.adapter_blocker = served.probe(*served_adapter(adapters.merges, zeros))
        if survey.adapter_blocker is None:
            survey.served = served
        else:
            served.close()
    return survey


# vLLM's --max-lora-rank choices (vllm/config/lora.py) and the packed modules of the common decoder models (a
# --lora-target-modules entry covers its packed parent's children, and a child covers its parent)
LEGAL_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
PACKED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
          "up_proj": "gate_up_proj"}  # fmt: skip


def lora_blocker(info: dict, url: str, rank: int, leaves: set[str]) -> str | None:
    """Why the server described by ``info`` (``/server_info``) cannot serve an adapter of ``rank`` on the modules
    named ``leaves``, or None."""
    lora = (info.get("vllm_config") or {}).get("lora_config")
    flag = next((r for r in LEGAL_LORA_RANKS if r >= rank), rank)
    if not lora:
        return (
            f"vLLM server {url} was started without LoRA: add --enable-lora --max-lora-rank {flag} "
            f"(and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, which `trl-async-vllm-serve` sets)"
        )
    if lora.get("max_lora_rank", 0) < rank:
        return (
            f"vLLM server {url} serves LoRA rank {lora.get('max_lora_rank')} at most (--max-lora-rank) and these "
            f"adapters need {rank} (--max-lora-rank {flag})"
        )
    targets = set(lora.get("target_modules") or ())

    def covered(leaf: str) -> bool:  # itself, its packed parent, or a sibling packed with it (the same vLLM layer)
        parent = PACKED.get(leaf)
        return leaf in targets or (
            parent is not None and (parent in targets or any(PACKED.get(t) == parent for t in targets))
        )

    missing = sorted(leaf for leaf in leaves if targets and not covered(leaf))
    if missing:  # vLLM would load the adapter and silently not apply it to these modules
        return (
            f"vLLM server {url} applies LoRA only to {lora['target_modules']} (--lora-target-modules), not {missing}"
        )
    return None


TRANSPORTS = {"nccl": "nccl", "trl_async_gloo": "gloo"}  # a server's weight-transfer engine -> our transport


def served_transport(requested: str, infos: Sequence[dict], urls: Sequence[str], trainer_device: str) -> str:
    """The weight transport to use with servers described by ``infos`` (their ``/server_info``): the engine they were
    started with (``--weight-transfer-config``), which must be one the trainer can drive and the same on every
    server; ``requested`` ('auto', 'nccl' or 'gloo') must agree with it."""
    hint = "start it with `trl-async-vllm-serve` (--transport nccl on GPUs, gloo on CPUs) or `trl vllm-serve`"
    found = []
    for info, url in zip(infos, urls, strict=True):
        engine = ((info.get("vllm_config") or {}).get("weight_transfer_config") or {}).get("backend")
        if engine not in TRANSPORTS:
            raise VLLMServerError(
                f"vLLM server {url} has {'no' if engine is None else f'the {engine!r}'} weight-transfer engine, "
                'which the trainer cannot push weights to: add --weight-transfer-config \'{"backend": "nccl"}\' '
                f'(GPU servers) or \'{{"backend": "trl_async_gloo"}}\' (CPU servers); {hint}'
            )
        found.append(TRANSPORTS[engine])
    if len(set(found)) > 1:
        raise VLLMServerError(
            f"the vLLM servers were started with different weight transports {dict(zip(urls, found, strict=True))}: "
            "one push group needs one; restart them with the same --weight-transfer-config"
        )
    transport = found[0]
    if requested not in ("auto", transport):
        engine = "trl_async_gloo" if requested == "gloo" else "nccl"
        raise VLLMServerError(
            f"vLLM server {', '.join(urls)} has no '{engine}' weight-transfer engine (it was started with "
            f'{transport}): add --weight-transfer-config \'{{"backend": "{engine}"}}\', or set '
            f"rollout_vllm_weight_transport='auto'; {hint}"
        )
    if transport == "nccl" and not trainer_device.startswith("cuda"):
        raise VLLMServerError(
            f"vLLM server {urls[0]} receives weights over NCCL, which needs the trainer on a GPU, but it runs on "
            f"{trainer_device}: start CPU servers with `trl-async-vllm-serve --transport gloo`, or train on "
            "a GPU"
        )
    if transport == "nccl" and importlib.util.find_spec("vllm") is None:
        raise VLLMServerError(
            f"vLLM server {urls[0]} receives weights over NCCL, and the trainer's end of that transport is vLLM's own "
            "NCCL engine: install vLLM in the trainer's environment too, the version the servers run (`pip install "
            'vllm`, or `pip install -e ".[vllm]"` from a source checkout of trl_async)'
        )
    return transport


def check_server(server: VLLMServer, startup_timeout_s: float) -> dict:
    """Fail early, naming the flag to add, when a server is not started the way this backend needs. Returns its
    ``/server_info``."""
    server.wait_until_healthy(startup_timeout_s)
    hint = "start it with `trl-async-vllm-serve` or `trl vllm-serve` (or see the README for the flags)"
    try:
        info = server.server_info()
    except VLLMServerError as exc:
        raise VLLMServerError(
            f"vLLM server {server.url} has no development endpoints (/server_info): set VLLM_SERVER_DEV_MODE=1 when "
            f"starting it; {hint}. ({exc})"
        ) from None
    config = info.get("vllm_config", {})
    if config.get("model_config", {}).get("logprobs_mode") != "processed_logprobs":
        raise VLLMServerError(
            f"vLLM server {server.url} does not return the log-probs of the distribution it samples from: add "
            f"--logprobs-mode processed_logprobs (the off-policy correction needs mu); {hint}"
        )
    if not server.has_endpoint("/inference/v1/generate"):
        raise VLLMServerError(
            f"vLLM server {server.url} has no token-in/token-out endpoint /inference/v1/generate (which returns each "
            f"token's weight version): add --enable-scale-out; {hint}"
        )
    return info
