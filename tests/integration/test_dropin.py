"""Drop-in compatibility: what a GRPOTrainer user passes keeps working, and what cannot work yet fails clearly."""

import asyncio
import copy
import json
import math
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, Qwen2Config
from trl import GRPOConfig

from trl_async import AsyncGRPOTrainer
from trl_async.records import RolloutGroup
from trl_async.setup.pool import make_score_group
from trl_async.setup.trainer_view import pool_inputs

from ..conftest import (
    COMMON,
    KeepPublished,
    async_args,
    current_logps,
    loss_batch,
    no_rollout_children,
    text_dataset,
    trained_staleness,
)


def length_reward(completions, **kwargs):
    return [len(c) / 6 for c in completions]


def test_closure_and_two_weighted_rewards(tmp_path, tiny_model_dir):
    target = "a"
    count_target = lambda completions, **kw: [c.count(target) for c in completions]  # noqa: E731 - a real closure
    args = async_args(tmp_path, max_steps=2, reward_weights=[2.0, 0.5], rollout_trajectory_file="traj.jsonl")
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir, reward_funcs=[count_target, length_reward], args=args, train_dataset=text_dataset()
    )
    trainer.train()
    rows = [json.loads(x) for x in (tmp_path / "traj.jsonl").read_text().splitlines()]
    for row in rows:  # each function's value, recomputed from the completion it scored (swapped columns fail)
        assert row["rewards"]["<lambda>"] == row["completion"].count("a")
        assert row["rewards"]["length_reward"] == pytest.approx(len(row["completion"]) / 6)
    logs = [h for h in trainer.state.log_history if "reward" in h]
    for step, log in enumerate(logs):
        mine = [r for r in rows if r["step"] == step]
        count = sum(r["completion"].count("a") for r in mine) / len(mine)
        length = sum(len(r["completion"]) / 6 for r in mine) / len(mine)
        assert log["rewards/<lambda>/mean"] == pytest.approx(count, rel=1e-5)
        assert log["rewards/length_reward/mean"] == pytest.approx(length, rel=1e-5)
        # GRPOTrainer's weighted sum: reward = 2 * mean(count) + 0.5 * mean(length)
        assert log["reward"] == pytest.approx(2.0 * count + 0.5 * length, rel=1e-5)


def test_conversational_dataset(tmp_path, tiny_model_dir):
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": f"hi {i}"}]} for i in range(8)])
    seen = []

    def chat_reward(prompts, completions, **kwargs):
        seen.append((prompts[0], completions[0]))
        return [len(c[0]["content"]) / 6 for c in completions]

    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir, reward_funcs=chat_reward, args=async_args(tmp_path, max_steps=2), train_dataset=ds
    )
    trainer.train()
    assert trainer.state.global_step == 2
    prompt, completion = seen[0]
    assert prompt[0]["role"] == "user" and completion[0]["role"] == "assistant"


def test_none_and_nan_rewards_are_ignored_as_grpo_does_and_counted(tmp_path, tiny_model_dir):
    def patchy_reward(completions, **kwargs):  # completion 1 of each group: None, completion 2: NaN
        return [None if i % 4 == 1 else float("nan") if i % 4 == 2 else 1.0 for i in range(len(completions))]

    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=[patchy_reward, length_reward],
        args=async_args(tmp_path, max_steps=2),
        train_dataset=text_dataset(),
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "async/reward_nan" in h]
    # batch of 8 = 2 groups x 4: two NaN values per group from patchy_reward, 4 per step
    assert [h["async/reward_nan"] for h in logs] == [4, 4]
    assert all(h["rewards/patchy_reward/mean"] == 1.0 for h in logs)  # NaNs ignored in the mean, as GRPOTrainer does
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)


def test_plain_grpo_config_and_a_reward_model(tmp_path, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, num_labels=1, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    reward_model_dir = str(tmp_path / "rm")
    AutoModelForSequenceClassification.from_config(config).save_pretrained(reward_model_dir)
    tokenizer.save_pretrained(reward_model_dir)
    args = GRPOConfig(output_dir=str(tmp_path), **{**COMMON, "max_steps": 2})
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir, reward_funcs=[reward_model_dir, length_reward], args=args, train_dataset=text_dataset()
    )
    assert trainer.async_args.max_staleness == 1  # async defaults for a plain GRPOConfig
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert len(logs) == 2 and all(h["rewards/rm/std"] > 0 for h in logs)  # the reward model really scored
    assert max(trained_staleness(trainer)) <= 1


