"""Adapter-only LoRA sync to a real vLLM CPU server (engines/vllm/adapters.py): the base pushed once, each version
loaded as a named adapter that the requests started on it finish on; a server that cannot serve the adapters gets
the merged weights instead, saying why. The session's server runs with ``--enable-lora --max-lora-rank 8``."""

from __future__ import annotations

import json
import logging
import urllib.request

import torch
from peft import LoraConfig

from tests.integration.test_lora_sync import VersionedTrainer, teacher_forced
from tests.vllm.test_vllm_backend import PROMPTS, _dataset, _reward, _vllm_args
from trl_async.engines.vllm.client import VLLMServer

TARGETS = ["q_proj", "v_proj", "up_proj", "down_proj"]


def _served_models(url: str) -> list[str]:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as response:
        return [m["id"] for m in json.loads(response.read())["data"]]


class CountingTrainer(VersionedTrainer):
    """Also records, after each publish, the versions the servers hold, and those past the bound that a request was
    still using."""

    def _publish_weights(self, version):
        super()._publish_weights(version)
        served = self._pool.backend.served
        self.resident = getattr(self, "resident", [])
        self.resident.append((list(served.resident), list(served.held_back)) if served is not None else None)


def test_each_version_is_a_named_adapter_and_mu_is_the_adapted_models(tmp_path, vllm_server, vllm_model_dir):
    """Every token's mu equals a teacher-forced forward of peft's model with the adapters of the token's version
    (float32, temperature 1, <= 1e-4); the base went once; at most max_staleness + 2 versions were loaded at a
    time, and none is left on the server after training."""
    lora = LoraConfig(r=4, lora_alpha=16, use_rslora=True, target_modules=TARGETS, init_lora_weights=False)
    adapter_dir = tmp_path / "adapters"
    args = _vllm_args(
        tmp_path, vllm_server.url, max_steps=5, max_staleness=1, rollout_vllm_adapter_dir=str(adapter_dir)
    )
    trainer = CountingTrainer(model=vllm_model_dir, reward_funcs=_reward, args=args, train_dataset=_dataset(),
                              peft_config=lora)  # fmt: skip
    assert trainer._adapter_sync
    trainer.train()
    backend = trainer.last_rollout_pool.backend
    assert backend.adapter_sync and backend.pusher.pushes == 1  # the frozen base, once
    keep = args.max_staleness + 2
    assert len(trainer.resident) == 6  # versions 0 (before training) to 5
    for published, (resident, held_back) in enumerate(trainer.resident, start=1):
        # the newest max_staleness + 2 versions, and an older one only while a request still runs on it
        assert resident == sorted(held_back) + list(range(max(0, published - keep), published)), trainer.resident
    assert not [m for m in _served_models(vllm_server.url) if m.startswith("trl_async-")]  # unloaded at the end
    assert not any(adapter_dir.iterdir())
    # and only once the server ran none of the requests training abandoned (one that needs a deleted adapter's files
    # kills vLLM's engine): the server still serves
    params = {"n": 1, "max_tokens": 4, "temperature": 0.0, "logprobs": 0, "ignore_eos": True}
    assert len(VLLMServer(vllm_server.url).generate(PROMPTS[0], params)[0].token_ids) == 4

    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    reference = get_peft_model(AutoModelForCausalLM.from_pretrained(vllm_model_dir), lora).eval()
    params = dict(reference.named_parameters())
    records = [json.loads(x) for x in (tmp_path / "traj.jsonl").read_text().splitlines()]
    versions_seen = {v for r in records for v in r["versions"]}
    assert len(versions_seen) >= 3 and all(len(set(r["versions"])) == 1 for r in records)  # a request, a version
    errors, stale_caught, checked = [], 0, 0
    for version in sorted(versions_seen):
        for r in records:
            expected = teacher_forced(reference, params, trainer.snapshots[version], r)
            gap = max(abs(a - float(b)) for a, b in zip(r["logprobs"], expected, strict=True))
            if r["versions"][0] == version:
                errors.append((gap, version))
                checked += len(r["completion_ids"])
            else:  # planted fault: a server on another version's adapter (a stale one, say) is caught
                stale_caught += gap > 1e-4
    assert max(errors)[0] < 1e-4, max(errors)
    assert checked >= 40 and stale_caught > 0


def test_a_rank_beyond_the_servers_falls_back_to_merged_weights_and_says_why(
    tmp_path, vllm_server, vllm_model_dir, caplog
):
    """Rank 16 on a server started with --max-lora-rank 8: every version is pushed merged, and the server's greedy
    output afterwards is the trained model's."""
    lora = LoraConfig(r=16, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False)
    args = _vllm_args(tmp_path, vllm_server.url, max_steps=2, max_staleness=1)
    trainer = CountingTrainer(model=vllm_model_dir, reward_funcs=_reward, args=args, train_dataset=_dataset(),
                              peft_config=lora)  # fmt: skip
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert "merged full weights instead, because vLLM server" in caplog.text
    assert "serves LoRA rank 8 at most (--max-lora-rank) and these adapters need 16" in caplog.text
    backend = trainer.last_rollout_pool.backend
    assert not backend.adapter_sync and not trainer._adapter_sync and backend.pusher.pushes == 3  # every version
    model = trainer.model.merge_and_unload().eval()
    server = VLLMServer(vllm_server.url)
    for prompt in PROMPTS:
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)
        got = server.generate(
            prompt, {"n": 1, "max_tokens": 12, "temperature": 0.0, "logprobs": 0, "ignore_eos": True}
        )
        assert list(got[0].token_ids) == expected[0, len(prompt) :].tolist()
