"""Continuous batching in the worker (in-process, the tiny model), both engines (the slot loop a CPU worker runs,
transformers' paged engine a GPU worker runs): rows that join a running batch, groups that leave it as they finish,
and weights swapped between two decode steps, each token tagged with the version that produced it and carrying its
behaviour log-prob."""

import time

import pytest
import torch
from transformers import GenerationConfig

from trl_async import AsyncGRPOTrainer
from trl_async.correction.sampling import processed_logps, processors, settings_of
from trl_async.demo.tiny import build_char_tokenizer, build_tiny_model
from trl_async.engines.transformers.continuous import ContinuousRows
from trl_async.engines.transformers.slots import SlotRows
from trl_async.records import RolloutTask

from ..conftest import async_args, letter_reward, text_dataset
from .test_worker import TEMPERATURE, TOP_K, _teacher_forced_logps


def _setup(max_new_tokens=10, eos=True, seed=0):
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, seed=seed).eval()
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=True,
        temperature=TEMPERATURE,
        top_k=TOP_K,
        top_p=1.0,
        pad_token_id=tok.pad_token_id,
        eos_token_id=[tok.eos_token_id] if eos else [],
    )
    return tok, model, config


ENGINES = pytest.mark.parametrize("engine", [SlotRows, ContinuousRows], ids=["slots", "paged"])


def _some_steps(rows) -> None:
    """Let the rows decode a little (none may finish): the slot loop steps when asked, the paged engine on a thread."""
    if isinstance(rows, SlotRows):
        for _ in range(15):
            assert not rows.finished()
    else:
        time.sleep(0.05)


def _run(rows, timeout_s=60.0):
    done, deadline = [], time.monotonic() + timeout_s
    while rows.busy:
        assert time.monotonic() < deadline, "rows never finished"
        done += rows.finished(0.2)
    return done


@ENGINES
def test_rows_that_join_mid_batch_carry_the_log_probs_of_the_distribution_they_sampled(engine):
    tok, model, config = _setup()
    version = {"v": 3}
    # 3 groups of 4 rows through 3 slots: most rows start when another row's slot frees up
    rows = engine(model, config, 4, [tok.eos_token_id], slots=3, max_context=64, current_version=lambda: 3,
                  pad_token_id=tok.pad_token_id)  # fmt: skip
    try:
        prompts = [tuple(tok(text)["input_ids"]) for text in ("ab 1+2=", "zz", "q 7")]
        torch.manual_seed(1)
        rows.submit([RolloutTask(i, i, p, 0) for i, p in enumerate(prompts)])
        groups = rows.finished() if engine is SlotRows else []  # the slot loop takes rows when it steps
        assert rows.active == 3 and len(rows.waiting) == 9  # the slots bound the rows decoding at once
        groups += _run(rows)
    finally:
        rows.close()
    assert sorted(g.group_id for g in groups) == [0, 1, 2]
    checked = 0
    for group in groups:
        assert len(group.completion_ids) == 4 and group.prompt_ids == prompts[group.group_id]
        for completion, logps, versions in zip(group.completion_ids, group.logprobs, group.versions, strict=True):
            torch.testing.assert_close(
                torch.tensor(logps), _teacher_forced_logps(model, group.prompt_ids, completion), atol=1e-5, rtol=0
            )
            assert versions == (version["v"],) * len(completion)
            assert tok.eos_token_id not in completion[:-1]
            checked += len(completion)
    assert checked >= 12


@ENGINES
def test_a_short_group_leaves_before_a_long_one_that_started_first(engine):
    tok, model, config = _setup(max_new_tokens=40, eos=False)
    rows = engine(model, config, 2, [], slots=4, max_context=64, current_version=lambda: 0)
    try:
        long = RolloutTask(0, 0, (5, 6, 7), 0)
        short = RolloutTask(1, 1, (), 0, contexts=((8, 9), (10, 11)), rows=(0, 1), max_new_tokens=3)
        rows.submit([long, short])
        first = []
        while not first:
            first = rows.finished(0.2)
        assert [g.group_id for g in first] == [1]  # the later turn's 3-token budget: done while the long one decodes
        assert all(len(c) == 3 for c in first[0].completion_ids) and first[0].rows == (0, 1)
        (rest,) = _run(rows)
        assert rest.group_id == 0 and all(len(c) == 40 for c in rest.completion_ids)
    finally:
        rows.close()


