"""Which of transformers' decoding modes the rollout workers can sample with: those that draw each new token, one
per step, from the scores the logits processors return (where the workers record mu). Pure functions of a
``GenerationConfig`` or of ``generation_kwargs``; AsyncGRPOConfig and the trainer's construction refuse the rest."""

from __future__ import annotations

# decoding in which each new token is drawn, one per step, from the scores the logits processors return: the
# workers record mu there (beam search: no mu, trained uncorrected as GRPOTrainer does)
STEPWISE_MODES = ("sample", "greedy_search", "beam_search", "beam_sample")


def refused_generation_kwargs(kwargs: dict, top_k: int | None = None) -> str | None:
    """Why the transformers workers cannot generate with ``generation_kwargs`` (``None``: they can), on top of
    GRPOTrainer's sampling settings (``top_k`` selects contrastive search with ``penalty_alpha``)."""
    from transformers import GenerationConfig

    try:
        config = GenerationConfig(**{"do_sample": True, "top_k": top_k, **kwargs})
    except Exception:  # noqa: BLE001 - an invalid combination: GRPOTrainer's own GenerationConfig reports it
        return None
    return refused_generation(config)


def refused_generation(config) -> str | None:
    """Why the transformers workers cannot generate with this ``GenerationConfig`` (``None``: they can). Checked
    against GRPOTrainer in TRL 1.16 on a tiny model: num_return_sequences, prompt lookup and group beam search fail
    there too."""
    returns = getattr(config, "num_return_sequences", 1) or 1
    if returns != 1:
        return (
            f"num_return_sequences={returns} would return {returns} completions per row, which the workers would "
            "pair with the wrong prompts (GRPOTrainer stops with a tensor size mismatch). Completions per prompt are "
            "`num_generations`: remove num_return_sequences"
        )
    try:
        mode = config.get_generation_mode()
    except Exception:  # noqa: BLE001 - an invalid combination: generate() reports it as GRPOTrainer's would
        return None
    if mode.value in STEPWISE_MODES:
        return None
    return (
        f"they select {mode.value} decoding, which does not draw each token from one step's processed scores (assisted "
        "and prompt-lookup decoding verify several tokens per step; group beam search, DoLa and contrastive search "
        "are remote code in transformers 5), so no behaviour log-prob can be recorded (GRPOTrainer's own generate "
        "refuses prompt lookup and group beam search too). Use sampling (the default), greedy (do_sample=False) "
        "or num_beams"
    )
