"""The rollout pool of one ``AsyncGRPOTrainer``, built from ``PoolInputs`` (what the trainer hands over, resolved
once: nothing here reads the trainer): the engine (worker processes or vLLM servers), the episode or ``rollout_func``
runner, and the closures the pool's background threads call to tokenize prompts and score groups (each thread with
its own tokenizer copies). Called once per ``train`` on the main process; what it starts for the pool (the tool
runner, the scorers) the pool closes with itself."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from accelerate.utils import is_peft_model
from datasets import IterableDataset
from transformers.utils import logging

from ..correction.sampling import SamplingSettings, settings_of
from ..engines.transformers.continuous import continuous_slots
from ..engines.transformers.worker import WorkerSpec
from ..engines.transformers.worker_process import ProcessBackend
from ..hardware.precision import device_precision
from ..rollout.environments import EnvironmentPool
from ..rollout.episodes import EpisodeRunner
from ..rollout.filtering import SignalFilter
from ..rollout.pool import PoolSettings, RolloutPool
from ..rollout.prompts import PromptStream, StreamedRows
from ..rollout.rollout_func import RolloutFuncRunner
from ..rollout.scoring import RewardScorer, group_scorer
from ..rollout.tool_calls import ToolRunner, split_tools
from ..weights.lora import adapter_tensors
from ..weights.policy import policy_specs, unsharded_class
from .rendering import make_tokenize_row

logger = logging.get_logger(__name__)
CONTEXT_ESTIMATE = 512  # prompt tokens a continuous-batching worker's KV cache is sized for, per row (rows share it)


@dataclass(frozen=True)
class SamplingInputs:
    """How completions are sampled: GRPOTrainer's settings, as the engines apply them."""

    backend: str  # "transformers" or "vllm"
    num_generations: int
    temperature: float
    top_p: float
    top_k: int | None
    min_p: float | None
    repetition_penalty: float
    max_completion_length: int
    eos_token_ids: tuple[int, ...]
    generation_kwargs: dict
    generation_config: Any  # transformers' GenerationConfig: the workers' (GRPOTrainer's, with generation_kwargs)


@dataclass(frozen=True)
class PoolInputs:
    """Everything the pool is built from, handed over by the trainer (trainer_view.py builds it)."""

    args: Any  # the GRPOConfig
    async_args: Any  # AsyncFields, resolved
    geometry: Any  # checks.PoolGeometry
    sampling: SamplingInputs
    model: Any  # the unwrapped policy (its weights are published from it)
    device: Any  # the trainer's torch device
    start_version: int
    core_split: Any  # hardware.cores.CoreSplit, or None
    adapter_sync: bool  # LoRA: workers get the base once, then the adapters
    colocated_gpus: list | None  # vllm_mode='colocate': each server's GPUs
    # prompts and their rendering
    train_dataset: Any
    shuffle_dataset: bool
    processing_class: Any
    tokenizer: Any  # GRPOTrainer's tokenizer (the processing class's, for a processor)
    chat_template: str | None
    chat_template_kwargs: dict
    # multi-turn and rollout_func
    tools: list
    environment_factories: Any
    standalone_tools: list
    env_tools: dict
    multi_environment: bool
    max_tool_calling_iterations: int | None
    rollout_func: Callable | None
    rollout_func_view: Callable  # (generate, tokenizer) -> the trainer a rollout_func receives (TRL's contract)
    event_loop: Any  # GRPOTrainer's async loop, if a reward or tool is async
    # scoring
    reward_funcs: list  # as scored on the main process (sharded reward models unsharded)
    reward_processing_classes: list
    reward_func_names: list[str]
    reward_weights: Any
    trainer_state: Callable[[], Any]


