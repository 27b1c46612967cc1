"""Adapter-only LoRA weight sync (weights/lora.py): workers hold the frozen base once, receive each version's adapter
factors and merge them; what cannot go that way falls back to the merged full weights, saying why."""

import copy
import json
import logging
import re

import pytest
import torch

from tests.conftest import KeepPublished, async_args, text_dataset
from trl_async import AsyncGRPOTrainer
from trl_async.demo.tiny import build_char_tokenizer, build_tiny_model
from trl_async.weights.lora import adapter_sync_blocker, adapter_tensors
from trl_async.weights.lora_merge import SCALES, LoraMerge, merged_weights, served_adapter, served_rank
from trl_async.weights.policy import policy_specs, policy_units

TARGETS = ["q_proj", "v_proj", "up_proj", "down_proj"]


def length_reward(completions, **kwargs):
    return [len(c) / 6 for c in completions]


def peft_model(**lora):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": TARGETS, "init_lora_weights": False, **lora})
    return get_peft_model(build_tiny_model(build_char_tokenizer(), tie_word_embeddings=False), config)


def published(model, part):
    return {u.name: u.compute().clone() for u in policy_units(model, part=part)}


@pytest.mark.unit
@pytest.mark.parametrize("lora", [{}, {"use_rslora": True, "r": 8, "lora_alpha": 4}], ids=["alpha/r", "rslora"])
def test_the_frozen_base_and_the_adapters_merge_into_peft_own_merge(lora):
    model = peft_model(**lora)
    base, adapters = published(model, "frozen"), published(model, "adapters")
    _, scales, merges = adapter_tensors(model)
    assert len(merges) == 2 * len(TARGETS)  # 2 layers
    expected_scale = lora.get("lora_alpha", 8) / (lora.get("r", 4) ** 0.5 if lora else 4)
    assert scales == [pytest.approx(expected_scale)] * len(merges)
    assert sorted(adapters) == sorted([f"{m.weight[: -len('.weight')]}.lora_{x}.default.weight" for m in merges
                                       for x in "AB"] + [SCALES])  # fmt: skip
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    merged = merged_weights(merges, base, adapters)
    assert set(reference) <= set(merged)
    for name, tensor in reference.items():
        torch.testing.assert_close(merged[name], tensor, rtol=0, atol=1e-6)
    # planted faults the comparison catches: the wrong scale, a stale adapter (the factors of another version)
    wrong_scale = {**adapters, SCALES: adapters[SCALES] * 2}
    stale = {n: (t * 0.5 if ".lora_B." in n else t) for n, t in adapters.items()}
    for fault in (wrong_scale, stale):
        faulty = merged_weights(merges, base, fault)
        assert not torch.allclose(faulty[merges[0].weight], reference[merges[0].weight], atol=1e-4)


@pytest.mark.unit
def test_the_served_adapter_stacks_the_scaled_factors_and_pads_lower_ranks_with_zeros():
    """Worked by hand: layer x has two adapters (ranks 2 and 1, scales 0.5 and 2), layer y one of rank 1 (scale 3).
    The served adapter has rank 3 and scale 1: B @ A is each layer's sum of scale * (B_i @ A_i)."""
    merges = (LoraMerge("x.weight", (("xa1", "xb1", 0), ("xa2", "xb2", 1)), False),
              LoraMerge("y.weight", (("ya", "yb", 2),), False))  # fmt: skip
    adapters = {
        "xa1": torch.tensor([[1.0, 0.0], [0.0, 1.0]]), "xb1": torch.tensor([[2.0, 4.0]]),
        "xa2": torch.tensor([[1.0, 1.0]]), "xb2": torch.tensor([[1.0]]),
        "ya": torch.tensor([[1.0, 2.0]]), "yb": torch.tensor([[1.0], [-1.0]]),
        SCALES: torch.tensor([0.5, 2.0, 3.0], dtype=torch.float64),
    }  # fmt: skip
    tensors, rank = served_adapter(merges, adapters)
    assert rank == 3 == served_rank(merges, {k: (tuple(v.shape), v.dtype) for k, v in adapters.items()})
    a, b = tensors["base_model.model.x.lora_A.weight"], tensors["base_model.model.x.lora_B.weight"]
    assert a.tolist() == [[1, 0], [0, 1], [1, 1]] and b.tolist() == [[1, 2, 2]]  # B scaled: 0.5*[2, 4], 2*[1]
    # 0.5 * [2, 4] @ I + 2 * [1] @ [1, 1] = [1, 2] + [2, 2]
    assert (b @ a).tolist() == [[3.0, 4.0]]
    a, b = tensors["base_model.model.y.lora_A.weight"], tensors["base_model.model.y.lora_B.weight"]
    assert a.tolist() == [[1, 2], [0, 0], [0, 0]] and b.tolist() == [[3, 0, 0], [-3, 0, 0]]  # padded to rank 3
    assert (b @ a).tolist() == [[3.0, 6.0], [-3.0, -6.0]]