@ENGINES
def test_weights_swapped_between_decode_steps_give_each_token_its_versions_distribution(engine):
    """The swap resets the rows in flight (their KV prefilled again with the new weights): every token's mu is a
    teacher-forced forward of its own version, the tokens before the swap of the old one, after it of the new one."""
    tok, model, config = _setup(max_new_tokens=120, eos=False)
    weights = {0: {k: v.clone() for k, v in model.state_dict().items()}, 1: build_tiny_model(tok, seed=1).state_dict()}
    state = {"v": 0}

    def adopt():
        model.load_state_dict(weights[1])
        state["v"] = 1

    rows = engine(model, config, 2, [], slots=2, max_context=256, current_version=lambda: state["v"])
    try:
        rows.submit([RolloutTask(0, 0, (5, 6, 7), 0), RolloutTask(1, 1, (8, 9), 0)])  # group 1 waits for a slot
        _some_steps(rows)  # some of group 0's 120 decode steps
        rows.swap(adopt)
        groups = {g.group_id: g for g in _run(rows)}
    finally:
        rows.close()
    assert any(0 in v for v in groups[0].versions) and any(1 in v for g in groups.values() for v in g.versions)
    checked = 0
    for group in groups.values():
        for completion, logps, versions in zip(group.completion_ids, group.logprobs, group.versions, strict=True):
            switch = versions.index(1) if 1 in versions else len(versions)
            assert versions == (0,) * switch + (1,) * (len(versions) - switch)  # old weights, then new, never back
            for version, span in ((0, slice(0, switch)), (1, slice(switch, None))):
                model.load_state_dict(weights[version])
                expected = _teacher_forced_logps(model, group.prompt_ids, completion)
                torch.testing.assert_close(torch.tensor(logps)[span], expected[span], atol=1e-5, rtol=0)
                checked += len(completion[span])
    assert checked == 4 * 120


def test_the_slot_loop_applies_the_repetition_penalty_and_min_new_tokens_per_row_as_the_trainer_rebuilds_them():
    """Each row's penalty reads its own context (never the padding of a narrower row, nor a free slot's columns), and
    min_new_tokens counts its own tokens: rows join mid-batch with contexts of different widths, and weights swap
    between two steps. Every token's mu must equal the trainer's rebuild (``processed_logps``) from a teacher-forced
    forward of the token's version."""
    tok, model, config = _setup(max_new_tokens=12)
    config.repetition_penalty, config.min_new_tokens = 1.8, 4
    weights = {0: {k: v.clone() for k, v in model.state_dict().items()}, 1: build_tiny_model(tok, seed=1).state_dict()}
    state = {"v": 0}

    def adopt():
        model.load_state_dict(weights[1])
        state["v"] = 1

    eos = config.eos_token_id
    # padding with a token the rows could sample ("a"; the pad token's own logit is 0, which a penalty leaves alone)
    rows = SlotRows(model, config, 3, eos, slots=4, max_context=0, current_version=lambda: state["v"],
                    pad_token_id=tok("a")["input_ids"][0])  # fmt: skip
    prompts = [tuple(tok(text)["input_ids"]) for text in ("ab 1+2=", "z", "q 7 c 5 d 9 e")]
    torch.manual_seed(2)
    rows.submit([RolloutTask(i, i, p, 0) for i, p in enumerate(prompts)])
    groups = []
    for _ in range(6):
        groups += rows.finished()
    rows.swap(adopt)
    groups += _run(rows)
    settings = settings_of("transformers", config.to_dict())
    chain = processors(settings)
    assert settings.repetition_penalty == 1.8 and settings.min_new_tokens == 4 and settings.stop_ids == tuple(eos)
    checked, repeats = 0, 0
    for group in groups:
        for completion, logps, versions in zip(group.completion_ids, group.logprobs, group.versions, strict=True):
            assert len(completion) >= 4 and all(t not in eos for t in completion[:4])  # no stop before 4 tokens
            for version in set(versions):
                model.load_state_dict(weights[version])
                ids = torch.tensor([list(group.prompt_ids) + list(completion)])
                with torch.no_grad():
                    logits = model(input_ids=ids).logits[0, len(group.prompt_ids) - 1 : -1]
                expected = processed_logps(logits, torch.tensor(group.prompt_ids), torch.tensor(completion), chain,
                                           settings)  # fmt: skip
                mine = [i for i, v in enumerate(versions) if v == version]
                torch.testing.assert_close(torch.tensor(logps)[mine], expected[mine], atol=1e-5, rtol=0)
                checked += len(mine)
            repeats += len(completion) - len(set(completion))
    assert checked == sum(len(c) for g in groups for c in g.completion_ids) >= 9 * 4
    assert {v for g in groups for vs in g.versions for v in vs} == {0, 1} and repeats > 0  # the penalty had work