def start_pool(p: PoolInputs, progress: dict | None = None) -> RolloutPool:
    """``progress``: the checkpoint's record of completed prompts (``PromptProgress`` state), when resuming."""
    args, a, geometry, start_version = p.args, p.async_args, p.geometry, p.start_version
    settings = PoolSettings(
        groups_per_batch=geometry.groups_per_batch,
        steps_per_batch=geometry.steps_per_batch,
        max_staleness=a.max_staleness,
        queue_size=geometry.queue_size,
        timeout_s=a.rollout_timeout_s,
        start_version=start_version,
        num_generations=p.sampling.num_generations,
        groups_per_call=geometry.groups_per_call,
        max_restarts=a.rollout_max_restarts,
        heartbeat_timeout_s=a.rollout_heartbeat_timeout_s,
        scoring_threads=a.rollout_scoring_threads,
        consumption_window=a.rollout_consumption_window,
    )
    episodes, closers = None, []
    if p.tools or p.environment_factories:
        tool_runner = ToolRunner(a.rollout_tool_threads, a.rollout_tool_timeout_s, p.event_loop)
        closers.append(tool_runner.close)
        episodes = episode_runner_factory(p, tool_runner)
    elif p.rollout_func is not None:
        episodes = rollout_func_runner_factory(p)
    data = p.train_dataset
    streamed = None  # an iterable dataset: read in GRPOTrainer's order, rows kept until trained on
    if isinstance(data, IterableDataset):
        streamed = StreamedRows(data, geometry.groups_per_batch, p.shuffle_dataset, args.seed)
    backend = None
    try:
        prompts = PromptStream(
            len(data) if streamed is None else streamed,
            geometry.groups_per_batch,
            shuffle=p.shuffle_dataset,
            seed=args.seed,
            skip_batches=start_version // geometry.steps_per_batch,  # a checkpoint without PromptProgress
            progress=progress,
        )
        closers.append(prompts.close)
        backend = vllm_backend(p) if a.rollout_backend == "vllm" else process_backend(p)
        read_row = (data if streamed is None else streamed).__getitem__  # once per admitted group (the pool keeps it)
        keep = None
        if a.dynamic_sampling:  # groups without signal never take a batch slot
            keep = SignalFilter(
                p.reward_weights,
                args.multi_objective_aggregation,
                p.reward_func_names,
                geometry.groups_per_batch,
                a.dynamic_sampling_limit,
            ).keep
        score_group, scorers = make_score_group(p)
        closers.append(lambda: [scorer.close() for scorer in scorers])
        return RolloutPool(
            backend, settings, prompts, read_row, make_tokenize_row(p), score_group, episodes, keep, closers
        ).start()
    except BaseException:
        if backend is not None:
            backend.close()  # colocated vLLM servers must not outlive a pool that never started
        for close in closers:
            close()
        raise


def episode_runner_factory(p: PoolInputs, tool_runner: ToolRunner):
    """Multi-turn episodes with ``tools`` (rollout/episodes.py): parsed and rendered with GRPOTrainer's own response
    parser, chat template and tool-suffix rendering, on copies made here (the runner's thread owns them)."""
    kwargs = dict(
        tokenizer=copy.deepcopy(p.tokenizer),
        chat_template=p.chat_template,
        chat_template_kwargs=dict(p.chat_template_kwargs),
        tools=list(p.tools),
        max_rounds=p.max_tool_calling_iterations,
        max_completion_length=p.sampling.max_completion_length,
        max_model_len=getattr(p.model.config, "max_position_embeddings", None),
        tool_runner=tool_runner,
        tool_dicts=split_tools(p.tools),
        num_generations=p.sampling.num_generations,
    )
    if p.environment_factories is not None:  # each episode: its own instance, reset, methods as tools
        kwargs.update(
            environments=EnvironmentPool(dict(p.environment_factories)),
            standalone_tools=list(p.standalone_tools),
            schema_tools=dict(p.env_tools),
            multi_environment=p.multi_environment,
        )
    return lambda **callbacks: EpisodeRunner(**kwargs, **callbacks)


def rollout_func_runner_factory(p: PoolInputs):
    """``rollout_func`` runs per admitted group on a background thread (rollout/rollout_func.py)."""
    kwargs = dict(
        rollout_func=p.rollout_func,
        trainer_view=p.rollout_func_view,
        version=lambda: p.trainer_state().global_step,
        tokenizer=copy.deepcopy(p.processing_class),
        num_generations=p.sampling.num_generations,
        timeout_s=p.async_args.rollout_timeout_s,
        max_model_len=getattr(p.model.config, "max_position_embeddings", None),
        max_new_tokens=p.sampling.max_completion_length,
    )
    return lambda **callbacks: RolloutFuncRunner(**kwargs, **callbacks)


