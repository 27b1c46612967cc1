"""``AsyncGRPOTrainer``: GRPOTrainer whose generation runs in background rollout workers.

Only GRPOTrainer's generation seam is replaced. In training, ``_generate_and_score_completions`` takes the next
generation batch of finished, already-scored groups from the rollout pool and hands them to GRPOTrainer's own code
through three narrow overrides: ``_generate_single_turn`` (returns the workers' completions and behaviour log-probs
instead of generating), ``_calculate_rewards`` (returns the rewards the pool scored in the background, gathered on the
main thread) and ``_compute_loss`` (makes GRPOTrainer's ``importance_sampling_ratio`` seam active). Padding, masks,
the reference model, advantages, logging and the loss itself stay GRPOTrainer's. Evaluation generates synchronously
with the trainer's weights, exactly as GRPOTrainer does.
"""

from __future__ import annotations

import copy
import datetime
import math
import os
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate.utils import broadcast_object_list, gather, is_peft_model
from datasets import IterableDataset
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState, ProgressCallback
from transformers.utils import logging
from trl import GRPOTrainer
from trl.data_utils import is_conversational
from trl.models.utils import disable_gradient_checkpointing

from .config import async_fields_of
from .correction import off_policy_correction
from .episodes import EnvironmentPool, EpisodeRunner
from .progress import AsyncProgressCallback
from .prompts import PromptStream
from .records import RolloutGroup
from .rollout_pool import PoolSettings, RolloutPool, ScoredGroup
from .scoring import RewardScorer, decode_completions, unsharded_reward_models
from .setup_checks import check_lora_on_tied_embeddings, check_vocabulary, unsupported_setup
from .tool_calls import ToolRunner, split_tools
from .trajectories import append_jsonl, trajectory_records
from .weight_sync import iter_policy_buckets, policy_specs
from .worker import WorkerSpec
from .worker_process import ProcessBackend

logger = logging.get_logger(__name__)


