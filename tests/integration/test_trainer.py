"""AsyncGRPOTrainer end to end on CPU with real worker processes (tiny local model, no network)."""

import contextlib
import gc
import json
import math
import os
import signal
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, TrainerCallback

from trl_async import AsyncGRPOTrainer
from trl_async.hardware.precision import device_precision
from trl_async.reporting.progress import AsyncProgressCallback

from ..conftest import (
    KeepPublished,
    async_args,
    current_logps,
    letter_reward,
    loss_batch,
    no_rollout_children,
    text_dataset,
    trained_staleness,
)

OMP_WAIT_POLICY_AT_IMPORT = os.environ.get("OMP_WAIT_POLICY")


def test_trains_updates_every_parameter_within_the_staleness_bound_and_joins_workers(tmp_path, tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = async_args(tmp_path, max_steps=5, max_staleness=2, rollout_verify_weights=True)
    trainer = AsyncGRPOTrainer(model=model, reward_funcs=letter_reward, args=args, train_dataset=text_dataset())
    trainer.train()

    unchanged = [n for n, p in trainer.model.named_parameters() if p.requires_grad and torch.equal(p, before[n])]
    assert unchanged == []
    staleness = trained_staleness(trainer)
    assert len(staleness) == 5 and max(staleness) <= 2
    pool = trainer.last_rollout_pool
    # each adoption hashed the worker's weights and matched the hash of the trainer weights published as that version
    assert pool.verified_adoptions >= 2
    assert max(pool.lane_versions.values()) >= 1
    assert not any(p.is_alive() for p in (lane.process for lane in pool.current_lanes)) and no_rollout_children()
    # the progress bar showed the last consumed batch (logging_steps=1: one log per batch)
    (bar,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, AsyncProgressCallback)]
    last = [h for h in trainer.state.log_history if "reward" in h][-1]
    assert bar.last_postfix == pytest.approx(
        {"reward": last["reward"], "staleness": last["async/staleness_mean"], "queue": last["async/queue_size"]}
    )


def test_rewards_and_advantages_stay_aligned_with_their_prompts(tmp_path, tiny_model_dir):
    rows = []

    class Record(TrainerCallback):  # GRPOTrainer clears its completion log at each logging step; copy it first
        def on_step_end(self, args, state, control, **kwargs):
            logs = trainer._logs
            rows.extend(zip(logs["prompt"], logs["completion"], logs["rewards"]["letter_reward"], strict=True))

    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=letter_reward,
        args=async_args(tmp_path),
        train_dataset=text_dataset(),
        callbacks=[Record()],
    )
    trainer.train()
    letters = {row["prompt"]: row["letter"] for row in text_dataset()}
    assert len(rows) == 4 * 8
    assert len({r for _, _, r in rows}) > 3  # rewards vary, so a shuffled pairing could not pass by luck
    for prompt, completion, reward in rows:  # recompute each logged reward from its logged prompt and completion
        assert reward == pytest.approx(sum(ch <= letters[prompt] for ch in completion) / 6)


def test_zero_staleness_is_on_policy_and_importance_ratios_are_one(tmp_path, tiny_model_dir):
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=letter_reward,
        args=async_args(tmp_path, max_staleness=0, num_rollout_workers=2),
        train_dataset=text_dataset(),
    )
    trainer.train()
    assert trained_staleness(trainer) == [0.0] * 4
    ratios = [h["is/ratio_mean"] for h in trainer.state.log_history if "is/ratio_mean" in h]
    # worker mu and trainer pi_prox are the same weights and the same distribution: ratio 1 up to float error
    assert len(ratios) == 4 and all(abs(r - 1) < 1e-4 for r in ratios)
    assert all(h["is/ess"] == pytest.approx(1.0, abs=1e-6) for h in trainer.state.log_history if "is/ess" in h)
    assert trainer.state.log_history[-2]["async/dropped_stale"] == 0


