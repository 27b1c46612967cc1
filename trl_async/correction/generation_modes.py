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


# GenerationConfig fields whose processors read each row's history (or are not sampling at all): with any of them
# set, continuous batching would sample from another distribution than the trainer rebuilds
HISTORY_FIELDS = {
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "min_new_tokens": None,
    "min_length": 0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "sequence_bias": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "exponential_decay_length_penalty": None,
    "stop_strings": None,
    "guidance_scale": None,
    "watermarking_config": None,
    "renormalize_logits": False,
    "remove_invalid_values": False,  # (not a history: a processor neither continuous loop applies)
}

# ContinuousBatchingConfig settings the workers' use of transformers' engine depends on, and why
PAGED_REQUIRED = {
    "return_logprobs": (True, "each token's behaviour log-prob is read from it"),
    "allow_block_sharing": (False, "a shared prefix block would hold the keys and values of older weights"),
    "use_async_batching": (False, "a weight swap must see every row's tokens as they are"),
    "cpu_offload_space": (0.0, "an evicted row must be prefilled again with the weights of that moment, not restored"),
}


# the history-reading processors the slot loop applies itself (per row), as the trainer rebuilds them
SLOT_LOOP_APPLIES = ("repetition_penalty", "min_new_tokens")


def continuous_blocker(config, slot_loop: bool = False) -> str | None:
    """Why continuous batching cannot sample exactly what ``generate`` would with ``config`` (a GenerationConfig), or
    ``None``. ``slot_loop``: the engine is the CPU slot loop, which applies ``SLOT_LOOP_APPLIES``; transformers' paged
    engine applies none of ``HISTORY_FIELDS``."""
    if (getattr(config, "num_beams", 1) or 1) > 1:
        return f"num_beams={config.num_beams} is beam search"
    for name, neutral in HISTORY_FIELDS.items():
        value = getattr(config, name, neutral)
        if value in (neutral, None) or (name == "min_new_tokens" and value == 0):
            continue
        if slot_loop and name in SLOT_LOOP_APPLIES:
            continue
        if name in SLOT_LOOP_APPLIES:
            return (
                f"{name}={value!r} is a processor transformers' paged engine does not apply (it reads each row's "
                "history, which its processors do not see). The slot loop of a CPU worker applies it; the paged "
                "engine serves GPU workers, models whose cache is not full attention throughout, and runs that set "
                "transformers_continuous_batching_config"
            )
        return (
            f"{name}={value!r} is a processor continuous batching does not apply (most read each row's "
            "history, which its processors do not see)"
        )
    return None


def refused_paged_settings(settings: dict | None) -> str | None:
    """Why the workers cannot run transformers' continuous batching with ``settings`` (GRPOConfig's
    ``transformers_continuous_batching_config``), or ``None``."""
    if not settings:
        return None
    if not isinstance(settings, dict):
        return f"give a dict of ContinuousBatchingConfig keyword arguments, not {type(settings).__name__}"
    for key in ("page_size", "block_size"):
        if key in settings and not (type(settings[key]) is int and settings[key] >= 1):
            return f"{key}={settings[key]!r}: give a whole number of tokens per KV-cache page, 1 or more"
    for key, (needed, why) in PAGED_REQUIRED.items():
        if key in settings and settings[key] != needed:
            return f"{key}={settings[key]!r} cannot be used: {why}. Remove {key!r} (the workers set {needed!r})"
    from transformers import ContinuousBatchingConfig

    try:
        ContinuousBatchingConfig(**settings)
    except (TypeError, ValueError) as exc:
        return f"transformers' ContinuousBatchingConfig refuses it ({exc}). Give its own keyword arguments"
    return None
