"""The worker's generation: behaviour log-probs, version tags, EOS handling (in-process; no spawn needed)."""

import torch
from transformers import GenerationConfig

from trl_async.demo.tiny import build_char_tokenizer, build_tiny_model
from trl_async.engines.transformers.worker import generate_groups
from trl_async.records import RolloutTask

TEMPERATURE, TOP_K = 0.7, 6


def _setup(seed=0):
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, seed=seed).eval()
    config = GenerationConfig(
        max_new_tokens=10,
        do_sample=True,
        temperature=TEMPERATURE,
        top_k=TOP_K,
        top_p=1.0,
        pad_token_id=tok.pad_token_id,
        eos_token_id=[tok.eos_token_id],
    )
    return tok, model, config


def _teacher_forced_logps(model, prompt, completion):
    """log-probs of ``completion`` under softmax(top_k(logits / T)), computed by hand from one full forward pass."""
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1] / TEMPERATURE
    kth = logits.topk(TOP_K, dim=-1).values[:, -1:]
    logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_behaviour_logprobs_equal_teacher_forced_sampling_distribution():
    tok, model, config = _setup()
    prompt = tuple(tok("ab 1+2=")["input_ids"])
    torch.manual_seed(1)
    tasks = [RolloutTask(0, 0, prompt, 0), RolloutTask(1, 1, tuple(tok("zz")["input_ids"]), 0)]  # ragged: left pad
    groups = generate_groups(model, tasks, config, 4, [tok.eos_token_id], tok.pad_token_id, lambda: 3)
    assert [g.group_id for g in groups] == [0, 1]
    checked = 0
    for group in groups:
        assert len(group.completion_ids) == 4
        for completion, logps, versions in zip(group.completion_ids, group.logprobs, group.versions, strict=True):
            expected = _teacher_forced_logps(model, group.prompt_ids, completion)
            torch.testing.assert_close(torch.tensor(logps), expected, atol=1e-5, rtol=0)
            assert set(versions) == {3} and len(versions) == len(completion)
            checked += len(completion)
    assert checked >= 8


def test_completions_are_cut_after_the_first_eos():
    tok, model, config = _setup()
    eos = tok.eos_token_id
    config.sequence_bias = {(eos,): 2.5}  # EOS likely enough that completions end at different steps
    torch.manual_seed(0)
    groups = generate_groups(model, [RolloutTask(0, 0, (5, 6, 7), 0)], config, 8, [eos], tok.pad_token_id, lambda: 0)
    completions = groups[0].completion_ids
    for c, logps in zip(completions, groups[0].logprobs, strict=True):
        assert eos not in c[:-1]  # nothing after the first EOS (the batch keeps padding the finished rows)
        assert c[-1] == eos or len(c) == config.max_new_tokens
        assert len(logps) == len(c)
    lengths = {len(c) for c in completions}
    assert len(lengths) > 1 and min(lengths) < config.max_new_tokens


def test_in_flight_update_tags_each_token_with_the_version_that_produced_it():
    tok, model, config = _setup()
    state = {"version": 0, "steps": 0}
    other = build_tiny_model(tok, seed=1)

    def between_steps():  # after the 3rd decode step, adopt "version 1" weights
        state["steps"] += 1
        if state["steps"] == 3:
            model.load_state_dict(other.state_dict())
            state["version"] = 1

    config.eos_token_id = []  # no early stop: 10 tokens each
    groups = generate_groups(
        model,
        [RolloutTask(0, 0, (5, 6, 7), 0)],
        config,
        2,
        [],
        tok.pad_token_id,
        lambda: state["version"],
        between_steps,
    )
    for versions in groups[0].versions:
        assert versions == (0, 0, 0) + (1,) * 7  # tokens 0-2 from version 0's logits, the rest from version 1
    assert groups[0].token_versions.count(0) == 6


