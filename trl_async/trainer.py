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

import datetime
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate.utils import broadcast_object_list, gather, get_int_from_env
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState, ProgressCallback
from transformers.utils import logging
from trl import GRPOTrainer

from .config import for_grpo_trainer, resolve_settings
from .correction.attributes import swapped
from .correction.seam import CorrectionSeam
from .engines.transformers.worker_process import prestart_worker_server
from .engines.vllm.colocate import trainer_gpu_groups
from .hardware.cores import PinnedTrainer
from .records import RolloutGroup
from .reporting.progress import AsyncProgressCallback, batch_metrics
from .reporting.trajectories import append_jsonl, trajectory_records
from .rollout.images import message_images
from .rollout.pool import RolloutPool
from .rollout.rollout_func import RolloutFuncRunner, replayed_output
from .rollout.scored import ScoredGroup
from .rollout.scoring import unsharded_reward_models
from .setup.checks import (
    check_after_loading,
    pool_geometry,
    refuse_before_loading,
)
from .setup.pool import rollout_sampling, start_pool
from .setup.trainer_view import generate_with_trainer_model, loaded, pool_inputs, sampling_inputs
from .weights.publisher import WeightPublisher

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


class AsyncGRPOTrainer(CorrectionSeam, GRPOTrainer):
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
        refuse_before_loading(
            model, args, train_dataset, quantization_config, rollout_func, tools, environment_factory
        )
        # resolved once, here (GRPOTrainer's default args, when none are given, once it has made them)
        settings = resolve_settings(args, args.device) if args is not None else None
        rank = get_int_from_env(["RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK"], 0)
        if (settings is None or settings.rollout_backend == "transformers") and rank == 0:
            # the main process's workers: their forkserver's imports overlap GRPOTrainer's set-up below, not step 1
            prestart_worker_server(model)
        super().__init__(
            model=model,
            reward_funcs=reward_funcs,
            args=for_grpo_trainer(args),  # without its own vLLM: the rollout engine generates
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
            tools=tools,
            rollout_func=rollout_func,
            environment_factory=environment_factory,
        )
        if args is not None:  # the settings as the user gave them (checkpoints and trackers record these)
            self.args.use_vllm = getattr(args, "use_vllm", False)  # (GRPOTrainer keeps its own self.use_vllm off)
        self.async_args = settings if settings is not None else resolve_settings(self.args, self.accelerator.device)
        self._colocated_gpus = (  # vllm_mode='colocate': the GPUs of each server the main process starts
            trainer_gpu_groups(self.accelerator, self.args.vllm_tensor_parallel_size)
            if self.async_args.vllm_colocate
            else None
        )
        check_after_loading(loaded(self))
        # what the engines apply to the logits: the ratio applies it too
        self._sampling = rollout_sampling(sampling_inputs(self))
        self._sampling_differs = self._sampling.differs_from(self.temperature)
        self._publisher = WeightPublisher(  # LoRA: workers get the base once, then only the adapters
            lambda: self.accelerator.unwrap_model(self.model),
            self._dist,
            self.async_args,
            self.accelerator.num_processes,
            self.accelerator.is_main_process,
        )
        # under ZeRO-3 a collective: every rank gathers each sharded reward model, the main process keeps a copy
        self._scoring_reward_funcs = unsharded_reward_models(
            self.reward_funcs, self._dist, self.accelerator.is_main_process, self.accelerator.device
        )
        self._geometry = pool_geometry(self.args, self.num_generations, self.async_args)
        self._pool: RolloutPool | None = None  # main process only
        self._core_split = None  # rollout_cpu_affinity: the trainer's and each worker's cores (cores.CoreSplit)
        self._pinned: PinnedTrainer | None = None  # rollout_cpu_affinity, while training
        self._pool_started = False
        self.last_rollout_pool: RolloutPool | None = None
        """The pool of the last ``train``, closed when it ended, its counters still readable (``dropped_samples``,
        ``dropped_groups``, ``filtered_groups``, ``abandoned_groups``). Main process only: ``None`` on the other
        ranks and before the first ``train``."""
        self._consuming: list[tuple[ScoredGroup, int]] | None = None  # (group, completion index) per local row
        # an evaluation's rollout_func runs on the main thread with the trainer's model; its own threads may sample
        # through the trainer meanwhile, one at a time (rollout_generate)
        self._evaluation_rollout = False
        self._trainer_generate_lock = threading.Lock()
        self.add_callback(_PublishWeights(self))
        self.add_callback(PromptProgress())
        self._live: dict[str, float] = {}  # shown in the progress bar: the last consumed batch
        if any(isinstance(c, ProgressCallback) for c in self.callback_handler.callbacks):
            self.remove_callback(ProgressCallback)
            self.add_callback(AsyncProgressCallback(lambda: self._live))

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
        self._publisher.detach()
        try:
            if self._pool is not None:
                pool, self._pool = self._pool, None
                self.last_rollout_pool = pool
                pool.close()
        finally:
            if self._pinned is not None:  # rollout_cpu_affinity: the trainer gets its cores and threads back
                pinned, self._pinned = self._pinned, None
                pinned.restore()

    @property
    def rollout_pool(self) -> RolloutPool | None:
        """The running pool during ``train``, else ``None``."""
        return self._pool

    def rollout_generate(self, prompt_ids, max_new_tokens: int | None = None) -> dict:
        """For ``rollout_func``: one sampled completion per token-id list, as ``completion_ids``, ``logprobs`` (mu)
        and ``versions`` (of each token's weights). During training (the background call of each group) the rollout
        workers sample; elsewhere, e.g. in evaluation on the main thread, the trainer's own model does, as
        GRPOTrainer would (no log-probs: NaN)."""
        runner = self._pool.runner if self._pool is not None else None
        if isinstance(runner, RolloutFuncRunner) and runner.in_rollout:
            return runner.generate(prompt_ids, max_new_tokens)
        if threading.current_thread() is not threading.main_thread() and not self._evaluation_rollout:
            raise RuntimeError(
                "rollout_generate was called on a background thread outside a running rollout (training has ended, "
                "or a thread of your own called it on the trainer: sample through the `trainer` your rollout_func "
                "was given); the training model is not used off the main thread"
            )
        with self._trainer_generate_lock:  # an evaluation rollout's threads: the trainer's model, one at a time
            return generate_with_trainer_model(self, prompt_ids, max_new_tokens)

    def _ensure_pool(self) -> None:
        """Start the workers (main process only) and publish the current weights as the first version. Every rank
        takes part in the publish: under ZeRO-3 it moves every rank's shards to rank 0."""
        if self._pool_started:
            return
        if self.accelerator.num_processes > 1 and self.accelerator.is_main_process != (dist.get_rank() == 0):
            raise RuntimeError("the main process must be torch.distributed rank 0: weight sync streams to rank 0")
        if self.accelerator.is_main_process:
            self._core_split = self.async_args.core_split()  # against this process's cores, before pinning
            saved = self.state.stateful_callbacks.get(PromptProgress.__name__) if self.state.global_step else None
            self._pool = start_pool(pool_inputs(self), saved["args"] if isinstance(saved, dict) else None)
            if self._core_split is not None:  # after the workers' forkserver started (it keeps the mask it had)
                self._pinned = PinnedTrainer(self._core_split.trainer)
        self._pool_started = True
        self._publisher.attach(self._pool)  # a vLLM server may not serve adapters (it says why)
        self._publish_weights(self.state.global_step)

    def _save_checkpoint(self, model, trial):
        if self._pool is not None:  # main process: record the completed prompts before trainer_state.json is written
            # a batch taken at version v is complete once steps v .. v + steps_per_batch - 1 are done
            done = self._pool.prompt_progress(self.state.global_step - self._geometry.steps_per_batch)
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
    @property
    def _adapter_sync(self) -> bool:
        """Whether weight syncs send the LoRA adapters alone (``WeightPublisher.adapter_sync``)."""
        return self._publisher.adapter_sync

    def _publish_weights(self, version: int) -> None:
        """Publish the trainer's weights as ``version`` (all ranks, main thread, same order: ``WeightPublisher``)."""
        seconds = self._publisher.publish(version)
        if seconds is not None:
            self._metrics["train"]["async/weight_sync_s"].append(seconds)

    def _maybe_publish_weights(self) -> None:
        step = self.state.global_step
        if self._pool_started and step % self.async_args.weight_sync_steps == 0:
            self._publish_weights(step)

    # ---- the generation seam ---------------------------------------------------------------------------------------
    def _generate_and_score_completions(self, inputs):
        if not self.model.training:  # evaluation: GRPOTrainer's own generation with the trainer's model
            rollout_func = self.rollout_func
            if rollout_func is None:
                return super()._generate_and_score_completions(inputs)

            def evaluation_rollout(prompts, trainer):  # only while it runs may its own threads sample (one at a time)
                with swapped(self, _evaluation_rollout=True):
                    return rollout_func(prompts, trainer)

            with swapped(self, rollout_func=evaluation_rollout):
                return super()._generate_and_score_completions(inputs)
        self._ensure_pool()
        while True:
            payload = [None]
            if self._pool is not None:  # main process: take the next generation batch for all ranks
                payload = [self._pool.take(self._geometry.groups_per_batch, self.state.global_step)]
            if self.accelerator.num_processes > 1:
                self._check_all_ranks_arrive("the next rollout batch")
                payload = broadcast_object_list(payload, from_process=0)
            if payload[0] is not None:
                break
            self._publish_weights(self.state.global_step)  # a server is back and none works: re-attach it (all ranks)
        groups, stats = payload[0]
        # GRPOTrainer gives each rank a contiguous slice of the generation batch's rows (groups stay contiguous in
        # the global order, which its gathered-reward advantage computation relies on)
        rows = [(g, j) for g in groups for j in range(self.num_generations)]
        per_rank = len(rows) // self.accelerator.num_processes
        local = rows[self.accelerator.process_index * per_rank : (self.accelerator.process_index + 1) * per_rank]
        self._forward_reward_logs(local)
        self._consuming = local
        # environments ran in the background (each episode reset its own instance): GRPOTrainer must not reset its
        # own again (nor one an evaluation left), and sees each row's prompt as the episode saw it. rollout_func ran
        # in the background: GRPOTrainer gets its recorded output for these rows instead.
        replay = (
            None
            if self.rollout_func is None
            else (lambda prompts, trainer: replayed_output([(g.group, j) for g, j in local]))
        )
        try:
            with swapped(self, environment_factories=None, environments=None, rollout_func=replay):
                # each row as the pool read it when the group was admitted: the reading the workers sampled from
                output = super()._generate_and_score_completions(
                    [{**g.row, "prompt": g.group.row_prompts[j]} if g.group.row_prompts else g.row for g, j in local]
                )
        finally:
            self._consuming = None
        self._add_off_policy_inputs(output)
        if self.async_args.rollout_trajectory_file:
            self._log_trajectories(local, output["advantages"])
        metrics = self._metrics["train"]
        pool = self._pool
        extra = batch_metrics(
            stats,
            groups,
            self.async_args.max_staleness,
            worker_restarts=pool.lane_restarts if pool is not None else 0,
            abandoned_groups=None
            if self.environment_factories is None and self.rollout_func is None
            else (pool.abandoned_groups if pool is not None else 0),
        )
        for name, value in extra.items():
            metrics[name].append(value)
        self._live = {
            "reward": metrics["reward"][-1] if metrics.get("reward") else float("nan"),
            "staleness": extra["async/staleness_mean"],
            "queue": stats.queue_size,
        }
        return output

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self._consuming is None:
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        # prompt_ids are the pool's own (_tokenize_prompts below), rendered as GRPOTrainer renders them
        # (tests/integration/test_prompt_rows.py checks that rendering against GRPOTrainer._tokenize_prompts)
        completion_ids = [list(g.group.completion_ids[j]) for g, j in self._consuming]
        logprobs = [list(g.group.logprobs[j]) for g, j in self._consuming]
        return completion_ids, logprobs  # with tools, whole episodes: _tool_call_loop below returns them as they are

    @staticmethod
    def _row_prompt_ids(group: RolloutGroup, j: int) -> list[int]:
        return list(group.row_prompt_ids[j] if group.row_prompt_ids else group.prompt_ids)

    def _tokenize_prompts(self, prompts: list):
        if self._consuming is None:
            return super()._tokenize_prompts(prompts)
        # the prompt ids the workers sampled from, as rendered when the group was admitted: rendering again could
        # differ (a template printing today's date; environments render each episode with its own tools). A
        # vision-language prompt's images, as GRPOTrainer takes them from the messages: its loss builds the image
        # inputs from them
        ids = [self._row_prompt_ids(g.group, j) for g, j in self._consuming]
        return ids, message_images(prompts) if self._is_vlm else None, {}

    def _tool_call_loop(self, prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields):
        if self._consuming is None:  # evaluation: GRPOTrainer's own loop
            return super()._tool_call_loop(
                prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields
            )
        # the episodes already ran in the background (rollout/episodes.py): hand GRPOTrainer what its loop would return
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
        )
        append_jsonl(path, records)