def test_importance_weight_reaches_grpo_loss(tmp_path, tiny_model_dir):
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir, reward_funcs=letter_reward, args=async_args(tmp_path), train_dataset=text_dataset()
    )
    b, t = 2, 3
    inputs = loss_batch()
    current_logps(trainer, inputs)  # train mode, as Trainer's loop sets it
    base = trainer._compute_loss(trainer.model, dict(inputs)).item()
    ones = trainer._compute_loss(trainer.model, {**inputs, "importance_sampling_ratio": torch.ones(b, t)}).item()
    zeros = trainer._compute_loss(trainer.model, {**inputs, "importance_sampling_ratio": torch.zeros(b, t)}).item()
    halves = trainer._compute_loss(trainer.model, {**inputs, "importance_sampling_ratio": torch.full((b, t), 0.5)})
    assert ones == pytest.approx(base) and base != 0.0
    assert zeros == 0.0  # a zero weight removes every token from the (beta=0) loss
    assert halves.item() == pytest.approx(0.5 * base)
    assert not trainer.use_vllm  # the seam is switched on per call only


@pytest.mark.parametrize("bypass", [False, True], ids=["decoupled", "bypass"])
def test_a_missing_behaviour_logprob_leaves_the_loss_finite(tmp_path, tiny_model_dir, bypass):
    """A NaN mu (a null log-prob from a vLLM server): decoupled gives that token ratio 1, as GRPOTrainer does; bypass
    (pi_prox := mu) has no ratio for it and leaves it out of the loss, not out of attention. Both count it
    (is/behaviour_nan)."""
    trainer = AsyncGRPOTrainer(model=tiny_model_dir, reward_funcs=letter_reward, train_dataset=text_dataset(),
                               args=async_args(tmp_path, off_policy_bypass=bypass))  # fmt: skip
    b, t = 2, 3
    inputs = loss_batch()
    current = current_logps(trainer, inputs)
    behaviour = current - 0.3  # stale: every ratio exp(0.3), inside decoupled's cap
    missing = behaviour.clone()
    missing[1, 1] = float("nan")

    def loss(mu, completion_mask):
        out = {**inputs, "sampling_per_token_logps": mu, "completion_mask": completion_mask}
        trainer._add_off_policy_inputs(out)
        return trainer._compute_loss(trainer.model, out).item()

    got = loss(missing, inputs["completion_mask"])
    assert math.isfinite(got)
    if bypass:  # out of the loss only (GRPOTrainer's loss mask), still attended to by the tokens after it
        kept = torch.ones(b, t, dtype=torch.long)
        kept[1, 1] = 0
        out = {**inputs, "sampling_per_token_logps": behaviour, "tool_mask": kept}
        trainer._add_off_policy_inputs(out)
        expected = trainer._compute_loss(trainer.model, out).item()
    else:
        at_one = behaviour.clone()
        at_one[1, 1] = current[1, 1]  # ratio exactly 1 for that token
        expected = loss(at_one, inputs["completion_mask"])
    assert got == pytest.approx(expected, rel=1e-5) and got != pytest.approx(
        loss(behaviour, inputs["completion_mask"])
    )
    assert trainer._metrics["train"]["is/behaviour_nan"][0] == 1  # the first loss() call: the one with the NaN


def test_weight_from_the_loss_forward_equals_a_separate_proximal_forward(tmp_path, tiny_model_dir):
    # One optimizer step per generation batch: pi_prox is taken from the loss's own forward (one forward saved). It
    # must give the same loss and gradient as computing pi_prox in a separate forward first.
    args = async_args(tmp_path, off_policy_correction="tis", importance_sampling_cap=1.2)
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir, reward_funcs=letter_reward, args=args, train_dataset=text_dataset()
    )
    assert trainer._correction_from_loss_forward()
    b = 2
    inputs = {
        "prompt_ids": torch.tensor([[5, 6], [7, 8]]),
        "prompt_mask": torch.ones(b, 2, dtype=torch.long),
        "completion_ids": torch.tensor([[9, 10, 11], [12, 13, 14]]),
        "completion_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
        "advantages": torch.tensor([1.0, -0.5]),
        "num_items_in_batch": torch.tensor(5),
        "sampling_per_token_logps": torch.tensor([[-5.0, -4.0, -3.0], [-3.5, -6.0, 0.0]]),  # ratios ~3 > cap and < 1
    }
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1

    def loss_and_grad(batch):
        trainer.model.zero_grad()
        loss = trainer._compute_loss(trainer.model, batch)
        loss.backward()
        return loss.item(), torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])

    separate = dict(inputs)
    prox, processed = trainer._proximal_logps(separate)
    assert processed is prox  # no truncation: the same log-probs
    separate["old_per_token_logps"] = prox
    separate["importance_sampling_ratio"] = trainer._staleness_weights(prox, inputs["sampling_per_token_logps"],
                                                                       inputs["completion_mask"])  # fmt: skip
    assert (separate["importance_sampling_ratio"] < torch.exp(prox - inputs["sampling_per_token_logps"])).any()
    deferred = dict(inputs)
    loss_a, grad_a = loss_and_grad(separate)
    loss_b, grad_b = loss_and_grad(deferred)
    assert loss_b == pytest.approx(loss_a, rel=1e-6)
    assert torch.allclose(grad_a, grad_b, atol=1e-7)
    assert torch.equal(deferred["importance_sampling_ratio"], separate["importance_sampling_ratio"])
    assert "_get_per_token_logps_and_entropies" not in trainer.__dict__ and not trainer.use_vllm  # restored