def test_policy_copy_decodes_with_the_kv_cache_even_when_training_turned_it_off():
    from types import SimpleNamespace

    from trl_async.engines.transformers.worker import build_policy_copy

    tok = build_char_tokenizer()
    trained = build_tiny_model(tok)
    trained.config.use_cache = False  # as the trainer's model config arrives (training runs without the cache)
    spec = SimpleNamespace(model_class=type(trained), model_config=trained.config, device="cpu", dtype=torch.float32)
    model = build_policy_copy(spec)
    assert trained.config.use_cache is False  # the trainer's config is not modified
    lengths = []
    model.model.register_forward_pre_hook(
        lambda m, args, kw: lengths.append(kw["input_ids"].shape[1]), with_kwargs=True
    )
    config = GenerationConfig(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    generate_groups(
        model, [RolloutTask(0, 0, (5, 6, 7), 0)], config, 2, [tok.eos_token_id], tok.pad_token_id, lambda: 0
    )
    assert lengths == [3, 1, 1, 1, 1]  # prompt once, then one new token per step (no re-run of the whole sequence)


def test_policy_copy_built_without_initialisation_keeps_tied_weights_one_tensor_and_every_parameter_published():
    """Workers skip the random initialisation (every parameter is overwritten by the published weights); transformers
    5 then also skips tying, so the copy ties again: an untied lm_head would be a parameter nobody publishes, left
    holding whatever memory it was given. ``unpublished_parameters`` is the check a worker makes before generating."""
    from types import SimpleNamespace

    from trl_async.engines.transformers.worker import build_policy_copy, unpublished_parameters

    tok = build_char_tokenizer()
    trained = build_tiny_model(tok)  # tie_word_embeddings=True
    spec = SimpleNamespace(model_class=type(trained), model_config=trained.config, device="cpu", dtype=torch.float32)
    model = build_policy_copy(spec)
    published = {name for name, _ in trained.named_parameters()}  # what the trainer publishes (tied: once)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert unpublished_parameters(model, published) == []
    assert unpublished_parameters(model, published - {"model.norm.weight"}) == ["model.norm.weight"]
    untied = build_tiny_model(tok, tie_word_embeddings=False)
    assert unpublished_parameters(untied, published) == ["lm_head.weight"]


def test_worker_module_imports_neither_trl_nor_the_trainer():
    # a rollout worker process imports trl_async.engines.transformers.worker; pulling in TRL/peft/the trainer there cost ~6 s per start
    import subprocess
    import sys

    code = "import sys, trl_async.engines.transformers.worker; print(sorted(m for m in ('trl', 'peft', 'trl_async.trainer') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


_PEAK_MEMORY_SCRIPT = """
import resource, sys, torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM
from trl_async.records import RolloutTask
from trl_async.engines.transformers.worker import generate_groups
torch.set_num_threads(1)
torch.manual_seed(0)
vocab, rows, new_tokens = 50_000, 8, 256
model = Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512)).eval()
config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, temperature=0.9,
                          top_k=0, pad_token_id=0, eos_token_id=[1])
generate_groups(model, [RolloutTask(0, 0, (5, 6, 7), 0)], GenerationConfig(max_new_tokens=2, pad_token_id=0), 1, [1], 0,
                lambda: 0)  # load what generate loads lazily; far smaller than the call measured
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
groups = generate_groups(model, [RolloutTask(0, 0, (5, 6, 7), 0)], config, rows, [1], 0, lambda: 0)
assert all(len(c) == new_tokens for c in groups[0].completion_ids)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)  # MiB
"""


def test_behaviour_logprobs_do_not_keep_full_vocabulary_scores():
    # 8 rows x 256 steps x 50k vocabulary x 4 bytes = 410 MiB per copy of every step's scores (keeping them all grew
    # the peak by ~850 MiB); taking the sampled token's log-prob step by step grows it by ~150 MiB (allocator and
    # generate's own buffers), whatever the number of steps
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _PEAK_MEMORY_SCRIPT], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip().splitlines()[-1]) < 300  # MiB of peak growth during the call


def test_bf16_policy_copy_keeps_its_buffers_in_float32():
    from types import SimpleNamespace

    from trl_async.engines.transformers.worker import build_policy_copy

    trained = build_tiny_model(build_char_tokenizer())
    spec = SimpleNamespace(model_class=type(trained), model_config=trained.config, device="cpu", dtype=torch.bfloat16)
    model = build_policy_copy(spec)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    buffers = dict(model.named_buffers())
    assert buffers and all(b.dtype == torch.float32 for b in buffers.values())  # RoPE inv_freq not rounded
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied weights stay tied


def _sharpened_tiny_model(tok, scale=0.2):
    """The tiny model with perturbed weights: its freshly initialised next-token distribution is nearly uniform, so
    top-k/top-p/min-p would keep (almost) everything; this one is peaked enough that each of them removes tokens."""
    model = build_tiny_model(tok, seed=0).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model


