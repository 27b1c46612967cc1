"""The off-policy correction seam of ``AsyncGRPOTrainer``: pi_prox, the staleness weight, and GRPOTrainer's loss
with its ``importance_sampling_ratio`` input switched on. Mixed into the trainer; the weights themselves are pure
functions (``importance.py``), and the processed distribution the ratio compares is ``sampling.py``'s."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from trl.models.utils import disable_gradient_checkpointing

from .attributes import swapped
from .importance import off_policy_correction, stats_across_ranks
from .sampling import proximal_logps

# the image inputs GRPOTrainer's generation output carries and its forward takes (its ``_compute_loss`` passes these)
MULTIMODAL_INPUTS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                     "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")  # fmt: skip


class CorrectionSeam:
    """Expects the trainer's ``async_args``, ``_geometry``, ``_sampling``, ``_sampling_differs`` and GRPOTrainer's own
    members."""

    def _add_off_policy_inputs(self, output: dict) -> None:
        """Set ``old_per_token_logps`` = pi_prox (the trainer's policy now, or mu in bypass mode) and the staleness
        weight ``importance_sampling_ratio`` = f(pi_prox / mu) that GRPOTrainer's loss multiplies in. With
        ``off_policy_correction="none"`` (no bypass) neither is set, so GRPOTrainer treats the batch as on-policy,
        exactly as it treats its own generations.

        When one optimizer step consumes the whole generation batch (``steps_per_batch == 1``: GRPOTrainer's
        default), the weights do not change between now and the loss, so pi_prox is the loss's own forward pass,
        detached: both are left unset here and ``_compute_loss`` fills the weight in from that forward (GRPOTrainer
        itself uses ``per_token_logps.detach()`` when ``old_per_token_logps`` is unset). That saves one forward pass
        per step, the extra cost of the decoupled correction over synchronous GRPO."""
        a = self.async_args
        if a.off_policy_correction == "none" and not a.off_policy_bypass:
            return
        mask, behaviour = output["completion_mask"], output["sampling_per_token_logps"]
        if output.get("tool_mask") is not None:  # tool-result tokens were not sampled: no mu, no weight
            mask = mask * output["tool_mask"]
        if a.off_policy_bypass:
            # pi_prox := mu; a token without mu (NaN) has no ratio at all, so it leaves the loss through GRPOTrainer's
            # loss-only mask (`tool_mask`; the completion mask is also the attention mask, which must keep it); the
            # weights below still see it and count it in is/behaviour_nan
            missing = torch.isnan(behaviour)
            prox = behaviour.masked_fill(missing, 0.0)
            if missing.any():
                keep = (~missing).to(mask.dtype)
                tool_mask = output.get("tool_mask")
                output["tool_mask"] = keep if tool_mask is None else tool_mask * keep
                output["sampling_per_token_logps"] = prox
        elif output.get("old_per_token_logps") is not None and not self._sampling_differs:  # same weights
            prox = output["old_per_token_logps"]
        elif self._correction_from_loss_forward():
            return  # pi_prox comes from the loss's forward pass (see _compute_loss)
        else:
            output["old_per_token_logps"], processed = self._proximal_logps(output)
            output["importance_sampling_ratio"] = self._staleness_weights(processed, behaviour, mask)
            return
        output["old_per_token_logps"] = prox
        output["importance_sampling_ratio"] = self._staleness_weights(prox, behaviour, mask)

    def _staleness_weights(self, prox: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        a = self.async_args
        correction = off_policy_correction(
            prox,
            behaviour,
            mask,
            a.off_policy_correction,
            a.resolved_importance_sampling_cap,
            a.importance_sampling_floor,
        )
        stats = correction.stats
        if self.accelerator.num_processes > 1:  # every rank computes its weights here, in the same order
            names = list(stats)
            local = [float(correction.units)] + [float(stats[n]) for n in names]
            local = torch.tensor(local, dtype=torch.float64, device=self.accelerator.device)
            rows = self.accelerator.gather(local).view(self.accelerator.num_processes, -1).tolist()
            per_rank = [dict(zip(names, row[1:], strict=True)) for row in rows]
            stats = stats_across_ranks(per_rank, [int(row[0]) for row in rows])
        for name, value in stats.items():
            self._metrics["train"][f"is/{name}"].append(value)
        return correction.weights_BT

    def _proximal_logps(self, output: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log pi_prox, log pi_prox processed)`` of the completion tokens under the trainer's current weights: the
        softmax at the sampling temperature (``old_per_token_logps``), and the distribution the rollout engine
        samples from (``sampling.py``), which the staleness weight compares with mu. Without truncation or penalty
        the two are the same, from GRPOTrainer's own forward. Either way the forward is GRPOTrainer's, with its
        handling of a vision-language batch's image inputs (``MULTIMODAL_INPUTS``)."""
        prompt_completion_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        steps, batch_size = output["completion_ids"].size(1), self.args.per_device_train_batch_size
        images = {key: output[key] for key in MULTIMODAL_INPUTS if output.get(key) is not None}
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            if not self._sampling_differs or self.args.cast_lm_head_to_fp32:  # GRPOTrainer's own (fused) forward
                logps, _ = self._get_per_token_logps_and_entropies(
                    self.model, prompt_completion_ids, attention_mask, steps, batch_size, **images
                )[:2]
                if not self._sampling_differs:
                    return logps, logps
            # GRPOTrainer's chunking and image slicing, each chunk's raw logits turned into log-probs as it comes
            chunks, sampled, width = [], output.get("tool_mask"), output["prompt_ids"].size(1)

            def logits_of(**inputs):
                inputs.pop("labels"), inputs.pop("fused_lm_head")
                ids, mask = inputs["input_ids"], inputs["attention_mask"]
                logits = self.model(**inputs, logits_to_keep=steps + 1, use_cache=False).logits
                done = sum(c[0].size(0) for c in chunks)
                marks = None if sampled is None else sampled[done : done + ids.size(0)]
                chunks.append(proximal_logps(ids, mask, logits, width, self._sampling, self.temperature, marks))
                return SimpleNamespace(log_probs=logits.new_zeros(ids.shape))

            self._get_per_token_logps_and_entropies(
                logits_of, prompt_completion_ids, attention_mask, steps, batch_size, **images
            )
            full, processed = torch.cat([c[0] for c in chunks]), torch.cat([c[1] for c in chunks])
        # with an fp32 LM head the loss's log-probs are the fused forward's: the clipped ratio starts at 1 with those
        return (logps if self.args.cast_lm_head_to_fp32 else full), processed

    def _compute_loss(self, model, inputs):
        # GRPOTrainer multiplies `importance_sampling_ratio` into the per-token loss only when
        # `use_vllm and vllm_importance_sampling_correction`. Our staleness weight goes through that same seam, so
        # switch it on for this call only (nothing else in `_compute_loss` reads `use_vllm`).
        deferred = (
            "importance_sampling_ratio" not in inputs
            and "sampling_per_token_logps" in inputs
            and model.training
            and self._correction_from_loss_forward()
        )
        if "importance_sampling_ratio" not in inputs and not deferred:
            return super()._compute_loss(model, inputs)
        if deferred:
            # the policy forward is the first thing GRPOTrainer's loss computes, and the weight is read after it:
            # intercept that one call to set the weight from pi_prox = its log-probs, detached
            policy_forward = self._get_per_token_logps_and_entropies

            def forward_then_weight(*args, **kwargs):
                del self._get_per_token_logps_and_entropies  # back to the method for any later call
                result = policy_forward(*args, **kwargs)
                prox = result[0].detach()
                mask = inputs["completion_mask"]
                if "tool_mask" in inputs:
                    mask = mask * inputs["tool_mask"]
                inputs["importance_sampling_ratio"] = self._staleness_weights(
                    prox, inputs["sampling_per_token_logps"], mask
                )
                return result

            self._get_per_token_logps_and_entropies = forward_then_weight
        try:
            with swapped(self, use_vllm=True, vllm_importance_sampling_correction=True):
                return super()._compute_loss(model, inputs)
        finally:
            self.__dict__.pop("_get_per_token_logps_and_entropies", None)

    def _correction_from_loss_forward(self) -> bool:
        a = self.async_args
        return (
            self._geometry.steps_per_batch == 1
            and a.off_policy_correction != "none"
            and not a.off_policy_bypass
            and not self._sampling_differs  # the weight needs the processed distribution: logits, not log-probs
        )