def test_trls_continuous_batching_fields_reach_the_workers(tmp_path, tiny_model_dir):
    """GRPOConfig's switch (here its older name, ``use_transformers_paged``) turns the workers' continuous batching
    on, and its ``transformers_continuous_batching_config`` configures transformers' paged engine, which then runs
    on the CPU too."""
    given = {"scheduler_type": "prefill_first"}
    with pytest.warns(FutureWarning, match="use_transformers_paged"):
        args = GRPOConfig(output_dir=str(tmp_path), **{**COMMON, "max_steps": 2}, use_transformers_paged=True,
                          transformers_continuous_batching_config=given)  # fmt: skip
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir, reward_funcs=length_reward, args=args, train_dataset=text_dataset()
    )
    trainer.train()
    specs = trainer.last_rollout_pool.backend.specs
    assert all(s.slots == trainer.num_generations * trainer._geometry.groups_per_call for s in specs)
    assert all(s.paged_settings == given and s.weight_update == "decode_step" for s in specs)
    assert len([h for h in trainer.state.log_history if "reward" in h]) == 2


def test_trls_continuous_batching_settings_that_would_break_mu_are_refused_for_a_plain_grpo_config(
    tmp_path, tiny_model_dir
):
    args = GRPOConfig(output_dir=str(tmp_path), **COMMON, use_transformers_continuous_batching=True,
                      transformers_continuous_batching_config={"return_logprobs": False})  # fmt: skip
    with pytest.raises(ValueError, match=r"transformers_continuous_batching_config is invalid: return_logprobs=False"):
        AsyncGRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, args=args, train_dataset=text_dataset())


def test_async_reward_runs_on_grpo_trainers_loop_across_groups_and_steps(tmp_path, tiny_model_dir):
    gate, loops = asyncio.Semaphore(1), []  # loop-bound once contended, like an async HTTP client

    async def gated_length(completions, **kwargs):
        loops.append(asyncio.get_running_loop())

        async def one(c):
            async with gate:
                await asyncio.sleep(0)
                return len(c) / 6

        return list(await asyncio.gather(*(one(c) for c in completions)))

    trainer = AsyncGRPOTrainer(model=tiny_model_dir, reward_funcs=gated_length,
                               args=async_args(tmp_path, max_steps=3), train_dataset=text_dataset())  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 3 and len(loops) >= 6  # 2 groups per step
    assert set(loops) == {trainer.async_loop}  # GRPOTrainer's own long-lived loop, as it uses for async rewards


def test_the_scorer_has_its_own_reward_tokenizers(tmp_path, tiny_model_dir):
    """Scoring threads tokenize while evaluate() uses the trainer's tokenizers on the main thread: a fast tokenizer
    shared across threads fails ("Already borrowed"). Each scoring thread has its own."""
    reward_model_dir = str(tmp_path / "rm")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    AutoModelForSequenceClassification.from_config(config).save_pretrained(reward_model_dir)
    tokenizer.save_pretrained(reward_model_dir)
    trainer = AsyncGRPOTrainer(model=tiny_model_dir, reward_funcs=[reward_model_dir, length_reward],
                               args=async_args(tmp_path), train_dataset=text_dataset())  # fmt: skip
    score_group, scorers = make_score_group(pool_inputs(trainer))
    group = RolloutGroup(group_id=0, prompt_index=0, prompt_ids=(5, 6), completion_ids=((7, 8),) * 4,
                         logprobs=((-1.0, -1.0),) * 4, versions=((0, 0),) * 4, lane_id=0, generate_s=0.0)  # fmt: skip
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(score_group(group, trainer.train_dataset[0]))) for _ in range(2)
    ]
    for t in threads:  # two scoring threads (rollout_scoring_threads=2)
        t.start()
        t.join()
    assert len(results) == 2 and torch.equal(results[0].rewards, results[1].rewards)
    theirs = trainer.reward_processing_classes[0]
    first, second = (scorer.reward_processing_classes[0] for scorer in scorers)
    assert first.get_vocab() == theirs.get_vocab()
    # the Rust tokenizers, whose borrow is the problem: one per thread, none shared with the trainer
    assert len({id(theirs._tokenizer), id(first._tokenizer), id(second._tokenizer)}) == 3


LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type_matches_grpo_trainer_on_policy_and_trains(tmp_path, tiny_model_dir, loss_type):
    """On-policy (mu = the current policy: every staleness weight 1) our loss equals GRPOTrainer's on the same batch,
    through the importance-weight seam; then two real steps with workers."""
    from trl import GRPOTrainer

    common = dict(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=text_dataset())
    ours = AsyncGRPOTrainer(**common, args=async_args(tmp_path, max_steps=2, loss_type=loss_type))
    theirs = GRPOTrainer(
        **common, args=GRPOConfig(output_dir=str(tmp_path / "sync"), **{**COMMON, "loss_type": loss_type})
    )
    inputs = loss_batch(completion_mask=[[1, 1, 1], [1, 1, 0]])
    losses = []
    for trainer in (ours, theirs):
        mu = current_logps(trainer, inputs)
        batch = {**inputs, "sampling_per_token_logps": mu} if trainer is ours else dict(inputs)
        losses.append(trainer._compute_loss(trainer.model, batch).item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-5) and losses[0] != 0.0
    assert ours._metrics["train"]["is/ess"] == [pytest.approx(1.0)]  # the weight went through the seam

    ours._metrics["train"].clear()
    before = {n: p.detach().clone() for n, p in ours.model.named_parameters()}
    ours.train()
    logs = [h for h in ours.state.log_history if "loss" in h and "reward" in h]
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)
    assert any(not torch.equal(p, before[n]) for n, p in ours.model.named_parameters())
    if loss_type == "vespo":
        assert all("vespo/phi_seq_mean" in h for h in logs)


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["q_proj", "embed_tokens"]], ids=["attention", "embedding"])
def test_peft_lora_workers_receive_merged_weights(tmp_path, tiny_model_dir, targets):
    """peft keeps an embedding's adapter in lora_embedding_A/B, not lora_A/B: it must be merged too (on a model with
    untied embeddings; tied ones are refused, below)."""
    from peft import LoraConfig

    from trl_async.demo.tiny import save_tiny_model

    model_dir = str(save_tiny_model(tmp_path / "untied", tie_word_embeddings=False))
    # the merged path (adapter-only sync, the default where it applies, is tests/integration/test_lora_sync.py)
    args = async_args(
        tmp_path, max_steps=3, rollout_verify_weights=True, learning_rate=5e-2, rollout_lora_sync="merged"
    )
    kept = KeepPublished()
    trainer = AsyncGRPOTrainer(
        model=model_dir,
        reward_funcs=length_reward,
        args=args,
        train_dataset=text_dataset(),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False),
        callbacks=[kept],
    )
    kept.trainer = trainer
    trainer.train()
    pool = trainer.last_rollout_pool
    assert pool.verified_adoptions >= 2  # workers hashed exactly the merged weights the trainer published
    # the published tensors for the last version are the merged model: compare with peft's own merge
    merged = trainer.model.merge_and_unload()
    for name, tensor in merged.named_parameters():
        torch.testing.assert_close(kept.weights[name], tensor, rtol=0, atol=1e-6)


def test_lora_on_an_embedding_tied_to_the_output_layer_is_refused(tmp_path, tiny_model_dir):
    from peft import LoraConfig

    with pytest.raises(NotImplementedError, match=r"LoRA on `.*embed_tokens`, whose weight is tied to the output"):
        AsyncGRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, args=async_args(tmp_path),
                         train_dataset=text_dataset(),
                         peft_config=LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"]))  # fmt: skip


def test_eval_dataset_is_evaluated_with_current_weights(tmp_path, tiny_model_dir):
    args = async_args(tmp_path, max_steps=2, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=8)
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        args=args,
        train_dataset=text_dataset(),
        eval_dataset=text_dataset(8),
    )
    trainer.train()
    evals = [h for h in trainer.state.log_history if "eval_reward" in h]
    assert len(evals) == 1 and "eval_async/staleness_max" not in evals[0]  # synchronous, not from the queue
    # the same as GRPOTrainer.evaluate on the same weights, with the same random state
    from trl import GRPOTrainer

    reference = GRPOTrainer(model=copy.deepcopy(trainer.model), reward_funcs=length_reward, args=args,
                            train_dataset=text_dataset(), eval_dataset=text_dataset(8))  # fmt: skip
    results = []
    for t in (trainer, reference):
        torch.manual_seed(123)
        results.append(t.evaluate())
    assert results[0]["eval_reward"] == results[1]["eval_reward"]
    assert results[0]["eval_completions/mean_length"] == results[1]["eval_completions/mean_length"]


def test_fsdp1_and_quantized_models_are_refused_before_loading_anything(tmp_path, tiny_model_dir, monkeypatch):
    from transformers import BitsAndBytesConfig  # bitsandbytes itself is not installed: refused before it is needed

    supported = "Supported: one process, DDP, DeepSpeed ZeRO-2 and ZeRO-3, FSDP2, and LoRA on an unquantized base"
    common = dict(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=text_dataset())
    with pytest.raises(NotImplementedError, match=rf"FSDP1 .*fsdp_version: 2 in the accelerate config.*{supported}"):
        AsyncGRPOTrainer(**common, args=async_args(tmp_path, fsdp=True, fsdp_config={"version": 1}))
    quantized = BitsAndBytesConfig(load_in_4bit=True)
    with pytest.raises(NotImplementedError, match=rf"quantized models \(quantization_config\).*{supported}"):
        AsyncGRPOTrainer(**common, args=async_args(tmp_path), quantization_config=quantized)
    with pytest.raises(NotImplementedError, match=r"quantized models \(quantization_config\)"):
        AsyncGRPOTrainer(**common, args=async_args(tmp_path, model_init_kwargs={"quantization_config": quantized}))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what `accelerate launch` with an FSDP config sets
    with pytest.raises(NotImplementedError, match="FSDP1 .*accelerate's default where its config names no version"):
        AsyncGRPOTrainer(**common, args=async_args(tmp_path))  # (no FSDP_VERSION: accelerate's own default, 1)
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(NotImplementedError, match="FSDP1"):
        AsyncGRPOTrainer(**common, args=async_args(tmp_path))