def test_a_row_finished_before_a_swap_but_not_yet_collected_keeps_the_old_version():
    tok, model, config = _setup(max_new_tokens=3, eos=False)
    state = {"v": 0}

    def adopt():
        model.load_state_dict(build_tiny_model(tok, seed=1).state_dict())
        state["v"] = 1

    rows = ContinuousRows(model, config, 2, [], slots=2, max_context=64, current_version=lambda: state["v"])
    try:
        old = {k: v.clone() for k, v in model.state_dict().items()}
        rows.submit([RolloutTask(0, 0, (5, 6, 7), 0)])
        deadline = time.monotonic() + 30
        while rows.manager.output_router.output_queue.qsize() < 2:  # both rows done, their results not collected
            assert time.monotonic() < deadline
            time.sleep(0.01)
        rows.swap(adopt)
        (group,) = _run(rows)
    finally:
        rows.close()
    model.load_state_dict(old)
    for completion, logps, versions in zip(group.completion_ids, group.logprobs, group.versions, strict=True):
        assert versions == (0, 0, 0)
        torch.testing.assert_close(
            torch.tensor(logps), _teacher_forced_logps(model, (5, 6, 7), completion), atol=1e-5, rtol=0
        )


def test_a_trainer_with_a_repetition_penalty_and_min_new_tokens_batches_continuously_on_a_cpu(
    tmp_path, tiny_model_dir
):
    args = async_args(tmp_path, max_steps=2, use_transformers_continuous_batching=True, repetition_penalty=1.3,
                      generation_kwargs={"min_new_tokens": 3})  # fmt: skip
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir, reward_funcs=letter_reward, args=args, train_dataset=text_dataset()
    )
    trainer.train()
    assert all(spec.slots > 0 for spec in trainer.last_rollout_pool.backend.specs)
    logs = [h for h in trainer.state.log_history if "completions/min_length" in h]
    assert len(logs) == 2 and min(h["completions/min_length"] for h in logs) >= 3


def test_a_sampler_continuous_batching_cannot_reproduce_is_refused_at_construction(tmp_path, tiny_model_dir):
    # the slot loop applies a repetition penalty, transformers' paged engine (configured here) does not
    paged = dict(transformers_continuous_batching_config={"scheduler_type": "fifo"})
    args = async_args(tmp_path, use_transformers_continuous_batching=True, repetition_penalty=1.1, **paged)
    with pytest.raises(
        ValueError, match=r"use_transformers_continuous_batching=True is invalid.*repetition_pen.*paged"
    ):
        AsyncGRPOTrainer(model=tiny_model_dir, reward_funcs=letter_reward, args=args, train_dataset=text_dataset())
    # neither applies a no-repeat n-gram ban (which the ratio does not rebuild either: off here)
    args = async_args(tmp_path, use_transformers_continuous_batching=True, generation_kwargs={"no_repeat_ngram_size": 2},
                      off_policy_correction="none")  # fmt: skip
    with pytest.raises(
        ValueError, match=r"use_transformers_continuous_batching=True is invalid.*no_repeat_ngram_size"
    ):
        AsyncGRPOTrainer(model=tiny_model_dir, reward_funcs=letter_reward, args=args, train_dataset=text_dataset())