def process_backend(p: PoolInputs) -> ProcessBackend:
    args, a, model, sampling = p.args, p.async_args, p.model, p.sampling
    base = model.get_base_model() if is_peft_model(model) else model
    fp16 = args.fp16 and p.device.type != "cpu"  # accelerate autocasts only bf16 on a CPU
    split = p.core_split  # rollout_cpu_affinity: each worker's cores
    merges = adapter_tensors(model)[2] if p.adapter_sync else ()  # how workers rebuild the adapted weights
    continuous = args.use_transformers_continuous_batching  # GRPOConfig's (use_transformers_paged sets it too)
    slots = continuous_slots(continuous, p.geometry.groups_per_call, sampling.num_generations)
    max_context = min(getattr(base.config, "max_position_embeddings", None) or 2**20,
                      CONTEXT_ESTIMATE + (sampling.generation_config.max_new_tokens or 0))  # fmt: skip
    specs = [
        WorkerSpec(
            worker_id=i,
            model_class=unsharded_class(base),
            model_config=base.config,
            dtype=a.resolved_rollout_dtype(
                next(base.parameters()).dtype, args.bf16, fp16, device_precision(a.rollout_device)
            ),
            device=a.rollout_device,
            generation_config=sampling.generation_config,
            num_generations=sampling.num_generations,
            eos_token_ids=sampling.eos_token_ids,
            pad_token_id=p.tokenizer.pad_token_id,
            weight_update=a.rollout_weight_update,  # resolved (config/defaults.py)
            slots=slots,
            max_context=max_context,
            paged_settings=args.transformers_continuous_batching_config if continuous else None,
            torch_threads=(a.rollout_torch_threads or len(split.workers[i])) if split else a.resolved_rollout_threads,
            nice=a.resolved_rollout_nice,
            seed=args.seed + 1 + i + 100_003 * p.start_version,
            verify_weights=a.rollout_verify_weights,
            cpu_affinity=split.workers[i] if split else None,
            lora_merges=merges,
        )
        for i in range(a.num_rollout_workers)
    ]
    if p.adapter_sync:  # the frozen rest once, the adapters every version (weights/lora.py)
        adapters, frozen = policy_specs(model, part="adapters"), policy_specs(model, part="frozen")
        return ProcessBackend(specs, adapters, p.geometry.groups_per_call, base_specs=frozen)
    return ProcessBackend(specs, policy_specs(model), p.geometry.groups_per_call)


def vllm_urls(p: PoolInputs) -> list[str]:
    args = p.args
    if p.async_args.rollout_vllm_urls:
        return list(p.async_args.rollout_vllm_urls)
    if args.vllm_server_base_url:
        return [args.vllm_server_base_url]
    return [f"http://{args.vllm_server_host}:{args.vllm_server_port}"]


def start_colocated_servers(p: PoolInputs, servers: list) -> None:
    """vllm_mode='colocate': start a vLLM server on each of the trainer's GPU groups, appended to ``servers`` as it
    starts (the caller stops them if anything fails), and wait for them."""
    from ..engines.vllm.colocate import ColocatedServer, colocated_flags, wait_for

    args, a = p.args, p.async_args
    base = p.model.get_base_model() if is_peft_model(p.model) else p.model
    name = getattr(base.config, "_name_or_path", None)
    if not name:
        raise ValueError(
            "GRPOConfig.vllm_mode='colocate' starts a vLLM server, which loads the model by name: pass "
            "the model as a hub id or a path (or save_pretrained it first)"
        )
    groups = p.colocated_gpus
    on_gpu = groups[0] is not None
    dtype = "bfloat16" if args.bf16 else "float16" if args.fp16 else "float32"
    flags = colocated_flags(
        args.vllm_max_model_length,
        args.vllm_gpu_memory_utilization,
        args.vllm_tensor_parallel_size,
        args.vllm_model_impl,
        dtype,
        on_gpu,
    )
    flags += list(a.rollout_vllm_server_args or [])
    for i, gpus in enumerate(groups):
        log = Path(args.output_dir or ".") / f"vllm_colocate_{i}.log"
        servers.append(
            ColocatedServer.start(name, "nccl" if on_gpu else "gloo", flags, gpus, log, a.rollout_vllm_python)
        )
        logger.warning(
            "vllm_mode='colocate': started a vLLM server for %s on %s at %s (log: %s)",
            name,
            f"GPU {','.join(gpus)}" if gpus else "the CPU",
            servers[-1].url,
            log,
        )
    wait_for(servers, args.vllm_server_timeout)


