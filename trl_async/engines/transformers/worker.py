"""Rollout worker: a background OS process with its own copy of the policy that turns ``RolloutTask``s into
``RolloutGroup``s with ``model.generate``.

Every completion token carries the policy version whose forward pass produced its logits and its log-probability under
the distribution actually sampled from (GenerationConfig's processors and warpers applied: temperature, top-k, top-p,
min-p, repetition penalty). The worker knows nothing about rewards, datasets or the trainer: it only imports the
records and the weight transport.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...records import PER_TOKEN_FIELDS, LaneFailed, RolloutGroup, RolloutTask, WeightsAdopted, WorkerReady
from ...weights.lora_merge import LoraMerge, merge_adapters
from ...weights.shared_memory import SharedMemoryWeights, weights_digest
from .decoding import NEUTRAL_SAMPLING, DecodeStepHook, left_padded, split_sampling_warpers


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to build its policy copy and generate like GRPOTrainer would."""

    worker_id: int
    model_class: type
    model_config: Any  # transformers PretrainedConfig
    dtype: torch.dtype
    device: str
    generation_config: Any  # transformers GenerationConfig (GRPOTrainer's own)
    num_generations: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    weight_update: str  # "batch" | "decode_step"
    torch_threads: int
    nice: int
    seed: int
    verify_weights: bool
    cpu_affinity: tuple[int, ...] | None = None  # the cores it runs on (rollout_cpu_affinity), else inherited
    # adapter-only LoRA sync (weights/lora.py): how to rebuild each adapted weight from the frozen base and the
    # factors of a version; empty when the workers receive full weights
    lora_merges: tuple[LoraMerge, ...] = ()
    # continuous batching (continuous.py): at most ``slots`` rows decode at once, each within ``max_context`` tokens;
    # 0 slots: static batches, one ``generate`` call per chunk
    slots: int = 0
    max_context: int = 0
    paged_settings: dict | None = None  # ContinuousBatchingConfig keywords: transformers' paged engine on any device


def generate_groups(
    model: torch.nn.Module,
    tasks: Sequence[RolloutTask],
    generation_config: Any,
    num_generations: int,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    current_version: Callable[[], int],
    between_steps: Callable[[], None] | None = None,
    lane_id: int = 0,
) -> list[RolloutGroup]:
    """Generate ``num_generations`` completions for each task in one ``generate`` call (or, for a later turn of
    multi-turn episodes, one completion per context of the task, at most its ``max_new_tokens``).

    Completions are cut after their first EOS (kept), as GRPOTrainer does. ``logprobs`` are behaviour log-probs (mu)
    taken from the final processed scores, i.e. from the distribution the token was sampled from, one decode step at
    a time (see ``DecodeStepHook``).
    """
    from transformers import LogitsProcessorList

    device = next(model.parameters()).device
    per_task = [[list(c) for c in task.contexts] or [list(task.prompt_ids)] * num_generations for task in tasks]
    rows = [r for task_rows in per_task for r in task_rows]
    budgets = [task.max_new_tokens or generation_config.max_new_tokens for task in tasks]
    row_budget = [b for b, task_rows in zip(budgets, per_task, strict=True) for _ in task_rows]
    input_ids, attention_mask = left_padded(rows, pad_token_id)
    width = input_ids.size(1)
    image_inputs = batched_images(tasks, [len(task_rows) for task_rows in per_task], width, device)

    # beam search is not a sampling policy: its tokens have no behaviour log-prob (mu is NaN: they train uncorrected,
    # as with GRPOTrainer's own generation), and the weights stay those of the call's start (beams are reordered
    # between steps, so no per-step record or in-flight update applies)
    beams = getattr(generation_config, "num_beams", 1) or 1
    config, warpers = split_sampling_warpers(generation_config, device) if beams == 1 else (generation_config, None)
    config = copy.deepcopy(config)
    if all(b is not None for b in budgets):
        config.max_new_tokens = max(budgets)  # each row is cut to its own budget below
    config.output_scores = False  # full-vocabulary scores per step: T x N x V floats (GBs at a 152k vocabulary)
    config.return_dict_in_generate = False
    padding = (attention_mask == 0).to(device)
    hook = DecodeStepHook(warpers, current_version, between_steps, padding) if beams == 1 else None
    version_at_start = current_version()
    started_at, start = time.time(), time.perf_counter()
    with torch.no_grad():
        sequences = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            generation_config=config,
            logits_processor=LogitsProcessorList([hook] if hook is not None else []),
            **image_inputs,
        )
        if hook is not None:
            hook.take_sampled(sequences[:, -1])
    elapsed = time.perf_counter() - start
    tokens_NT = sequences[:, width:].cpu()
    if hook is None:
        step_versions = [version_at_start] * tokens_NT.size(1)
        logprobs_NT = torch.full(tokens_NT.shape, math.nan)
    else:
        step_versions = hook.step_versions
        if not (len(hook.step_versions) == len(hook.step_logprobs) == tokens_NT.size(1)):
            raise RuntimeError(
                f"decode hook saw {len(hook.step_versions)} steps ({len(hook.step_logprobs)} log-probs) for "
                f"{tokens_NT.size(1)} tokens"
            )
        logprobs_NT = torch.stack(hook.step_logprobs, dim=1) if hook.step_logprobs else torch.zeros(len(rows), 0)

    eos = torch.tensor(list(eos_token_ids))
    completions, logps, versions = [], [], []
    for i in range(len(rows)):
        toks = tokens_NT[i].tolist()
        is_eos = torch.isin(tokens_NT[i], eos).nonzero()
        length = int(is_eos[0]) + 1 if len(is_eos) else len(toks)
        if row_budget[i] is not None:
            length = min(length, row_budget[i])
        completions.append(tuple(toks[:length]))
        logps.append(tuple(logprobs_NT[i, :length].tolist()))
        versions.append(tuple(step_versions[:length]))

    groups, start = [], 0
    for task, task_rows in zip(tasks, per_task, strict=True):
        span = slice(start, start + len(task_rows))
        start += len(task_rows)
        groups.append(
            RolloutGroup(
                group_id=task.group_id,
                prompt_index=task.prompt_index,
                prompt_ids=task.prompt_ids,
                completion_ids=tuple(completions[span]),
                logprobs=tuple(logps[span]),
                versions=tuple(versions[span]),
                lane_id=lane_id,
                generate_s=elapsed,
                generate_started_at=started_at,
                rows=task.rows,
            )
        )
    return groups