@pytest.mark.unit
@pytest.mark.parametrize("lora", [{}, {"use_rslora": True, "r": 8, "lora_alpha": 4}], ids=["alpha/r", "rslora"])
def test_the_served_adapter_at_scale_one_is_peft_own_merge(lora):
    """What a server computes with the served adapter (W_base + B @ A, lora_alpha == r) is peft's merged weight."""
    model = peft_model(**lora)
    base, adapters = published(model, "frozen"), published(model, "adapters")
    tensors, _ = served_adapter(adapter_tensors(model)[2], adapters)
    merged = dict(copy.deepcopy(model).merge_and_unload().named_parameters())
    layers = {n.removeprefix("base_model.model.").removesuffix(".lora_A.weight") for n in tensors if "lora_A" in n}
    assert len(layers) == 2 * len(TARGETS)
    for layer in layers:
        a, b = (tensors[f"base_model.model.{layer}.lora_{x}.weight"] for x in "AB")
        torch.testing.assert_close(base[f"{layer}.weight"] + b @ a, merged[f"{layer}.weight"], rtol=0, atol=1e-6)
        # planted fault: the scale left out of B (what a server applying alpha/r itself would need) is caught
        unscaled = adapters[f"{layer}.lora_B.default.weight"] @ adapters[f"{layer}.lora_A.default.weight"]
        assert (base[f"{layer}.weight"] + unscaled - merged[f"{layer}.weight"]).abs().max() > 1e-3


@pytest.mark.unit
def test_per_version_bytes_are_the_adapters_only():
    model = peft_model()
    full = policy_specs(model)
    adapters, frozen = policy_specs(model, part="adapters"), policy_specs(model, part="frozen")
    size = lambda specs: sum(torch.Size(s).numel() * torch.empty(0, dtype=d).element_size() for s, d in specs.values())  # noqa: E731
    assert set(frozen) == set(full)  # the base once, under the base model's names
    # r=4 on 64-wide q/v (64x64), up (128x64), down (64x128) in 2 layers: A is r x in, B is out x r, float32
    per_layer = 4 * (64 + 64) * 2 + 4 * (64 + 128) * 2
    assert size(adapters) == 2 * per_layer * 4 + 8 * 2 * len(TARGETS)  # + one float64 scale per adapted weight


@pytest.mark.unit
@pytest.mark.parametrize(
    "lora,reason",
    [
        ({}, None),
        ({"bias": "all"}, "trainable parameters outside the adapters"),
        ({"modules_to_save": ["lm_head"]}, "trainable parameters outside the adapters (lm_head"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "`model.embed_tokens` (Embedding, not nn.Linear)"),
    ],
    ids=["plain", "bias_all", "modules_to_save", "embedding"],
)
def test_what_cannot_go_adapter_only_is_named(lora, reason):
    blocker = adapter_sync_blocker(peft_model(**lora))
    assert blocker == reason if reason is None else reason in blocker


def teacher_forced(reference, params: dict, snapshot: dict, record: dict, temperature: float = 1.0) -> torch.Tensor:
    """The log-probs of a trajectory row's completion under ``reference`` (a peft model whose ``params`` are set to
    ``snapshot``, one version's adapters): what the sampler's mu must equal."""
    with torch.no_grad():
        for n, t in snapshot.items():
            params[n].copy_(t)
        ids = torch.tensor([record["prompt_ids"] + record["completion_ids"]])
        logits = reference(input_ids=ids).logits[0, len(record["prompt_ids"]) - 1 : -1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(record["completion_ids"])[:, None])[:, 0]


class VersionedTrainer(AsyncGRPOTrainer):
    """Keeps the adapter parameters of every published version."""

    def _publish_weights(self, version):
        model = self.accelerator.unwrap_model(self.model)
        self.snapshots = getattr(self, "snapshots", {})
        self.snapshots[version] = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        return super()._publish_weights(version)


