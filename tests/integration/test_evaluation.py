"""Greedy held-out accuracy: batched left-padded greedy decoding equals one prompt at a time, and the callback logs
it through the trainer's own evaluation."""

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_async import AsyncGRPOTrainer
from trl_async.demo import evaluation
from trl_async.demo.evaluation import GreedyAccuracyCallback, greedy_completions

from ..conftest import async_args


def _first_char_reward(completions, target, **kwargs):
    return [1.0 if c[0]["content"][:1] == t else 0.0 for c, t in zip(completions, target, strict=True)]


def test_greedy_accuracy_is_logged_by_evaluate_and_matches_unbatched_greedy(tmp_path, tiny_model_dir, monkeypatch):
    # prompts of different lengths, so a batch needs padding (left, or the completions would differ)
    questions = ["a", "bb c", "d", "eee ffff", "g h", "ii"]
    prompts = [[{"role": "user", "content": q}] for q in questions]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    expected = []
    for p in prompts:  # one at a time: no padding at all
        ids = tok.apply_chat_template(p, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
        expected.append(tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True))
    targets = [e[:1] for e in expected]
    targets[1] = "#"  # one wrong answer: accuracy 5/6
    heldout = Dataset.from_list([{"prompt": p, "target": t} for p, t in zip(prompts, targets, strict=True)])

    args = async_args(
        tmp_path, max_steps=1, max_completion_length=4, per_device_eval_batch_size=6, num_generations_eval=2
    )
    train = Dataset.from_list([{"prompt": [{"role": "user", "content": f"x{i}"}]} for i in range(8)])
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=train,
        eval_dataset=heldout,
    )
    assert greedy_completions(trainer, prompts, max_new_tokens=4, batch_size=4) == expected  # batches of 4 + 2
    # a second score of the same greedy completions: the two-character prefix, right only where the completion's
    # first two characters are the expected ones (all six, by construction of the targets below)
    two_chars = [e[:2] for e in expected]

    def prefix_reward(completions, **kwargs):
        return [1.0 if c[0]["content"][:2] == t else 0.0 for c, t in zip(completions, two_chars, strict=True)]

    callback = GreedyAccuracyCallback(trainer, heldout, _first_char_reward, also={"prefix": prefix_reward})
    trainer.add_callback(callback)
    generated = []  # every score of an evaluation comes from one greedy generation
    monkeypatch.setattr(evaluation, "greedy_completions",
                        lambda *a, **k: generated.append(1) or greedy_completions(*a, **k))  # fmt: skip
    trainer.evaluate()
    assert len(generated) == 1
    logged = [h for h in trainer.state.log_history if "eval_greedy_accuracy" in h]
    assert [h["eval_greedy_accuracy"] for h in logged] == [5 / 6] and callback.history == [(0, 5 / 6)]
    assert [h["eval_greedy_prefix"] for h in logged] == [1.0]
    assert callback.scores == [(0, {"accuracy": 5 / 6, "prefix": 1.0})]
    for taken in ("accuracy", "seconds"):  # names the callback logs already
        with pytest.raises(ValueError, match=taken):
            GreedyAccuracyCallback(trainer, heldout, _first_char_reward, also={taken: prefix_reward})


def test_greedy_evaluation_runs_in_the_trainers_compute_precision_before_training_too(tmp_path, tiny_model_dir):
    """accelerate wraps the model's forward in autocast only once train() prepares it: an evaluation before training
    must still run under the trainer's autocast (bf16 here), or a before/after comparison measures precision."""
    args = async_args(tmp_path, max_steps=1, max_completion_length=4, bf16=True)
    train = Dataset.from_list([{"prompt": [{"role": "user", "content": f"x{i}"}]} for i in range(8)])
    trainer = AsyncGRPOTrainer(model=tiny_model_dir, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                               args=args, train_dataset=train)  # fmt: skip
    seen = []
    hook = trainer.model.register_forward_pre_hook(
        lambda *_: seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
    )
    try:
        greedy_completions(trainer, [[{"role": "user", "content": "a"}]], max_new_tokens=2, batch_size=1)
    finally:
        hook.remove()
    assert seen and set(seen) == {(True, torch.bfloat16)}