def vllm_backend(p: PoolInputs):
    owned: list = []  # colocated servers: the backend owns them once it exists, until then this does
    try:
        if p.async_args.vllm_colocate:
            start_colocated_servers(p, owned)
        return _vllm_backend(p, [s.url for s in owned] or vllm_urls(p), owned)
    except BaseException:
        for server in owned:
            server.stop()
        raise


def vllm_sampling_params(s: SamplingInputs) -> dict:
    """The sampling parameters of every vLLM request: GRPOTrainer's settings, then ``generation_kwargs``."""
    return {
        "n": s.num_generations,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": -1 if s.top_k is None else s.top_k,
        "min_p": 0.0 if s.min_p is None else s.min_p,
        "repetition_penalty": s.repetition_penalty,
        "max_tokens": s.max_completion_length,
        "stop_token_ids": list(s.eos_token_ids),
        "logprobs": 0,
        "detokenize": False,
        **(s.generation_kwargs or {}),
    }


def rollout_sampling(s: SamplingInputs) -> SamplingSettings:
    """What the rollout engine applies to the logits before sampling: the vLLM requests' parameters, or the
    transformers workers' GenerationConfig (GRPOTrainer's, with ``generation_kwargs``)."""
    if s.backend == "vllm":
        settings = settings_of("vllm", vllm_sampling_params(s))
        # vLLM's min_tokens holds back the request's stop_token_ids and every EOS of the model and tokenizer
        return replace(settings, stop_ids=tuple(sorted({*settings.stop_ids, *s.eos_token_ids})))
    config = s.generation_config
    settings = settings_of("transformers", config.to_dict())
    if not config.do_sample:  # greedy: generate's processors (penalty, min_new_tokens), no temperature or warpers
        settings = replace(settings, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, extra_warpers=())
    return settings


def _vllm_backend(p: PoolInputs, urls: list[str], owned: list):
    from ..engines.vllm.backend import AdapterPlan, VLLMBackend, VLLMLaneSpec

    args, a, model = p.args, p.async_args, p.model
    sampling = vllm_sampling_params(p.sampling)
    specs = [
        VLLMLaneSpec(
            lane_id=i,
            url=url,
            sampling_params=sampling,
            eos_token_ids=p.sampling.eos_token_ids,
            seed=args.seed + 1_000_003 * (i + 1) + 100_003 * p.start_version,
            max_requests=a.rollout_vllm_max_requests or min(p.geometry.queue_size, 256),  # a thread each
            request_timeout_s=a.rollout_timeout_s,
            retry_s=a.rollout_vllm_retry_s,
        )
        for i, url in enumerate(urls)
    ]
    return VLLMBackend.connect(
        specs,
        max_outstanding=p.geometry.queue_size,
        weight_specs=policy_specs(model, persistent_only=True),
        transport=a.rollout_vllm_weight_transport,  # 'auto': what the servers say (their /server_info)
        trainer_device=str(p.device),
        owned=owned,
        bucket_bytes=int(a.weight_sync_bucket_mb * 2**20),
        pause_mode="keep" if a.rollout_weight_update == "decode_step" else "wait",
        startup_timeout_s=args.vllm_server_timeout,
        adapters=AdapterPlan(  # LoRA: the base once, then each version as a named adapter
            base_specs=policy_specs(model, persistent_only=True, part="frozen"),
            adapter_specs=policy_specs(model, part="adapters"),
            merges=adapter_tensors(model)[2],
            directory=a.rollout_vllm_adapter_dir,
            keep=a.max_staleness + 2,
        )
        if p.adapter_sync
        else None,
        down_limit_s=a.rollout_vllm_down_limit_s,
    )


def make_score_group(p: PoolInputs) -> tuple:
    """``(score_group, scorers)`` for the pool's scoring threads (rollout/scoring.py: what a reward function
    receives), each scorer with the trainer's reward functions and its own reward tokenizer copies."""

    def new_scorer() -> RewardScorer:
        return RewardScorer(p.reward_funcs, copy.deepcopy(p.reward_processing_classes), p.reward_func_names,
                            p.chat_template_kwargs, p.device, trainer_state=p.trainer_state,
                            event_loop=p.event_loop)  # fmt: skip

    return group_scorer(new_scorer, p.processing_class, p.sampling.num_generations)