def test_a_swap_after_rows_were_evicted_for_lack_of_cache_does_not_stall_them():
    """A KV cache too small for the rows makes transformers evict one and hold new rows back until another finishes;
    a swap resets every active row, and the rows must go on (not wait for a finish that can no longer come)."""
    tok, model, config = _setup(max_new_tokens=120, eos=False)
    state = {"v": 0}

    def adopt():
        state["v"] = 1

    rows = ContinuousRows(model, config, 4, [], slots=4, max_context=32, current_version=lambda: state["v"])
    try:
        rows.submit([RolloutTask(0, 0, tuple(range(5, 45)), 0)])  # 4 rows of 40 + 120 tokens: cache for 32 each
        deadline = time.monotonic() + 60
        while True:  # until an eviction holds new rows back
            processor = rows.manager.batch_processor
            if processor is not None and processor.scheduler.block_new_requests:
                break
            assert time.monotonic() < deadline and rows.busy, "no eviction"
            rows.finished(0.01)
        rows.swap(adopt)
        (group,) = _run(rows, timeout_s=120)
    finally:
        rows.close()
    assert all(len(c) == 120 for c in group.completion_ids)
    for versions in group.versions:
        switch = versions.index(1) if 1 in versions else len(versions)
        assert versions == (0,) * switch + (1,) * (len(versions) - switch)


WIDE = tuple(5 + i % 40 for i in range(40))


def test_slot_rows_of_every_width_join_and_leave_and_the_columns_no_row_uses_are_cut_off():
    """Rows join a running batch with contexts wider and narrower than it, and leave it at different steps: every
    token's mu is still a teacher-forced forward of its row. A wide row widens the cache; once it has left, the next
    re-layout (at most ``room`` steps later) cuts off the columns no other row uses, and no step ever cuts a used
    one."""
    tok, model, config = _setup(max_new_tokens=30, eos=False)
    rows = SlotRows(model, config, 1, [], slots=3, max_context=0, current_version=lambda: 0, pad_token_id=0, room=2)
    long_ = RolloutTask(0, 0, (5, 6, 7), 0)  # 30 tokens
    short = RolloutTask(1, 1, (), 0, contexts=((8, 9),), rows=(0,), max_new_tokens=4)
    wide = RolloutTask(2, 2, (), 0, contexts=(WIDE,), rows=(0,), max_new_tokens=6)  # 40 > width
    narrow = RolloutTask(3, 3, (), 0, contexts=((11,),), rows=(0,), max_new_tokens=12)
    groups, steps = [], []  # per step: (groups done, the cache's width, its longest row's cached tokens)
    rows.submit([long_, short])
    for task in (wide, narrow, None):
        while rows.busy and len(groups) < (task.group_id - 1 if task else 4):
            groups += rows.finished()
            longest = max((int(rows.mask[i].sum()) for i in rows.live), default=0)
            steps.append(({g.group_id for g in groups}, rows.mask.size(1), longest))
        if task:
            rows.submit([task])
    assert sorted(g.group_id for g in groups) == [0, 1, 2, 3]
    for group in groups:
        (completion,), (logps,) = group.completion_ids, group.logprobs
        context = group.prompt_ids or {1: (8, 9), 2: WIDE, 3: (11,)}[group.group_id]
        torch.testing.assert_close(
            torch.tensor(logps), _teacher_forced_logps(model, context, completion), atol=1e-5, rtol=0
        )
    assert [len(g.completion_ids[0]) for g in sorted(groups, key=lambda g: g.group_id)] == [30, 4, 6, 12]
    assert all(width >= longest for _, width, longest in steps)  # no used column cut off
    assert max(width for _, width, _ in steps) >= 40  # the wide row widened the cache
    after = [(width, longest) for done, width, longest in steps if 2 in done and 0 not in done]  # long_ decoding
    assert len(after) > 3 and after[3][0] == after[3][1], after  # cut back to the longest row within 2 + 1 steps
    assert not rows.busy and rows.past is None


def _check_layout(rows: SlotRows) -> None:
    """The slot loop's invariants: one width for the cache, ids and mask; each live row's tokens right-aligned."""
    width = rows.mask.size(1)
    assert rows.ids.size(1) == width and rows.last.size(0) == len(rows.rows) == rows.mask.size(0)
    for layer in rows.past.layers if rows.past is not None else ():
        assert layer.width == width == layer.keys.size(2) and layer.keys.size(0) == len(rows.rows)
    for i in rows.live:
        n = int(rows.mask[i].sum())
        assert rows.mask[i].tolist() == [0] * (width - n) + [1] * n and int(rows.last[i]) == rows.rows[i].tokens[-1]


