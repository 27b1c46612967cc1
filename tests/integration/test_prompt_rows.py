"""What trains is what was sampled: a dataset row is read once, when its group is admitted, and that reading (its
rendered prompt and its columns) is what the workers sample from, what the rewards score and what GRPOTrainer's loss
trains on. A row read again later can differ: a chat template that prints today's date, a dataset with a random
on-the-fly transform."""

import datetime as real_datetime
import json
import random

from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback
from transformers.utils import chat_template_utils

from trl_async import AsyncGRPOTrainer
from trl_async.demo.tiny import CHAT_TEMPLATE

from ..conftest import async_args


def _count_reward(completions, **kwargs):
    return [sum(ch == "a" for ch in c[0]["content"]) / 6 for c in completions]


def test_a_template_that_prints_the_date_trains_across_midnight(tmp_path, tiny_model_dir, monkeypatch):
    clock = {"day": 1}

    class Clock(real_datetime.datetime):  # the date transformers' strftime_now reads, moved on by the test
        @classmethod
        def now(cls, tz=None):
            return real_datetime.datetime(2026, 12, clock["day"], 23, 59)

    monkeypatch.setattr(chat_template_utils, "datetime", Clock)

    class Midnight(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                clock["day"] = 2

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = "{{ strftime_now('%d') }}\n" + CHAT_TEMPLATE  # as Llama-3.x prints "Today Date:"
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": f"hi {i}"}]} for i in range(16)])
    args = async_args(tmp_path, max_steps=5, max_staleness=2, rollout_trajectory_file="traj.jsonl")
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir, reward_funcs=_count_reward, args=args, train_dataset=ds, processing_class=tokenizer,
        callbacks=[Midnight()],
    )  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 5
    rows = [json.loads(line) for line in open(tmp_path / "traj.jsonl")]
    days = {(r["step"], tokenizer.decode(r["prompt_ids"][:2])) for r in rows}
    # groups rendered on the 1st trained after midnight (max_staleness 2 admits ahead), and the 2nd's trained too
    assert any(step > 2 and day == "01" for step, day in days) and any(day == "02" for _, day in days)


def test_a_dataset_with_a_random_transform_scores_and_trains_the_reading_that_was_sampled(tmp_path, tiny_model_dir):
    rng = random.Random(0)

    def random_suffix(batch):  # a fresh random draw on every read of a row
        nonces = [rng.choice("xyz") for _ in batch["prompt"]]
        return {"prompt": [f"{p}{n}:" for p, n in zip(batch["prompt"], nonces, strict=True)], "nonce": nonces}

    ds = Dataset.from_list([{"prompt": f"p{i}"} for i in range(16)])
    ds.set_transform(random_suffix)
    assert {ds[0]["nonce"] for _ in range(20)} == {"x", "y", "z"}  # the transform does draw again on each read
    mismatched, scored = [], []

    def nonce_reward(prompts, completions, nonce, **kwargs):  # the row's column must belong to the prompt it scores
        for p, n in zip(prompts, nonce, strict=True):
            scored.append(p)
            if not p.endswith(f"{n}:"):
                mismatched.append((p, n))
        return [c.count("a") / 6 for c in completions]

    args = async_args(tmp_path, max_steps=4, rollout_trajectory_file="traj.jsonl")
    trainer = AsyncGRPOTrainer(model=tiny_model_dir, reward_funcs=nonce_reward, args=args, train_dataset=ds)
    trainer.train()
    assert trainer.state.global_step == 4 and scored and not mismatched
    tokenizer = trainer.processing_class
    for r in (json.loads(line) for line in open(tmp_path / "traj.jsonl")):
        sampled = tokenizer.decode(r["prompt_ids"])
        assert sampled == r["prompt"]  # the prompt text logged is the one sampled from
        assert sampled in scored  # and the one the rewards scored


def test_the_pools_rendering_of_a_prompt_is_grpo_trainers(tmp_path, tiny_model_dir, tool_model_dir):
    """The pool renders each prompt once (setup.rendering.make_tokenize_row) and GRPOTrainer trains on that rendering, so it
    must be GRPOTrainer's own: plain text, messages, with chat_template_kwargs, with tools."""
    from trl import GRPOTrainer

    from trl_async.setup.rendering import make_tokenize_row
    from trl_async.setup.trainer_view import pool_inputs

    from ..tool_model import multiply

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = "{% if shout %}?{% endif %}" + CHAT_TEMPLATE  # a template argument changes the text
    text = Dataset.from_list([{"prompt": "p1:"}, {"prompt": "p22:"}])
    chat = Dataset.from_list([{"prompt": [{"role": "user", "content": "hi 3"}]}] * 2)
    cases = [
        (tiny_model_dir, tokenizer, text, {}, None),
        (tiny_model_dir, tokenizer, chat, {}, None),
        (tiny_model_dir, tokenizer, chat, {"chat_template_kwargs": {"shout": True}}, None),
        (tool_model_dir, None, chat, {}, [multiply]),  # its template renders the tools' schema
    ]
    seen = set()
    for model, processing_class, ds, extra, tools in cases:
        args = async_args(tmp_path, max_steps=1, **extra)
        trainer = AsyncGRPOTrainer(model=model, reward_funcs=_count_reward, args=args, train_dataset=ds,
                                   processing_class=processing_class, tools=tools)  # fmt: skip
        ours, _ = make_tokenize_row(pool_inputs(trainer))(0, ds[0])
        theirs = GRPOTrainer._tokenize_prompts(trainer, [ds[0]["prompt"]])[0][0]
        decode = trainer.processing_class.decode
        assert list(ours) == list(theirs), (extra, tools, decode(ours), decode(theirs))
        seen.add(decode(ours))
    assert len(seen) == 4  # each case rendered differently: the comparison covers what each option changes