@pytest.mark.parametrize("sync", ["adapters", "merged", "continuous"])
def test_workers_sample_from_the_trainers_adapted_model_of_each_version(tmp_path, tiny_model_dir, sync):
    """Every token's mu equals a teacher-forced forward of the trainer's peft model (adapters applied unmerged, as
    it trains) with the adapters of the token's version; each version after the first carries only the adapters.
    Weights are adopted between generate calls (the default): with in-flight adoption a completion's earlier tokens
    stay in the KV cache from the older version, and no single-version forward reproduces it. ``continuous``:
    adapters with continuous batching, rows joining mid-batch and weights adopted between decode steps, where the
    rows in flight are re-encoded, so the same check holds for every token."""
    from peft import LoraConfig

    temperature = 0.7
    args = async_args(tmp_path, max_steps=4, temperature=temperature, learning_rate=5e-2, rollout_verify_weights=True,
                      rollout_trajectory_file="traj.jsonl", rollout_lora_sync="merged" if sync == "merged" else
                      "adapters", use_transformers_continuous_batching=sync == "continuous")  # fmt: skip
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    kept = KeepPublished()
    trainer = VersionedTrainer(model=tiny_model_dir, reward_funcs=length_reward, args=args, train_dataset=text_dataset(),
                               peft_config=lora, callbacks=[kept])  # fmt: skip
    kept.trainer = trainer
    trainer.train()
    pool = trainer.last_rollout_pool
    backend = pool.backend
    assert pool.verified_adoptions >= 2  # workers hashed exactly what was published
    if sync != "merged":  # each version: the adapters alone
        assert backend.base is not None and all(".lora_" in n or n == SCALES for n in kept.weights)
        assert len(kept.weights) == 2 * 2 * len(TARGETS) + 1
    else:
        assert backend.base is None and "model.embed_tokens.weight" in kept.weights

    # an independent reference: peft's own (unmerged) forward on a fresh load, the adapters of each version set in
    # (not a copy of the trainer's model: accelerate bound its forward to the original)
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    reference = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora).eval()
    params = dict(reference.named_parameters())
    assert set(trainer.snapshots[0]) <= set(params)
    records = [json.loads(x) for x in (tmp_path / "traj.jsonl").read_text().splitlines()]
    versions_seen = {v for r in records for v in r["versions"]}
    assert len(versions_seen) >= 2, versions_seen
    checked, stale_caught, errors = 0, 0, []
    ordered = sorted(versions_seen)  # not always consecutive: two steps may train on one version (e.g. 0, 0, 2, 2)
    for version, following in zip(ordered, ordered[1:] + [None], strict=True):
        for r in records:
            expected = teacher_forced(reference, params, trainer.snapshots[version], r, temperature)
            for t, v in enumerate(r["versions"]):
                if v == version:
                    errors.append((abs(r["logprobs"][t] - float(expected[t])), version, t))
                    checked += 1
                elif v == following:  # planted fault: a worker that kept the previous sampled version's adapters
                    stale_caught += abs(r["logprobs"][t] - float(expected[t])) > 1e-4
    assert max(errors)[0] < 1e-4, max(errors)  # (error, version, token)
    assert checked >= 40 and stale_caught > 0


def test_what_cannot_go_adapter_only_falls_back_to_merged_weights_and_says_why(tmp_path, caplog):
    """modules_to_save trains a full copy of lm_head: the workers then receive the merged full weights each time."""
    from peft import LoraConfig

    from trl_async.demo.tiny import save_tiny_model

    model_dir = str(save_tiny_model(tmp_path / "untied", tie_word_embeddings=False))
    kept = KeepPublished()
    with caplog.at_level(logging.WARNING):
        trainer = AsyncGRPOTrainer(model=model_dir, reward_funcs=length_reward, train_dataset=text_dataset(),
                                   args=async_args(tmp_path, max_steps=2, rollout_verify_weights=True),
                                   peft_config=LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"],
                                                          init_lora_weights=False), callbacks=[kept])  # fmt: skip
    kept.trainer = trainer
    assert "merged full weights instead, because 1 trainable parameters outside the adapters (lm_head" in caplog.text
    trainer.train()
    pool = trainer.last_rollout_pool
    assert pool.backend.base is None and pool.verified_adoptions >= 2
    merged = trainer.model.merge_and_unload()
    for name, tensor in merged.named_parameters():
        torch.testing.assert_close(kept.weights[name], tensor, rtol=0, atol=1e-6)


def test_dora_is_refused_at_construction(tmp_path, tiny_model_dir):
    """Neither way sends DoRA (its magnitude vector rescales the merged weight); TRL itself refuses LoRA on lm_head."""
    from peft import LoraConfig

    config = LoraConfig(r=4, target_modules=["q_proj"], use_dora=True)
    message = "only plain LoRA adapters can be merged for the rollout workers (not DoRA"
    with pytest.raises(NotImplementedError, match=re.escape(message)):
        AsyncGRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, args=async_args(tmp_path),
                         train_dataset=text_dataset(), peft_config=config)  # fmt: skip