def batched_images(tasks: Sequence[RolloutTask], rows_per_task: Sequence[int], width: int, device) -> dict:
    """The image inputs of a batch whose rows are each task's prompt ``rows_per_task`` times, left-padded to
    ``width``, as the processor's own batched call gives them for those rows: each image field of the tasks'
    ``images`` (one entry per image along the first dimension) repeated per row, in row order, as a vision-language
    model's forward matches images to the image tokens of its rows in order; each per-token field
    (``PER_TOKEN_FIELDS``) one row per row, left-padded with zeros (all zeros for a task without it). LLaVA-NeXT's
    tiles (``pixel_values`` of one entry per image and tile, beside ``image_sizes``) are padded with zeros to the
    batch's most, as its processor pads a batch; the model reads each image's real count from ``image_sizes``."""
    batched = {}
    for key in sorted({key for task in tasks for key in task.images}):
        if key in PER_TOKEN_FIELDS:
            rows = [per_token_row(task, key, width) for task, n in zip(tasks, rows_per_task, strict=True)
                    for _ in range(n)]  # fmt: skip
            batched[key] = torch.stack(rows).to(device)
            continue
        parts = [
            torch.as_tensor(task.images[key])
            for task, n in zip(tasks, rows_per_task, strict=True)
            if key in task.images
            for _ in range(n)
        ]
        tiled = key == "pixel_values" and any("image_sizes" in task.images for task in tasks)
        batched[key] = torch.cat(padded_tiles(key, parts) if tiled else same_shape(key, parts)).to(device)
    return batched


def per_token_row(task: RolloutTask, key: str, width: int) -> torch.Tensor:
    if task.contexts:
        raise ValueError(f"{key}: a per-token image field cannot follow a later turn's context")
    if key not in task.images:
        return torch.zeros(width, dtype=torch.long)
    row = torch.as_tensor(task.images[key]).reshape(-1)
    if row.numel() != len(task.prompt_ids):
        raise ValueError(f"{key} has {row.numel()} entries for a prompt of {len(task.prompt_ids)} tokens")
    return torch.nn.functional.pad(row, (width - row.numel(), 0))


