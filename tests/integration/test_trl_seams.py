"""The two facts about GRPOTrainer's ``_compute_loss`` (TRL 1.16) that ``AsyncGRPOTrainer._compute_loss`` relies on,
checked against the installed TRL by running its loss, so that a TRL release that changes either fails here loudly
instead of training silently with a wrong weight. (setup.cfg allows only the TRL releases these tests ran on.)

1. The policy forward (``_get_per_token_logps_and_entropies``) is the first one ``_compute_loss`` makes, and it comes
   before ``importance_sampling_ratio`` is read: the staleness weight is set from that forward's log-probs.
2. ``use_vllm`` is read only where the importance-sampling ratio is applied (``use_vllm and
   vllm_importance_sampling_correction``): our weight is switched on through that seam for one call."""

import linecache
import sys

import pytest
import torch
from trl import GRPOTrainer

from trl_async import AsyncGRPOTrainer

from ..conftest import async_args, current_logps, letter_reward, loss_batch, text_dataset


class _Recorded(dict):
    """The loss inputs, recording which keys GRPOTrainer reads, in order, into ``events``."""

    def __init__(self, data: dict, events: list) -> None:
        super().__init__(data)
        self.events = events

    def __getitem__(self, key):
        self.events.append(("read", key))
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.events.append(("read", key))
        return super().get(key, default)


# every loss_type of TRL 1.16, with the options that add branches to its loss: the KL term (beta > 0, read from the
# batch's reference log-probs, no forward of its own), the sequence-level ratio, the off-policy mask (it reads the
# sampling log-probs), entropy masking and the entropy terms (from the same forward), two-sided clipping (delta),
# and tool masks in the batch (tool episodes; "tool_mask" is a batch key, not a setting). Not covered: the MoE
# router's auxiliary loss (it needs a mixture-of-experts model; it changes the forward's arguments, not its count).
LOSS_SETTINGS = [
    {},
    *({"loss_type": loss} for loss in ("dapo", "grpo", "bnpo", "dr_grpo", "luspo", "cispo", "sapo", "vespo")),
    {"beta": 0.04},
    {"beta": 0.04, "use_bias_correction_kl": True},
    {"importance_sampling_level": "sequence", "loss_type": "grpo"},
    {"off_policy_mask_threshold": 0.5},
    {"top_entropy_quantile": 0.5},
    {"entropy_coef": 0.01},
    {"entropy_coef": 0.01, "use_adaptive_entropy": True},
    {"delta": 1.5},
    {"tool_mask": True},
]


@pytest.mark.parametrize(
    "settings", LOSS_SETTINGS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()) or "default"
)
def test_grpo_trainers_loss_makes_the_policy_forward_first_and_reads_use_vllm_only_for_the_ratio(
    tmp_path, tiny_model_dir, settings
):
    config = {k: v for k, v in settings.items() if k != "tool_mask"}
    trainer = AsyncGRPOTrainer(model=tiny_model_dir, reward_funcs=letter_reward, train_dataset=text_dataset(),
                               args=async_args(tmp_path, **config))  # fmt: skip
    batch = loss_batch()
    if settings.get("tool_mask"):
        batch["tool_mask"] = torch.tensor([[1, 0, 1], [1, 1, 1]])
    logps = current_logps(trainer, batch)
    if trainer.beta != 0.0:
        batch["ref_per_token_logps"] = logps - 0.1
    events, use_vllm_reads = [], []
    forward = trainer._get_per_token_logps_and_entropies

    inside, stray_forwards = [], []

    def recorded_forward(*args, **kwargs):
        events.append(("forward",))
        inside.append(True)
        try:
            return forward(*args, **kwargs)
        finally:
            inside.pop()

    def any_model_forward(module, args):  # a forward of the policy that does not go through the method above
        if not inside:
            stray_forwards.append(type(module).__name__)

    trainer.model.register_forward_pre_hook(any_model_forward)

    class Spy(type(trainer)):  # records every read of use_vllm with the source line that reads it
        @property
        def use_vllm(self):
            caller = sys._getframe(1)
            use_vllm_reads.append(linecache.getline(caller.f_code.co_filename, caller.f_lineno).strip())
            return self.__dict__["use_vllm"]

        @use_vllm.setter
        def use_vllm(self, value):
            self.__dict__["use_vllm"] = value

    trainer.__dict__["use_vllm"], trainer.vllm_importance_sampling_correction = True, True
    trainer._get_per_token_logps_and_entropies = recorded_forward
    trainer.__class__ = Spy
    inputs = _Recorded({**batch, "old_per_token_logps": None, "sampling_per_token_logps": logps,
                        "importance_sampling_ratio": torch.full_like(logps, 0.5)}, events)  # fmt: skip
    loss = GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
    assert torch.isfinite(loss)
    forwards = [i for i, e in enumerate(events) if e == ("forward",)]
    ratio_reads = [i for i, e in enumerate(events) if e == ("read", "importance_sampling_ratio")]
    assert forwards and ratio_reads, events  # both happen: the ratio is applied (else our weight never reaches it)
    assert forwards[0] < ratio_reads[0], f"GRPOTrainer reads the ratio before its policy forward: {events}"
    assert len(forwards) == 1, f"GRPOTrainer's loss makes {len(forwards)} forwards with {settings}: {events}"
    assert not stray_forwards, f"GRPOTrainer's loss runs the model outside its policy forward: {stray_forwards}"
    assert use_vllm_reads and all("vllm_importance_sampling_correction" in line for line in use_vllm_reads), (
        f"GRPOTrainer's loss reads use_vllm elsewhere than where it applies the ratio: {use_vllm_reads}"
    )
