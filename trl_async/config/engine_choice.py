"""Which engine generates, and where: GRPOConfig's own vLLM fields mapped onto the rollout backend, and the device the
transformers workers use. Pure functions, called by the config's resolution step and the trainer's set-up.

TRL's switches carry over unchanged:

    use_vllm=False                         -> transformers workers (rollout_backend='transformers')
    use_vllm=True, vllm_mode='server'      -> the running vLLM servers at vllm_server_base_url (or host:port), or
                                              rollout_vllm_urls
    use_vllm=True, vllm_mode='colocate'    -> a vLLM server the trainer starts on its own GPU and stops with training
                                              (engines/vllm/colocate.py)
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineChoice:
    backend: str  # "transformers" or "vllm"
    colocate: bool  # vLLM: the trainer starts and owns the server


def rollout_engine(
    rollout_backend: str | None,
    use_vllm: bool,
    vllm_mode: str,
    rollout_vllm_urls,
    vllm_enable_sleep_mode: bool = False,
) -> EngineChoice:
    """The engine GRPOConfig's vLLM fields and ``rollout_backend`` (None: follow ``use_vllm``) ask for. Raises
    ``ValueError`` naming the fields when they disagree."""
    if not use_vllm:
        return EngineChoice(rollout_backend or "transformers", colocate=False)
    if rollout_backend == "transformers":
        raise ValueError(
            "AsyncGRPOConfig.rollout_backend='transformers' contradicts use_vllm=True: leave rollout_backend unset "
            "(use_vllm=True selects vLLM) or set use_vllm=False for the transformers workers"
        )
    if vllm_mode not in ("server", "colocate"):
        raise ValueError(f"GRPOConfig.vllm_mode={vllm_mode!r} is invalid: choose 'server' or 'colocate'")
    if vllm_mode == "colocate":
        if rollout_vllm_urls:
            raise ValueError(
                f"AsyncGRPOConfig.rollout_vllm_urls={rollout_vllm_urls!r} names running servers, but "
                "vllm_mode='colocate' starts its own: set vllm_mode='server' to use those servers, or drop "
                "rollout_vllm_urls"
            )
        if vllm_enable_sleep_mode:
            raise ValueError(
                "GRPOConfig.vllm_enable_sleep_mode=True puts the colocated vLLM server to sleep while the trainer "
                "steps, which is exactly when asynchronous generation runs: set it to False (size the server with "
                "vllm_gpu_memory_utilization instead)"
            )
    return EngineChoice("vllm", colocate=vllm_mode == "colocate")


@dataclass(frozen=True)
class DeviceChoice:
    device: str
    reason: str


def rollout_device_for(
    requested: str | None, trainer_device: str, visible_gpus: int, trainer_gpus: set[int]
) -> DeviceChoice:
    """Where the transformers workers generate. ``requested`` (``rollout_device``) wins; unset, a CPU trainer's
    workers use the CPU and a CUDA trainer's use a GPU: the first visible one no trainer rank on this machine uses
    (``trainer_gpus``, indices among the ``visible_gpus``), else the trainer's own."""
    if requested is not None:
        return DeviceChoice(requested, "rollout_device")
    if not trainer_device.startswith("cuda"):
        return DeviceChoice("cpu", f"the trainer runs on {trainer_device}")
    free = [i for i in range(visible_gpus) if i not in trainer_gpus]
    if free:
        return DeviceChoice(f"cuda:{free[0]}", "a GPU no trainer rank uses")
    own = trainer_device if ":" in trainer_device else "cuda:0"
    return DeviceChoice(
        own, f"every visible GPU trains, so they share the trainer's ({own}); set rollout_device to choose another"
    )


def physical_gpu(cuda_visible_devices: str | None, index: int) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` entry a process sees as ``cuda:index`` (for a child process that must use the
    same GPU)."""
    if not cuda_visible_devices:
        return str(index)
    entries = [e.strip() for e in cuda_visible_devices.split(",") if e.strip()]
    if index >= len(entries):
        raise ValueError(f"cuda:{index} is not among CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}")
    return entries[index]


def settle_rollout_device(settings, trainer_device) -> None:
    """Fills in ``settings.rollout_device`` for the transformers workers (``rollout_device_for``) and says which
    device was chosen and why; ranks on this machine are taken to use ``cuda:0`` to ``cuda:LOCAL_WORLD_SIZE-1``."""
    if settings.rollout_backend != "transformers" or settings.rollout_device is not None:
        return
    import torch
    from transformers.utils import logging

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    own = trainer_device.index if trainer_device.type == "cuda" and trainer_device.index is not None else 0
    visible = torch.cuda.device_count() if trainer_device.type == "cuda" else 0
    ranks = {own} if local == 1 else set(range(local)) | {own}  # ranks here train on cuda:0 .. cuda:local-1
    choice = rollout_device_for(None, str(trainer_device), visible, ranks)
    settings.rollout_device = choice.device
    if trainer_device.type == "cuda":
        logging.get_logger(__name__).warning("rollout workers generate on %s: %s", choice.device, choice.reason)