class _PublishWeights(TrainerCallback):
    """After every ``weight_sync_steps``-th optimizer step, publish the trainer's weights as a new version."""

    def __init__(self, trainer: AsyncGRPOTrainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._maybe_publish_weights()


class PromptProgress(TrainerCallback, ExportableState):
    """Which prompts training has completed, saved in each checkpoint's ``trainer_state.json`` (transformers'
    stateful callbacks) so that a resumed run neither repeats nor skips prompts when groups finished out of order
    (``prompts.PromptStream.progress``). The trainer fills it in just before a checkpoint is written."""

    def __init__(self, next_position: int = 0, consumed_after: list[int] | None = None) -> None:
        self.next_position = next_position
        self.consumed_after = list(consumed_after or [])

    def state(self) -> dict:
        return {"args": {"next_position": self.next_position, "consumed_after": self.consumed_after}, "attributes": {}}


class AsyncGRPOTrainer(GRPOTrainer):
    """Drop-in ``trl.GRPOTrainer`` with asynchronous generation. Same constructor; configure it with
    ``AsyncGRPOConfig`` (a plain ``GRPOConfig`` works, with the async defaults)."""

    _tag_names = ["trl", "grpo", "trl_async"]

    def __init__(
        self,
        model,
        reward_funcs=None,
        args=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
    ):
        if rollout_func is not None:
            raise NotImplementedError(
                "AsyncGRPOTrainer does not support `rollout_func` yet: a custom rollout needs a contract for the policy "
                "version its weights carried. Use trl.GRPOTrainer for `rollout_func`."
            )
        refused = unsupported_setup(model, args, quantization_config)
        if refused:
            raise NotImplementedError(
                f"AsyncGRPOTrainer does not support {refused}: its rollout workers receive the full, unquantized "
                "policy weights after every sync. Supported: one process, DDP, DeepSpeed ZeRO-2 and ZeRO-3, and LoRA "
                "on an unquantized base model. Use trl.GRPOTrainer for this set-up."
            )
        if args is not None and getattr(args, "use_vllm", False):
            raise ValueError(
                "AsyncGRPOTrainer generates in its own rollout workers: leave `use_vllm=False` and choose the engine "
                "with `AsyncGRPOConfig.rollout_backend`."
            )
        if train_dataset is not None and not isinstance(train_dataset, IterableDataset) and len(train_dataset) == 0:
            raise ValueError("train_dataset is empty: AsyncGRPOTrainer needs at least one prompt to generate from.")
        if isinstance(train_dataset, IterableDataset):
            raise NotImplementedError(
                "AsyncGRPOTrainer needs a map-style `train_dataset` (rollout workers read prompts ahead of the trainer "
                "by index); convert it with `Dataset.from_generator` or `datasets.Dataset.from_list`."
            )
        super().__init__(
            model=model,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
            tools=tools,
            environment_factory=environment_factory,
        )
        self.async_args = async_fields_of(self.args)
        self._check_async_supported()
        # under ZeRO-3 a collective: every rank gathers each sharded reward model, the main process keeps a copy
        self._scoring_reward_funcs = unsharded_reward_models(
            self.reward_funcs, self._dist, self.accelerator.is_main_process, self.accelerator.device
        )
        gen_batch = self.args.generation_batch_size
        self._groups_per_batch = gen_batch // self.num_generations
        per_batch = self.args.steps_per_generation * self.num_iterations
        self._steps_per_batch = per_batch // self.args.gradient_accumulation_steps
        queue_default = (self.async_args.max_staleness // self._steps_per_batch + 1) * self._groups_per_batch
        self._queue_size = self.async_args.rollout_queue_size or queue_default
        if self._queue_size < self._groups_per_batch:
            raise ValueError(
                f"AsyncGRPOConfig.rollout_queue_size={self._queue_size} is smaller than one generation batch "
                f"({self._groups_per_batch} groups = generation_batch_size // num_generations): the trainer could never "
                f"get a full batch. Set rollout_queue_size >= {self._groups_per_batch} or leave it None."
            )
        workers = self.async_args.num_rollout_workers
        self._rollout_batch_groups = self.async_args.rollout_batch_groups or math.ceil(
            self._groups_per_batch / workers
        )
        self._pool: RolloutPool | None = None  # main process only
        self._scorers: list[RewardScorer] = []  # one per scoring thread of the pool, main process only
        self._tool_runner: ToolRunner | None = None  # with tools, main process only
        self._pool_started = False
        self.last_rollout_pool: RolloutPool | None = None
        self._consuming: list[tuple[ScoredGroup, int]] | None = None  # (group, completion index) per local row
        self.add_callback(_PublishWeights(self))
        self.add_callback(PromptProgress())
        self._live: dict[str, float] = {}  # shown in the progress bar: the last consumed batch
        if any(isinstance(c, ProgressCallback) for c in self.callback_handler.callbacks):
            self.remove_callback(ProgressCallback)
            self.add_callback(AsyncProgressCallback(lambda: self._live))

    def _check_async_supported(self) -> None:
        if self._is_vlm:
            raise NotImplementedError("AsyncGRPOTrainer does not support vision-language models (image inputs) yet.")
        data = self.train_dataset
        if self.tools and data is not None and "prompt" in data.column_names and not is_conversational(data[0]):
            raise ValueError(
                "`tools` need conversational prompts (lists of messages): tool calls are parsed from assistant turns "
                "with the chat template's response schema (GRPOTrainer's tool loop fails on plain-text prompts too)."
            )
        if (self.tools or self.environment_factories) and self.async_args.rollout_backend == "vllm":
            raise NotImplementedError(
                "AsyncGRPOTrainer runs `tools` and `environment_factory` with its transformers rollout workers only "
                "for now (rollout_backend='transformers'); the vLLM backend does not continue multi-turn episodes yet."
            )
        per_batch = self.args.steps_per_generation * self.num_iterations
        if per_batch % self.args.gradient_accumulation_steps != 0:
            raise ValueError(
                f"steps_per_generation * num_iterations ({per_batch}) must be a multiple of "
                f"gradient_accumulation_steps ({self.args.gradient_accumulation_steps}) so that every generation batch "
                "is consumed at one policy version; set steps_per_generation to a multiple of it."
            )
        if self.async_args.rollout_device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(
                f"AsyncGRPOConfig.rollout_device={self.async_args.rollout_device!r} but CUDA is not available; "
                "use rollout_device='cpu'."
            )
        model = self.accelerator.unwrap_model(self.model)
        check_vocabulary(self._tokenizer, getattr(model.config, "vocab_size", None))
        if is_peft_model(model):
            check_lora_on_tied_embeddings(model)
        a = self.async_args
        cpu_workers = a.rollout_backend == "transformers" and a.rollout_device == "cpu"
        if cpu_workers and self.accelerator.device.type == "cpu" and os.environ.get("OMP_WAIT_POLICY") != "PASSIVE":
            logger.warning(
                "The trainer and its rollout workers share the CPU cores, and OMP_WAIT_POLICY is not PASSIVE: the "
                "trainer's idle OpenMP threads spin and take cycles from the workers (with neither side passive: 0.87x "
                "the steps per minute on 2 cores, benchmarks/README.md). Set OMP_WAIT_POLICY=PASSIVE in the "
                "environment before torch is imported (the recipes do); workers get it by default."
            )
        if self.args.use_transformers_continuous_batching:
            logger.warning("use_transformers_continuous_batching is ignored: rollout workers use `generate`.")

    # ---- lifecycle -----------------------------------------------------------------------------------------------
    def train(self, *args, **kwargs):
        """``Trainer.train``; every rollout worker is stopped and joined when it returns or raises."""
        try:
            return super().train(*args, **kwargs)
        finally:
            self.close_rollouts()

    def close_rollouts(self) -> None:
        """Stop and join every rollout worker (``train`` does this itself). The closed pool stays readable as
        ``last_rollout_pool`` (its counters: drops, verified weight adoptions, worker pids)."""
        self._pool_started = False
        if self._pool is not None:
            pool, self._pool = self._pool, None
            self.last_rollout_pool = pool
            pool.close()
        if self._tool_runner is not None:  # after the pool: its episode runner has stopped
            self._tool_runner.close()
            self._tool_runner = None
        for scorer in self._scorers:  # after the pool: its scoring threads have stopped
            scorer.close()
        self._scorers = []

    @property
    def rollout_pool(self) -> RolloutPool | None:
        """The running pool during ``train``, else ``None``."""
        return self._pool

    def _start_pool(self) -> RolloutPool:
        args, a = self.args, self.async_args
        model = self.accelerator.unwrap_model(self.model)
        start_version = self.state.global_step
        settings = PoolSettings(
            groups_per_batch=self._groups_per_batch,
            steps_per_batch=self._steps_per_batch,
            max_staleness=a.max_staleness,
            queue_size=self._queue_size,
            timeout_s=a.rollout_timeout_s,
            start_version=start_version,
            num_generations=self.num_generations,
            verify_weights=a.rollout_verify_weights,
            groups_per_call=self._rollout_batch_groups,
            max_restarts=a.rollout_max_restarts,
            heartbeat_timeout_s=a.rollout_heartbeat_timeout_s,
            scoring_threads=a.rollout_scoring_threads,
        )
        saved = self.state.stateful_callbacks.get(PromptProgress.__name__) if start_version else None
        episodes = self._episode_runner_factory() if (self.tools or self.environment_factories) else None
        prompts = PromptStream(
            len(self.train_dataset),
            self._groups_per_batch,
            shuffle=self.shuffle_dataset,
            seed=args.seed,
            skip_batches=start_version // self._steps_per_batch,  # a checkpoint without PromptProgress
            progress=saved["args"] if isinstance(saved, dict) else None,
        )
        backend = self._vllm_backend(model) if a.rollout_backend == "vllm" else self._process_backend(model)
        return RolloutPool(backend, settings, prompts, self._make_tokenize_row(), self._make_score_group(), episodes)

    def _episode_runner_factory(self):
        """Multi-turn episodes with ``tools`` (episodes.py): parsed and rendered with GRPOTrainer's own response
        parser, chat template and tool-suffix rendering, on copies made here (the runner's thread owns them)."""
        a = self.async_args
        self._tool_runner = ToolRunner(a.rollout_tool_threads, a.rollout_tool_timeout_s, getattr(self, "async_loop", None))
        config = self.accelerator.unwrap_model(self.model).config
        kwargs = dict(
            tokenizer=copy.deepcopy(self._tokenizer), chat_template=self.chat_template,
            chat_template_kwargs=dict(self.chat_template_kwargs), tools=list(self.tools),
            max_rounds=self.max_tool_calling_iterations, max_completion_length=self.max_completion_length,
            max_model_len=getattr(config, "max_position_embeddings", None), tool_runner=self._tool_runner,
            tool_dicts=split_tools(self.tools), num_generations=self.num_generations,
        )  # fmt: skip
        if self.environment_factories is not None:  # each episode: its own instance, reset, methods as tools
            kwargs.update(
                environments=EnvironmentPool(dict(self.environment_factories)), dataset=self.train_dataset,
                standalone_tools=list(self._standalone_tools), schema_tools=dict(self._env_tools),
                multi_environment=self._multi_environment,
            )  # fmt: skip
        return lambda **callbacks: EpisodeRunner(**kwargs, **callbacks)

    def _process_backend(self, model) -> ProcessBackend:
        args, a = self.args, self.async_args
        base = model.get_base_model() if is_peft_model(model) else model
        specs = [
            WorkerSpec(
                worker_id=i,
                model_class=type(base),
                model_config=base.config,
                dtype=a.resolved_rollout_dtype(next(base.parameters()).dtype, args.bf16, args.fp16),
                device=a.rollout_device,
                generation_config=self.generation_config,
                num_generations=self.num_generations,
                eos_token_ids=tuple(self.eos_token_ids),
                pad_token_id=self._tokenizer.pad_token_id,
                weight_update=a.resolved_weight_update,
                torch_threads=a.resolved_rollout_threads,
                nice=a.resolved_rollout_nice,
                seed=args.seed + 1 + i + 100_003 * self.state.global_step,
                verify_weights=a.rollout_verify_weights,
            )
            for i in range(a.num_rollout_workers)
        ]
        return ProcessBackend(specs, policy_specs(model), self._rollout_batch_groups)

    def _vllm_urls(self) -> list[str]:
        args = self.args
        if self.async_args.rollout_vllm_urls:
            return list(self.async_args.rollout_vllm_urls)
        if args.vllm_server_base_url:
            return [args.vllm_server_base_url]
        return [f"http://{args.vllm_server_host}:{args.vllm_server_port}"]

    def _vllm_transport(self) -> str:
        transport = self.async_args.rollout_vllm_weight_transport
        if transport == "auto":
            return "nccl" if self.accelerator.device.type == "cuda" else "gloo"
        return transport

    def _vllm_backend(self, model):
        from .vllm_backend import VLLMBackend, VLLMLaneSpec

        args, a = self.args, self.async_args
        sampling = {
            "n": self.num_generations,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": -1 if self.top_k is None else self.top_k,
            "min_p": 0.0 if self.min_p is None else self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "max_tokens": self.max_completion_length,
            "stop_token_ids": list(self.eos_token_ids),
            "logprobs": 0,
            "detokenize": False,
            **(args.generation_kwargs or {}),
        }
        specs = [
            VLLMLaneSpec(
                worker_id=i,
                url=url,
                sampling_params=sampling,
                eos_token_ids=tuple(self.eos_token_ids),
                seed=args.seed + 1_000_003 * (i + 1) + 100_003 * self.state.global_step,
                max_requests=a.rollout_vllm_max_requests or min(self._queue_size, 256),  # a thread each
                request_timeout_s=a.rollout_timeout_s,
                retry_s=a.rollout_vllm_retry_s,
            )
            for i, url in enumerate(self._vllm_urls())
        ]
        return VLLMBackend(
            specs,
            max_outstanding=self._queue_size,
            weight_specs=policy_specs(model, persistent_only=True),
            transport=self._vllm_transport(),
            bucket_bytes=int(a.weight_sync_bucket_mb * 2**20),
            pause_mode="keep" if a.resolved_weight_update == "decode_step" else "wait",
            startup_timeout_s=args.vllm_server_timeout,
        )

    def _ensure_pool(self) -> None:
        """Start the workers (main process only) and publish the current weights as the first version. Every rank
        takes part in the publish: under ZeRO-3 it moves every rank's shards to rank 0."""
        if self._pool_started:
            return
        if self.accelerator.num_processes > 1 and self.accelerator.is_main_process != (dist.get_rank() == 0):
            raise RuntimeError("the main process must be torch.distributed rank 0: weight sync streams to rank 0")
        if self.accelerator.is_main_process:
            self._pool = self._start_pool()
        self._pool_started = True
        self._publish_weights(self.state.global_step)

    def _save_checkpoint(self, model, trial):
        if self._pool is not None:  # main process: record the completed prompts before trainer_state.json is written
            # a batch taken at version v is complete once steps v .. v + steps_per_batch - 1 are done
            done = self._pool.prompt_progress(self.state.global_step - self._steps_per_batch)
            for callback in self.callback_handler.callbacks:
                if isinstance(callback, PromptProgress):
                    callback.next_position, callback.consumed_after = done["next_position"], done["consumed_after"]
        return super()._save_checkpoint(model, trial)

    def _check_all_ranks_arrive(self, what: str) -> None:
        """Bounded rendezvous before a collective: with gloo, ``monitored_barrier`` names the ranks that did not
        arrive within 2 x ``rollout_timeout_s`` (rank 0 itself may wait up to ``rollout_timeout_s`` for rollouts).
        NCCL has no monitored barrier; there the process-group timeout (``ddp_timeout``) bounds the wait."""
        if dist.get_backend() != "gloo":
            return
        timeout = datetime.timedelta(seconds=2 * self.async_args.rollout_timeout_s)
        try:
            dist.monitored_barrier(timeout=timeout, wait_all_ranks=True)
        except RuntimeError as exc:
            raise RuntimeError(
                f"AsyncGRPOTrainer (rank {self.accelerator.process_index}): not every rank reached {what} within "
                f"{timeout.total_seconds():.0f}s (2 x rollout_timeout_s): {exc}"
            ) from exc

    # ---- weights -------------------------------------------------------------------------------------------------
    def _publish_weights(self, version: int) -> None:
        """All ranks, main thread, same order: stream the full policy bucket by bucket; the main process copies
        each bucket into the workers' shared memory before the next bucket is gathered."""
        model = self.accelerator.unwrap_model(self.model)
        buckets = iter_policy_buckets(
            model,
            self._dist.gather_params,
            int(self.async_args.weight_sync_bucket_mb * 2**20),
            flat_zero3=self._dist.is_zero3,
            out=self._pool.publish_target if self._pool is not None else None,  # ZeRO-3 shards land there directly
            persistent_only=self.async_args.rollout_backend == "vllm",  # a vLLM model loads checkpoint tensors only
        )
        if self._pool is not None:
            seconds = self._pool.publish(buckets, version)
            self._metrics["train"]["async/weight_sync_s"].append(seconds)
        else:
            for _ in buckets:  # take part in the gathers
                pass

    def _maybe_publish_weights(self) -> None:
        step = self.state.global_step
        if self._pool_started and step % self.async_args.weight_sync_steps == 0:
            self._publish_weights(step)

    # ---- background helpers (run on the pool's threads; no collectives, own tokenizer copies) ----------------------
    def _make_tokenize_row(self):
        tokenizer = copy.deepcopy(self.processing_class)
        dataset, chat_template, template_kwargs = self.train_dataset, self.chat_template, self.chat_template_kwargs
        tools = list(self.tools or []) or None  # as GRPOTrainer._tokenize_prompts renders them
        config = self.accelerator.unwrap_model(self.model).config
        limit = getattr(config, "max_position_embeddings", None)
        vocab = getattr(config, "vocab_size", None)
        completion = self.max_completion_length

        def tokenize_row(index: int) -> tuple[int, ...]:
            ids = _tokenize(index)
            past = [t for t in ids if vocab is not None and t >= vocab]
            if past:
                raise ValueError(
                    f"train_dataset row {index}: the prompt has token id {past[0]} "
                    f"({tokenizer.convert_ids_to_tokens(past[0])!r}), past the model's vocabulary of {vocab}. Remove "
                    "it from the data, or call model.resize_token_embeddings(len(tokenizer)) before building the "
                    "trainer."
                )
            if limit is not None and len(ids) + completion > limit:
                # checked as each prompt is first used (tokenizing a whole dataset up front would be slow)
                raise ValueError(
                    f"train_dataset row {index}: the prompt is {len(ids)} tokens, and with max_completion_length="
                    f"{completion} that exceeds the model's max_position_embeddings={limit}. Filter long prompts "
                    "out of the dataset or lower max_completion_length."
                )
            return ids

        def _tokenize(index: int) -> tuple[int, ...]:
            prompt = dataset[index]["prompt"]
            if is_conversational({"prompt": prompt}):
                out = tokenizer.apply_chat_template(
                    conversation=[prompt],
                    tools=tools,
                    chat_template=chat_template,
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=True,
                    **template_kwargs,
                )
                return tuple(out["input_ids"][0])
            return tuple(tokenizer(text=[prompt])["input_ids"][0])

        return tokenize_row

    def _make_score_group(self):
        """``score_group`` for the pool's scoring threads: each thread gets its own scorer and tokenizer copies (a
        fast tokenizer used from two threads at once fails: "Already borrowed"; the main thread keeps the trainer's,
        which evaluate() uses). Reward models and functions themselves are shared."""
        local = threading.local()
        self._scorers = scorers = []
        dataset, group_size = self.train_dataset, self.num_generations

        def own() -> tuple:
            if not hasattr(local, "scorer"):
                local.tokenizer = copy.deepcopy(self.processing_class)
                local.scorer = RewardScorer(
                    self._scoring_reward_funcs,
                    copy.deepcopy(self.reward_processing_classes),
                    self.reward_func_names,
                    self.chat_template_kwargs,
                    self.accelerator.device,
                    trainer_state=lambda: self.state,
                    event_loop=getattr(self, "async_loop", None),  # GRPOTrainer's loop, if any reward is async
                )
                scorers.append(local.scorer)
            return local.tokenizer, local.scorer

        def score_group(group: RolloutGroup, environments: list | None = None) -> ScoredGroup:
            tokenizer, scorer = own()
            row = dataset[group.prompt_index]
            # environments: each episode's prompt carries its reset observation, as GRPOTrainer passes it
            rows = [{**row, "prompt": p} for p in group.row_prompts] if group.row_prompts else [row] * group_size
            conversational = is_conversational({"prompt": rows[0]["prompt"]})
            prompt_ids = list(group.row_prompt_ids) or [group.prompt_ids] * group_size
            if group.completions:  # multi-turn: the parsed messages of each episode, as GRPOTrainer's loop builds them
                completions = [list(c) for c in group.completions]
            else:
                completions = decode_completions(tokenizer, prompt_ids, group.completion_ids, conversational)
            rewards, extra_logs, metrics = scorer.score(rows, completions, list(group.completion_ids), environments)
            return ScoredGroup(group, 0, rewards, extra_logs, metrics)

        return score_group

    # ---- the generation seam ---------------------------------------------------------------------------------------
    def _generate_and_score_completions(self, inputs):
        if not self.model.training:
            return super()._generate_and_score_completions(inputs)
        self._ensure_pool()
        payload = [None]
        if self._pool is not None:  # main process: take the next generation batch for all ranks
            payload = [self._pool.take(self._groups_per_batch, self.state.global_step)]
        if self.accelerator.num_processes > 1:
            self._check_all_ranks_arrive("the next rollout batch")
            payload = broadcast_object_list(payload, from_process=0)
        groups, stats = payload[0]
        # GRPOTrainer gives each rank a contiguous slice of the generation batch's rows (groups stay contiguous in
        # the global order, which its gathered-reward advantage computation relies on)
        rows = [(g, j) for g in groups for j in range(self.num_generations)]
        per_rank = len(rows) // self.accelerator.num_processes
        local = rows[self.accelerator.process_index * per_rank : (self.accelerator.process_index + 1) * per_rank]
        self._forward_reward_logs(local)
        self._consuming = local
        # environments ran in the background (each episode reset its own instance): GRPOTrainer must not reset its
        # own again, and sees each row's prompt as the episode saw it
        factories, self.environment_factories = self.environment_factories, None
        environments, self.environments = self.environments, None  # an evaluation may have left its own
        try:
            output = super()._generate_and_score_completions(
                [{**self.train_dataset[g.group.prompt_index], "prompt": g.group.row_prompts[j]}
                 if g.group.row_prompts else self.train_dataset[g.group.prompt_index] for g, j in local]
            )  # fmt: skip
        finally:
            self._consuming = None
            self.environment_factories, self.environments = factories, environments
        self._add_off_policy_inputs(output)
        if self.async_args.rollout_trajectory_file:
            self._log_trajectories(local, output["advantages"])
        metrics = self._metrics["train"]
        metrics["async/staleness_mean"].append(sum(stats.staleness) / len(stats.staleness))
        metrics["async/staleness_max"].append(max(stats.staleness))
        for k in range(self.async_args.max_staleness + 1):  # histogram: samples per staleness in this batch
            metrics[f"async/staleness_k{k}"].append(stats.staleness.count(k))
        metrics["async/queue_size"].append(stats.queue_size)
        metrics["async/trainer_wait_s"].append(stats.wait_s)
        metrics["async/dropped_stale"].append(stats.dropped_samples_total)
        metrics["async/gen_tokens_per_s"].append(stats.gen_tokens_per_s)
        # reward functions that returned None/NaN: GRPOTrainer ignores those values (nansum), we count them
        metrics["async/reward_nan"].append(sum(int(torch.isnan(g.rewards).sum()) for g in groups))
        metrics["async/worker_restarts"].append(self._pool.worker_restarts if self._pool is not None else 0)
        if self.environment_factories is not None:  # groups skipped because their environment's reset raised
            metrics["async/abandoned_groups"].append(self._pool.abandoned_groups if self._pool is not None else 0)
        self._live = {
            "reward": metrics["reward"][-1] if metrics.get("reward") else float("nan"),
            "staleness": sum(stats.staleness) / len(stats.staleness),
            "queue": stats.queue_size,
        }
        return output

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self._consuming is None:
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        expected = [self._row_prompt_ids(g.group, j) for g, j in self._consuming]
        if [list(p) for p in prompt_ids] != expected:
            raise RuntimeError(
                "the rollout workers tokenized a prompt differently from GRPOTrainer; refusing to train on "
                "completions of a different prompt"
            )
        completion_ids = [list(g.group.completion_ids[j]) for g, j in self._consuming]
        logprobs = [list(g.group.logprobs[j]) for g, j in self._consuming]
        return completion_ids, logprobs  # with tools, whole episodes: _tool_call_loop below returns them as they are

    @staticmethod
    def _row_prompt_ids(group: RolloutGroup, j: int) -> list[int]:
        return list(group.row_prompt_ids[j] if group.row_prompt_ids else group.prompt_ids)

    def _tokenize_prompts(self, prompts: list):
        if self._consuming is None or not any(g.group.row_prompt_ids for g, _ in self._consuming):
            return super()._tokenize_prompts(prompts)
        # environments: each episode's prompt was rendered with its environment's tools (EpisodeRunner._tokenize)
        return [self._row_prompt_ids(g.group, j) for g, j in self._consuming], None, {}

    def _tool_call_loop(self, prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields):
        if self._consuming is None:  # evaluation: GRPOTrainer's own loop
            return super()._tool_call_loop(
                prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields
            )
        # the episodes already ran in the background (episodes.py): hand GRPOTrainer what its loop would return
        rows = [(g.group, j) for g, j in self._consuming]
        return (
            [list(group.tool_mask[j]) for group, j in rows],
            [list(group.completions[j]) for group, j in rows],
            [list(group.completion_ids[j]) for group, j in rows],
            [list(group.logprobs[j]) for group, j in rows],
            sum(group.tool_calls[j] for group, j in rows),
            sum(group.tool_failures[j] for group, j in rows),
            [[] for _ in rows],
        )

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        if self._consuming is None:
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        local = torch.stack([g.rewards[j] for g, j in self._consuming]).to(self.accelerator.device)
        return gather(local)  # main thread: GRPOTrainer normalises advantages over the gathered rewards

    def _forward_reward_logs(self, rows: list[tuple[ScoredGroup, int]]) -> None:
        """Hand what reward functions logged (via ``log_extra``/``log_metric``) during background scoring to
        GRPOTrainer's buffers, aligned with this rank's rows; a group's metrics go with its first row."""
        columns = sorted({c for g, _ in rows for c in g.extra_logs})
        for column in columns:
            self._pending_extra_logs[column].extend(
                g.extra_logs[column][j] if column in g.extra_logs else None for g, j in rows
            )
        for g, j in rows:
            if j == 0:
                for name, values in g.metrics.items():
                    self._pending_metrics[name].extend(values)

    def _log_trajectories(self, rows, advantages: torch.Tensor) -> None:
        path = Path(self.args.output_dir) / self.async_args.rollout_trajectory_file  # an absolute path stays as is
        if self.accelerator.num_processes > 1:
            path = path.with_name(f"{path.name}.rank{self.accelerator.process_index}")
        records = trajectory_records(
            rows,
            advantages.flatten().tolist() if advantages.dim() == 1 else advantages[:, 0].tolist(),
            self.state.global_step,
            self.reward_func_names,
            self.processing_class,
            self.train_dataset,
        )
        append_jsonl(path, records)

    # ---- off-policy correction -----------------------------------------------------------------------------------
    def _add_off_policy_inputs(self, output: dict) -> None:
        """Set ``old_per_token_logps`` = pi_prox (the trainer's policy now, or mu in bypass mode) and the staleness
        weight ``importance_sampling_ratio`` = f(pi_prox / mu) that GRPOTrainer's loss multiplies in. With
        ``off_policy_correction="none"`` (no bypass) neither is set, so GRPOTrainer treats the batch as on-policy,
        exactly as it treats its own generations.

        When one optimizer step consumes the whole generation batch (``steps_per_batch == 1``: GRPOTrainer's
        default), the weights do not change between now and the loss, so pi_prox is the loss's own forward pass,
        detached: both are left unset here and ``_compute_loss`` fills the weight in from that forward (GRPOTrainer
        itself uses ``per_token_logps.detach()`` when ``old_per_token_logps`` is unset). That saves one forward pass
        per step, the extra cost of the decoupled correction over synchronous GRPO."""
        a = self.async_args
        if a.off_policy_correction == "none" and not a.off_policy_bypass:
            return
        mask, behaviour = output["completion_mask"], output["sampling_per_token_logps"]
        if output.get("tool_mask") is not None:  # tool-result tokens were not sampled: no mu, no weight
            mask = mask * output["tool_mask"]
        if a.off_policy_bypass:
            # pi_prox := mu; a token without mu (NaN) has no ratio at all, so it leaves the loss through GRPOTrainer's
            # loss-only mask (`tool_mask`; the completion mask is also the attention mask, which must keep it); the
            # weights below still see it and count it in is/behaviour_nan
            missing = torch.isnan(behaviour)
            prox = behaviour.masked_fill(missing, 0.0)
            if missing.any():
                keep = (~missing).to(mask.dtype)
                tool_mask = output.get("tool_mask")
                output["tool_mask"] = keep if tool_mask is None else tool_mask * keep
                output["sampling_per_token_logps"] = prox
        elif output.get("old_per_token_logps") is not None:  # GRPOTrainer already computed it (same weights)
            prox = output["old_per_token_logps"]
        elif self._steps_per_batch == 1:
            return  # pi_prox comes from the loss's forward pass (see _compute_loss)
        else:
            prox = self._proximal_logps(output)
        output["old_per_token_logps"] = prox
        output["importance_sampling_ratio"] = self._staleness_weights(prox, behaviour, mask)

    def _staleness_weights(self, prox: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        a = self.async_args
        correction = off_policy_correction(
            prox, behaviour, mask, a.off_policy_correction, a.resolved_importance_sampling_cap,
            a.importance_sampling_floor,
        )  # fmt: skip
        for name, value in correction.stats.items():
            self._metrics["train"][f"is/{name}"].append(value)
        return correction.weights_BT

    def _proximal_logps(self, output: dict) -> torch.Tensor:
        """log pi_prox of the completion tokens under the trainer's current weights (GRPOTrainer's own forward)."""
        prompt_completion_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            logps, _ = self._get_per_token_logps_and_entropies(
                self.model,
                prompt_completion_ids,
                attention_mask,
                output["completion_ids"].size(1),
                batch_size=self.args.per_device_train_batch_size,
            )[:2]
        return logps

    def _compute_loss(self, model, inputs):
        # GRPOTrainer multiplies `importance_sampling_ratio` into the per-token loss only when
        # `use_vllm and vllm_importance_sampling_correction`. Our staleness weight goes through that same seam, so
        # switch it on for this call only (nothing else in `_compute_loss` reads `use_vllm`).
        deferred = (
            "importance_sampling_ratio" not in inputs
            and "sampling_per_token_logps" in inputs
            and model.training
            and self._correction_from_loss_forward()
        )
        if "importance_sampling_ratio" not in inputs and not deferred:
            return super()._compute_loss(model, inputs)
        saved = self.use_vllm, self.vllm_importance_sampling_correction
        self.use_vllm, self.vllm_importance_sampling_correction = True, True
        if deferred:
            # the policy forward is the first thing GRPOTrainer's loss computes, and the weight is read after it:
            # intercept that one call to set the weight from pi_prox = its log-probs, detached
            policy_forward = self._get_per_token_logps_and_entropies

            def forward_then_weight(*args, **kwargs):
                del self._get_per_token_logps_and_entropies  # back to the method for any later call
                result = policy_forward(*args, **kwargs)
                prox = result[0].detach()
                mask = inputs["completion_mask"]
                if "tool_mask" in inputs:
                    mask = mask * inputs["tool_mask"]
                inputs["importance_sampling_ratio"] = self._staleness_weights(
                    prox, inputs["sampling_per_token_logps"], mask
                )
                return result

            self._get_per_token_logps_and_entropies = forward_then_weight
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self.use_vllm, self.vllm_importance_sampling_correction = saved
            self.__dict__.pop("_get_per_token_logps_and_entropies", None)

    def _correction_from_loss_forward(self) -> bool:
        a = self.async_args
        return self._steps_per_batch == 1 and a.off_policy_correction != "none" and not a.off_policy_bypass