def _teacher_forced_processed_logps(model, prompt, completion, processors):
    """log-probs of ``completion`` under log_softmax of the logits after ``processors`` (transformers' own), applied
    step by step to a teacher-forced forward pass of the unpadded prompt + completion."""
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    logps = []
    for t, token in enumerate(completion):
        scores = logits[t : t + 1].clone()
        for processor in processors:
            scores = processor(ids[:, : len(prompt) + t], scores)  # the context that step saw (penalty's input)
        logps.append(torch.log_softmax(scores.float(), -1)[0, token])
    return torch.stack(logps)


def test_behaviour_logprobs_apply_top_p_min_p_top_k_and_repetition_penalty():
    """mu is the log-prob under the distribution actually sampled from with every sampling setting GRPOTrainer passes,
    not only temperature: computed independently with transformers' processors in generate's order (repetition
    penalty, then temperature, top-k, top-p, min-p)."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    temperature, top_k, top_p, min_p, penalty = 0.8, 12, 0.7, 0.15, 1.8
    tok = build_char_tokenizer()
    model = _sharpened_tiny_model(tok)
    config = GenerationConfig(
        max_new_tokens=10,
        do_sample=True,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=penalty,
        pad_token_id=tok.pad_token_id,
        eos_token_id=[tok.eos_token_id],
    )
    processors = {
        "repetition_penalty": RepetitionPenaltyLogitsProcessor(penalty),
        "temperature": TemperatureLogitsWarper(temperature),
        "top_k": TopKLogitsWarper(top_k),
        "top_p": TopPLogitsWarper(top_p),
        "min_p": MinPLogitsWarper(min_p),
    }
    torch.manual_seed(0)
    tasks = [
        RolloutTask(0, 0, tuple(tok("ab 1+2=")["input_ids"]), 0),
        RolloutTask(1, 1, tuple(tok("zz")["input_ids"]), 0),  # ragged: left padding the penalty must ignore
    ]
    groups = generate_groups(model, tasks, config, 4, [tok.eos_token_id], tok.pad_token_id, lambda: 3)
    without = {name: 0.0 for name in processors}  # how far mu is from the distribution without each setting
    checked = 0
    for group in groups:
        for completion, logps in zip(group.completion_ids, group.logprobs, strict=True):
            mu = torch.tensor(logps)
            assert len(mu) == len(completion) and torch.isfinite(mu).all()  # sampled from inside the support
            expected = _teacher_forced_processed_logps(model, group.prompt_ids, completion, processors.values())
            torch.testing.assert_close(mu, expected, atol=1e-5, rtol=0)
            for name in processors:
                others = [p for n, p in processors.items() if n != name]
                reduced = _teacher_forced_processed_logps(model, group.prompt_ids, completion, others)
                without[name] = max(without[name], (mu - reduced).abs().max().item())
            checked += len(completion)
    assert checked >= 30
    # each setting changes the sampled-from distribution here (top-k/top-p/min-p remove tokens), so a worker that
    # ignored any one of them would fail the equality above
    assert all(gap > 0.1 for gap in without.values()), without


def test_a_later_turn_continues_each_context_within_its_own_budget():
    """Multi-turn episodes: a task with one full context per episode row (ragged), mixed with a first-turn task in
    the same generate call; every row is cut to its task's max_new_tokens and mu matches teacher forcing."""
    tok, model, config = _setup()
    first = RolloutTask(0, 0, tuple(tok("ab")["input_ids"]), 0)
    contexts = (tuple(tok("ab 1+2=3 and")["input_ids"]), tuple(tok("ab zz")["input_ids"]))
    later = RolloutTask(7, 0, first.prompt_ids, 0, contexts=contexts, rows=(1, 3), max_new_tokens=4)
    torch.manual_seed(2)
    groups = generate_groups(model, [first, later], config, 2, [tok.eos_token_id], tok.pad_token_id, lambda: 5)
    assert [g.key for g in groups] == [(0, ()), (7, (1, 3))]
    assert len(groups[0].completion_ids) == 2 and len(groups[1].completion_ids) == 2
    assert max(len(c) for c in groups[0].completion_ids) > 4  # the first turn keeps the config's 10-token budget
    for context, completion, logps in zip(contexts, groups[1].completion_ids, groups[1].logprobs, strict=True):
        assert 1 <= len(completion) <= 4
        torch.testing.assert_close(torch.tensor(logps), _teacher_forced_logps(model, context, completion),
                                   atol=1e-5, rtol=0)  # fmt: skip