@pytest.mark.parametrize("room", [0, 3, 32])
def test_slot_rows_under_random_arrivals_budgets_eos_and_swaps_keep_their_layout_and_log_probs(room):
    """Groups of two rows arrive at random, with contexts of 1 to 45 tokens, budgets of 1 to 12 and three EOS tokens;
    weights swap at random steps. After every step the layout holds, and at the end every token's mu is a
    teacher-forced forward of its version: every path of the loop (a first join, joins in place, a joiner wider than
    the cache, more joiners than free slots, rows done at their first token, re-layouts for room and for a tail,
    swaps with free slots) is taken."""
    import random

    tok, model, config = _setup(max_new_tokens=12, eos=False)
    weights = {0: {k: v.clone() for k, v in model.state_dict().items()}, 1: build_tiny_model(tok, seed=1).state_dict()}
    state = {"v": 0}

    def adopt():
        state["v"] ^= 1
        model.load_state_dict(weights[state["v"]])

    eos = [5, 6, 7]
    rows = SlotRows(model, config, 2, eos, slots=4, max_context=0, current_version=lambda: state["v"], pad_token_id=0,
                    room=room)  # fmt: skip
    rng, contexts, groups = random.Random(room), {}, []
    torch.manual_seed(room)
    for _ in range(200):
        if rng.random() < 0.15:
            for _ in range(rng.randint(1, 3)):
                gid = len(contexts)
                contexts[gid] = tuple(
                    tuple(rng.randint(3, 30) for _ in range(rng.choice([1, 2, 3, 8, 20, 45]))) for _ in range(2)
                )
                rows.submit([RolloutTask(gid, gid, (), 0, contexts=contexts[gid], rows=(0, 1),
                                         max_new_tokens=rng.choice([1, 2, 5, 12]))])  # fmt: skip
        if rng.random() < 0.05:
            rows.swap(adopt)
            _check_layout(rows)
        groups += rows.finished()
        _check_layout(rows)
    groups += _run(rows)
    assert sorted(g.group_id for g in groups) == list(range(len(contexts))) and rows.past is None
    checked = 0
    for version in (0, 1):
        model.load_state_dict(weights[version])
        for group in groups:
            for context, completion, logps, versions in zip(contexts[group.group_id], group.completion_ids,
                                                            group.logprobs, group.versions, strict=True):  # fmt: skip
                assert all(t not in eos for t in completion[:-1])
                mine = [i for i, v in enumerate(versions) if v == version]
                if mine:
                    expected = _teacher_forced_logps(model, context, completion)[mine]
                    torch.testing.assert_close(torch.tensor(logps)[mine], expected, atol=1e-5, rtol=0)
                    checked += len(mine)
    assert checked > 300


def build_tiny_hybrid_model(tok, seed=0):
    """A Qwen3.5 language model of a linear-attention (gated delta rule) layer and a full-attention one: its cache
    holds a recurrent state beside keys and values, which neither the slot loop nor transformers' paged cache holds."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=256,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    return Qwen3_5ForCausalLM(config)


def test_a_linear_attention_model_trains_in_static_batches_and_continuous_batching_is_refused_at_construction(
    tmp_path,
):
    """A Qwen3.5 language model (GRPOTrainer trains it; its cache keeps a recurrent state for the linear-attention
    layer): the workers' static batches sample it exactly (every ratio 1 at staleness 0), while continuous batching,
    whose paged cache cannot hold that state, is refused when the trainer is built rather than in a worker."""
    tok = build_char_tokenizer()
    build_tiny_hybrid_model(tok).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    model = str(tmp_path / "model")
    args = async_args(tmp_path, max_steps=2, max_staleness=0, use_transformers_continuous_batching=True)
    with pytest.raises(ValueError, match="use_transformers_continuous_batching=True cannot serve .*linear_attention"):
        AsyncGRPOTrainer(model=model, reward_funcs=letter_reward, args=args, train_dataset=text_dataset())
    args = async_args(tmp_path, max_steps=2, max_staleness=0, learning_rate=0.05)
    trainer = AsyncGRPOTrainer(model=model, reward_funcs=letter_reward, args=args, train_dataset=text_dataset())
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "linear_attn" in n}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "is/ratio_min" in h]
    assert len(logs) == 2
    for h in logs:
        assert abs(h["is/ratio_min"] - 1) < 1e-3 and abs(h["is/ratio_max"] - 1) < 1e-3, h
    assert any(not torch.equal(p.detach(), before[n]) for n, p in trainer.model.named_parameters() if n in before)