def same_shape(key: str, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    if len({tuple(p.shape[1:]) for p in parts}) > 1:
        raise ValueError(
            f"the prompts of one batch have {key} of different shapes ({sorted({tuple(p.shape) for p in parts})}):"
            " a processor that pads its image inputs per call is not supported on the rollout workers"
        )
    return parts


def padded_tiles(key: str, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Tiled images (``num_images x tiles x channels x height x width``) padded with zeros to the most tiles; any
    other difference of shape is a ``ValueError``."""
    if any(p.dim() != 5 for p in parts) or len({tuple(p.shape[2:]) for p in parts}) > 1:
        return same_shape(key, parts)
    most = max(p.size(1) for p in parts)
    return [torch.nn.functional.pad(p, (0, 0, 0, 0, 0, 0, 0, most - p.size(1))) for p in parts]


def build_policy_copy(spec: WorkerSpec) -> torch.nn.Module:
    config = copy.deepcopy(spec.model_config)
    config.use_cache = True  # the trainer's config may have it off (training); generation needs the KV cache
    with _skipped_init():  # every parameter is overwritten by the published weights (worker_main checks it)
        model = spec.model_class(config)
    model.tie_weights()  # skipping the initialisation also skips tying (transformers 5): tied weights stay one tensor
    # generate() fills unset fields from the model's generation_config, which a model built from a config derives
    # from config.use_cache: without this, every decode step re-runs the whole sequence (many times slower, growing
    # with length)
    model.generation_config.use_cache = True
    for name in NEUTRAL_SAMPLING:  # sampling comes from the trainer's config alone; nothing refilled behind the hook
        setattr(model.generation_config, name, None)
    model = model.to(device=spec.device).eval()
    # parameters in the rollout dtype; buffers (RoPE frequencies) stay as built, as the trainer keeps them: rounding
    # inv_freq to bf16 shifts every rotary angle by up to ~0.2% of itself
    for param in model.parameters():
        param.data = param.data.to(spec.dtype)
    return model


def _skipped_init():
    """Build without random initialisation: 1.4 s of one core for SmolLM2-135M, on the way to a worker's first
    generation (and every restart's). transformers' ``no_init_weights`` where it exists, else a full build."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers: initialise (correct, only slower)
        return contextlib.nullcontext()
    return no_init_weights()


def unpublished_parameters(model: torch.nn.Module, published: set[str]) -> list[str]:
    """Parameters the workers' weights do not cover: built without initialisation, they would hold whatever memory
    they were given, so a worker refuses to generate with them."""
    return [name for name, _ in model.named_parameters() if name not in published]


HEARTBEAT_INTERVAL_S = 0.5


def _beat(heartbeat) -> None:
    while True:  # a stopped (SIGSTOP) or wedged process stops beating; the trainer notices
        heartbeat.value = time.time()
        time.sleep(HEARTBEAT_INTERVAL_S)


def worker_main(
    spec: WorkerSpec, weights: SharedMemoryWeights, tasks, results, heartbeat, base: SharedMemoryWeights | None = None
) -> None:
    """Process entry point. ``tasks``/``results`` are this worker's own pipe ends (a killed worker cannot corrupt
    another worker's channel); ``heartbeat`` is a shared double it refreshes every ``HEARTBEAT_INTERVAL_S``. Stops on
    a ``None`` task; reports any exception as ``LaneFailed`` and exits. With adapter-only LoRA sync, ``base`` holds
    the frozen weights (published once) and ``weights`` each version's adapter factors, which the worker merges."""
    try:
        if spec.cpu_affinity:  # before any thread starts: threads inherit the calling thread's cores (and nice)
            os.sched_setaffinity(0, spec.cpu_affinity)
        if spec.nice:
            os.nice(spec.nice)
        threading.Thread(target=_beat, args=(heartbeat,), name="trl_async-heartbeat", daemon=True).start()
        torch.set_num_threads(spec.torch_threads)
        torch.manual_seed(spec.seed)
        model = build_policy_copy(spec)
        named = dict(model.named_parameters())
        named.update(model.named_buffers())
        missing = unpublished_parameters(model, set(weights.tensors) | set(base.tensors if base is not None else ()))
        if missing:
            raise RuntimeError(f"the published weights do not cover these parameters of the rollout model: {missing}")
        while weights.version < 0:  # the trainer publishes right after starting the workers
            time.sleep(0.01)
        merge, base_digest = None, None
        if base is None:
            params = {name: named[name] for name in weights.tensors}  # KeyError names a mismatch early
        else:  # the frozen base once into the model, then per version the factors into a private copy, merged
            if base.pull_into({name: named[name] for name in base.tensors}, -1) is None:
                raise RuntimeError("adapter-only LoRA sync: the frozen base weights were not published first")
            if spec.verify_weights:  # the base as received, before any merge writes into the adapted weights
                base_digest = weights_digest((name, named[name]) for name in base.tensors)
            params = {name: torch.empty_like(t) for name, t in weights.tensors.items()}
            targets = {m.weight: named[m.weight] for m in spec.lora_merges}
            frozen = base.tensors  # shared, only read: the unmerged base of every adapted weight

            def merge() -> None:
                merge_adapters(spec.lora_merges, frozen, params, targets)

        state = {"version": -1}

        def adopt() -> None:
            new_version = weights.pull_into(params, state["version"])
            if new_version is not None:
                if merge is not None:
                    merge()
                state["version"] = new_version
                digest = weights_digest(params.items(), base_digest) if spec.verify_weights else None
                results.send(WeightsAdopted(spec.worker_id, new_version, digest))

        adopt()
        cores = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else ()
        results.send(WorkerReady(spec.worker_id, os.getpid(), cores, torch.get_num_threads()))
        if spec.slots:
            serve_continuously(model, spec, weights, tasks, results, adopt, lambda: state["version"])
            return
        in_flight = adopt if spec.weight_update == "decode_step" else None
        while True:
            chunk = tasks.recv()  # admitted groups for one generate call, or None to stop
            if chunk is None:
                return
            adopt()
            for group in generate_groups(
                model,
                chunk,
                spec.generation_config,
                spec.num_generations,
                spec.eos_token_ids,
                spec.pad_token_id,
                current_version=lambda: state["version"],
                between_steps=in_flight,
                lane_id=spec.worker_id,
            ):
                results.send(group)
    except (EOFError, BrokenPipeError):
        return  # the trainer closed our pipe: it is shutting down or has given up on us
    except BaseException:  # noqa: BLE001 - reported to the trainer, which raises it
        with contextlib.suppress(Exception):
            results.send(LaneFailed(spec.worker_id, traceback.format_exc()))


def serve_continuously(model, spec: WorkerSpec, weights, tasks, results, adopt, version: Callable[[], int]) -> None:
    """The worker's loop with continuous batching: tasks join as they arrive, groups leave as they finish, and new
    weights are adopted between two decode steps (``weight_update="decode_step"``) or when no row is decoding
    (``"batch"``). A task admitted at a version the worker does not hold yet waits for it, so no group starts on
    weights older than its admission (as a static batch adopts before its ``generate`` call). Returns on a ``None``
    task."""
    from .slots import continuous_engine

    engine = continuous_engine(spec.device, spec.model_config, spec.paged_settings)
    settings = {"settings": spec.paged_settings} if spec.paged_settings else {}
    rows = engine(model, spec.generation_config, spec.num_generations, spec.eos_token_ids, spec.slots,
                  spec.max_context, version, lane_id=spec.worker_id, pad_token_id=spec.pad_token_id,
                  **settings)  # fmt: skip
    held: list[RolloutTask] = []  # received, admitted at a version newer than the one held
    try:
        while True:
            wait_s = 0.0 if rows.busy or held else 0.05
            while tasks.poll(wait_s):
                chunk = tasks.recv()
                if chunk is None:
                    return
                held.extend(chunk)
                wait_s = 0.0
            if weights.version > version() and (spec.weight_update == "decode_step" or not rows.busy):
                rows.swap(adopt)
            startable = [t for t in held if t.admitted_at_version <= version()]
            if startable:
                held = [t for t in held if t.admitted_at_version > version()]
                rows.submit(startable)
            for group in rows.finished(timeout_s=0.02 if rows.busy else 0.0):
                results.send(group)
            if held and not rows.busy and not startable:
                time.sleep(0.005)  # waiting for weights to be published
    finally:
        rows.close()