def test_in_flight_weight_updates_keep_versions_bounded(tmp_path, tiny_model_dir):
    # 64 forced tokens: a worker's generate call is long enough for the trainer to publish in the middle of it
    # (min_new_tokens reshapes the distribution in a way the ratio does not rebuild: allowed without a correction)
    args = async_args(tmp_path, rollout_weight_update="decode_step", max_staleness=1, max_completion_length=64,
                      max_steps=6, generation_kwargs={"min_new_tokens": 64}, off_policy_correction="none",
                      rollout_trajectory_file="traj.jsonl")  # fmt: skip
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir, reward_funcs=letter_reward, args=args, train_dataset=text_dataset()
    )
    trainer.train()
    assert max(trained_staleness(trainer)) <= 1 and no_rollout_children()
    rows = [json.loads(x) for x in (tmp_path / "traj.jsonl").read_text().splitlines()]
    spanning = [r for r in rows if len(set(r["versions"])) > 1]
    assert spanning  # weights adopted between decode steps: one completion, several versions
    for r in spanning:  # versions only move forward within a completion; the oldest token sets the staleness
        assert r["versions"] == sorted(r["versions"]) and r["staleness"] == r["step"] - r["versions"][0] <= 1


def open_fds() -> dict[str, str]:
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
    return fds


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_interrupted_training_releases_workers_threads_and_shared_memory(tmp_path, tiny_model_dir, error):
    # torch shares tensors by file descriptor (no /dev/shm entry stays visible): count the open descriptors
    fds_before = open_fds()
    threads_before = {t.name for t in threading.enumerate()}
    raised_at = {}

    class Boom(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                raised_at["t"] = time.monotonic()
                raise error("boom at step 2")

    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=letter_reward,
        args=async_args(tmp_path),
        train_dataset=text_dataset(),
        callbacks=[Boom()],
    )
    with pytest.raises(error, match="boom at step 2"):
        trainer.train()
    assert time.monotonic() - raised_at["t"] < 10  # everything released within 10 s
    assert (
        not any(p.is_alive() for p in (lane.process for lane in trainer.last_rollout_pool.current_lanes))
        and no_rollout_children()
    )
    assert not [
        t.name for t in threading.enumerate() if t.name.startswith("trl_async") and t.name not in threads_before
    ]
    del trainer, Boom  # the closed pool stays readable through the trainer; with it gone, nothing may stay open
    gc.collect()
    from multiprocessing import resource_tracker

    process_wide = {str(resource_tracker._resource_tracker._fd)}  # multiprocessing's own, opened once per process
    leaked = {
        fd: target
        for fd, target in open_fds().items()
        if fd not in fds_before and fd not in process_wide and not target.startswith("/dev/shm/pym-")
    }  # fmt: skip  (pym-: multiprocessing's shared heap arena)
    assert leaked == {}  # shared-memory weights ("/dev/shm/torch_..."), pipes and sockets all closed