def test_contradicting_engines_fail_at_construction(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match="rollout_backend='transformers' contradicts use_vllm=True"):
        async_args(tmp_path, use_vllm=True, rollout_backend="transformers")


def test_too_small_queue_fails_at_construction(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match=r"rollout_queue_size=1 .* >= 2"):
        AsyncGRPOTrainer(
            model=tiny_model_dir, reward_funcs=length_reward, args=async_args(tmp_path, rollout_queue_size=1),
            train_dataset=text_dataset(),
        )  # fmt: skip


def test_script_without_main_guard_trains_and_exits(tmp_path, tiny_model_dir):
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(f"""
        import os
        os.environ["OMP_NUM_THREADS"] = "1"
        from datasets import Dataset
        from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer
        print("TOP-LEVEL RAN", flush=True)
        ds = Dataset.from_list([{{"prompt": f"p{{i}}:"}} for i in range(8)])
        args = AsyncGRPOConfig(output_dir={str(tmp_path / "o")!r}, max_steps=2, per_device_train_batch_size=8,
            num_generations=4, max_completion_length=4, report_to=[], bf16=False, use_cpu=True,
            gradient_checkpointing=False, save_strategy="no")
        trainer = AsyncGRPOTrainer(model={tiny_model_dir!r}, args=args, train_dataset=ds,
            reward_funcs=lambda completions, **kw: [len(c) for c in completions])
        from multiprocessing import forkserver
        server = forkserver._forkserver
        print("FORKSERVER BEFORE TRAIN", server._forkserver_pid is not None
              and os.waitpid(server._forkserver_pid, os.WNOHANG)[0] == 0, server._preload_modules, flush=True)
        trainer.train()
        print("DONE", flush=True)
    """)
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("TOP-LEVEL RAN") == 1  # workers did not re-run the user's script
    assert "DONE" in out.stdout and no_rollout_children()
    # the workers' forkserver started with the trainer, importing what a worker needs while the trainer sets up
    assert "FORKSERVER BEFORE TRAIN True" in out.stdout and "'transformers.modeling_utils'" in out.stdout


def test_trajectory_file_records_every_consumed_completion(tmp_path, tiny_model_dir):

    def first_letter(prompts, completions, **kwargs):
        return [1.0 if c.startswith("a") else 0.0 for c in completions]

    args = async_args(tmp_path, max_steps=2, rollout_trajectory_file="traj/run.jsonl")
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir, reward_funcs=[first_letter, length_reward], args=args, train_dataset=text_dataset()
    )
    trainer.train()
    lines = [json.loads(x) for x in (tmp_path / "traj" / "run.jsonl").read_text().splitlines()]
    assert len(lines) == 2 * 8 and [x["step"] for x in lines] == [0] * 8 + [1] * 8  # every completion, once
    data = text_dataset()
    for x in lines:
        assert x["prompt"] == data[x["prompt_index"]]["prompt"]
        assert x["rewards"]["first_letter"] == (1.0 if x["completion"].startswith("a") else 0.0)
        assert x["rewards"]["length_reward"] == pytest.approx(length_reward([x["completion"]])[0])
        assert len(x["versions"]) >= len(x["completion"]) and x["staleness"] == x["step"] - min(x["versions"])
    for step in (0, 1):  # advantages: reward minus the group mean (scale_rewards="group": divided by the std)
        group = [x for x in lines if x["step"] == step][:4]
        assert sum(x["advantage"] for x in group) == pytest.approx(0.0, abs=1e-5)
    # the record is enough to recompute the importance weight: ids and mu per token. Completions sampled from the
    # initial weights (version 0) must have mu = log softmax of the initial model at temperature 1
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    first = [x for x in lines if set(x["versions"]) == {0}]
    assert first
    for x in first:
        assert len(x["completion_ids"]) == len(x["logprobs"]) == len(x["versions"])
        ids = torch.tensor([x["prompt_ids"] + x["completion_ids"]])
        with torch.no_grad():
            logits = model(ids).logits[0, len(x["prompt_ids"]) - 1 : -1]
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(x["completion_ids"])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(x["logprobs"]), expected, rtol=0, atol=1e-4)