def test_a_closed_pool_kept_for_its_counters_holds_no_copy_of_the_policy(tmp_path, tiny_model_dir):
    """After train() the closed pool stays readable (``last_rollout_pool``: counters, versions), but the shared-memory
    weights it published (twice the policy) are returned: no descriptor of a shared torch buffer stays open while the
    trainer lives."""
    fds_before = open_fds()
    trainer = AsyncGRPOTrainer(model=tiny_model_dir, reward_funcs=letter_reward, args=async_args(tmp_path, max_steps=2),
                               train_dataset=text_dataset())  # fmt: skip
    trainer.train()
    gc.collect()
    pool = trainer.last_rollout_pool
    assert pool.backend.weights.version >= 1 and pool.dropped_groups >= 0  # still readable
    kept = {fd: target for fd, target in open_fds().items() if fd not in fds_before and "torch_" in target}
    assert kept == {}, kept
    with pytest.raises(RuntimeError, match="released"):
        _ = pool.backend.weights.tensors


def test_a_worker_killed_during_training_is_restarted_and_training_completes(tmp_path, tiny_model_dir):
    killed = []

    class Kill(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                proc = trainer.rollout_pool.current_lanes[0].process
                os.kill(proc.pid, signal.SIGKILL)
                killed.append(proc)

    args = async_args(tmp_path, max_steps=6, max_staleness=1, rollout_max_restarts=1)
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir, reward_funcs=letter_reward, args=args, train_dataset=text_dataset(), callbacks=[Kill()]
    )
    trainer.train()
    pool = trainer.last_rollout_pool
    assert trainer.state.global_step == 6 and pool.lane_restarts == 1 and not killed[0].is_alive()
    assert max(trained_staleness(trainer)) <= 1
    assert max(h.get("async/worker_restarts", 0) for h in trainer.state.log_history) == 1
    assert not any(p.is_alive() for p in (lane.process for lane in pool.current_lanes)) and no_rollout_children()


def test_worker_weights_equal_the_trainer_weights_after_the_last_sync(tmp_path, tiny_model_dir):
    args = async_args(tmp_path, max_steps=3, max_staleness=1, rollout_verify_weights=True)
    shared = KeepPublished()  # what every worker copies its weights from, as training ends
    trainer = AsyncGRPOTrainer(model=tiny_model_dir, reward_funcs=letter_reward, args=args,
                               train_dataset=text_dataset(), callbacks=[shared])  # fmt: skip
    shared.trainer = trainer
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    pool = trainer.last_rollout_pool
    assert shared.version == 3  # the last sync: after the last optimizer step
    final = dict(trainer.model.named_parameters())
    assert set(shared.weights) >= set(final)
    for name, tensor in final.items():
        assert torch.equal(shared.weights[name], tensor.detach()), name
    assert any(not torch.equal(initial[n], t) for n, t in final.items())  # training moved the weights: a real check
    # and the workers' own copies: each adoption was hashed in the worker and matched the published set's hash
    assert pool.verified_adoptions >= 2 and max(pool.lane_versions.values()) >= 2


def test_cpu_workers_run_at_low_priority_with_passive_openmp_and_the_trainers_compute_dtype(tmp_path, tiny_model_dir):
    # bf16=True: the trainer computes in bf16 over float32 weights, so the workers generate in bf16 (rollout_dtype
    # default) where this CPU computes bf16 natively, else in float32; on the CPU they run at niceness 19 with
    # OMP_WAIT_POLICY=PASSIVE (rollout_nice default)
    seen = {}

    class Inspect(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            (process,) = [lane.process for lane in trainer.rollout_pool.current_lanes]
            environ = open(f"/proc/{process.pid}/environ", "rb").read().split(b"\0")
            seen["passive"] = b"OMP_WAIT_POLICY=PASSIVE" in environ
            seen["nice"] = os.getpriority(os.PRIO_PROCESS, process.pid) - os.getpriority(os.PRIO_PROCESS, 0)
            (spec,) = trainer.rollout_pool.backend.specs
            seen["dtype"] = spec.dtype

    args = async_args(tmp_path, max_steps=1, bf16=True)
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=letter_reward,
        args=args,
        train_dataset=text_dataset(),
        callbacks=[Inspect()],
    )
    trainer.train()
    native = device_precision("cpu").bf16  # on AVX2-only CPUs bf16 is emulated: the workers stay in float32
    assert seen == {"passive": True, "nice": 19, "dtype": torch.bfloat16 if native else torch.float32}
    assert next(trainer.model.parameters()).dtype == torch.float32  # the trainer's own weights stay float32
    assert os.environ.get("OMP_WAIT_POLICY") == OMP_WAIT_POLICY_AT_IMPORT  # the trainer's environment is restored
