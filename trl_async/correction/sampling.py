"""The distribution a rollout engine samples each token from, built once and applied on both sides of the ratio.

A worker samples token ``a`` from the *processed* distribution: the raw logits, ``suppress_tokens`` removed (a
vision-language model's image token), the stop tokens held back before ``min_new_tokens``, the repetition penalty, temperature, then the truncations (top-k, top-p, min-p, and on the
transformers workers top-h, typical-p, epsilon and eta), renormalised over the tokens kept. Its log-prob there is mu.
The importance ratio compares mu with the trainer's policy at the consumed version processed *the same way*
(``processed_logps``), so at staleness 0 the ratio is 1 whatever the sampler, and at staleness k it corrects towards the
distribution a synchronous trainer would sample from at that version. A token the proximal policy's own truncation
removes gets probability 0 there: its ratio is 0.

The two engines order the truncations differently, and the order changes the kept set:
- transformers (``generate``): repetition penalty, temperature, top-h, top-k, top-p, min-p, then the rest;
- vLLM (v1 sampler): repetition penalty, temperature, min-p, then top-k and top-p together.
Both are built from transformers' own processors; each has the same rule as its vLLM counterpart on the CPU (ties at
the k-th logit kept, at least one token kept by top-p). vLLM's CUDA top-k/top-p kernel differs at the edges (it keeps
exactly k tokens when the k-th logit is tied, and finds the top-p cut by a bounded search): there a token at the
edge of the kept set can get a ratio away from 1. The repetition penalty sees the row's context without padding: a
padded prompt's pad token is not a token the row has seen.

Settings that change the distribution in ways not rebuilt here (``UNREPRODUCED``) are refused by the config while an
off-policy correction is on (``unreproduced_settings``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

SAMPLER_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")  # GRPOConfig's
VLLM_GREEDY_BELOW = 1e-5  # vLLM samples greedily below this temperature (its _SAMPLING_EPS), and then only n = 1

# transformers warpers beyond GRPOConfig's fields, rebuilt on the transformers engine through transformers itself
EXTRA_TRANSFORMERS_WARPERS = ("typical_p", "epsilon_cutoff", "eta_cutoff", "top_h")

# generation_kwargs that reshape the sampled-from distribution and are not rebuilt by ``processed_logps``
UNREPRODUCED = {
    "transformers": (
        "no_repeat_ngram_size",
        "encoder_no_repeat_ngram_size",
        "bad_words_ids",
        "sequence_bias",
        "begin_suppress_tokens",
        "min_length",
        "forced_eos_token_id",
        "exponential_decay_length_penalty",
        "encoder_repetition_penalty",
        "diversity_penalty",
        "guidance_scale",
        "watermarking_config",
        "forced_decoder_ids",
        "logits_processor",
    ),
    "vllm": (
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "bad_words",
        "allowed_token_ids",
        "logits_processors",
        "structured_outputs",
        "guided_decoding",
        "thinking_token_budget",
        "extra_args",
        *EXTRA_TRANSFORMERS_WARPERS,
    ),
}


@dataclass(frozen=True)
class SamplingSettings:
    """What a rollout engine applies to the logits before it samples (neutral values: no effect)."""

    engine: str  # "transformers" | "vllm": the order of the truncations
    temperature: float = 1.0
    top_k: int = 0  # 0: off (vLLM's -1 is read as 0)
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    extra_warpers: tuple[tuple[str, float], ...] = ()  # transformers engine only: EXTRA_TRANSFORMERS_WARPERS set
    min_new_tokens: int = 0  # transformers' min_new_tokens, vLLM's min_tokens: no stop token before this many
    stop_ids: tuple[int, ...] = ()  # the tokens min_new_tokens holds back (EOS ids)
    suppressed: tuple[int, ...] = ()  # transformers' suppress_tokens: never sampled (a VLM's image token)

    def differs_from(self, loss_temperature: float) -> bool:
        """Whether the engine samples from anything but ``softmax(logits / loss_temperature)``, the distribution
        GRPOTrainer's loss computes (a temperature in ``generation_kwargs`` also makes it differ)."""
        return self.reshapes or self.temperature != loss_temperature

    @property
    def reshapes(self) -> bool:
        """Whether the processed distribution differs from ``softmax(logits / temperature)``."""
        return (
            self.top_k > 0
            or self.top_p < 1.0
            or self.min_p > 0.0
            or self.repetition_penalty != 1.0
            or bool(self.extra_warpers)
            or self.min_new_tokens > 0
            or bool(self.suppressed)
        )


def _number(value, neutral):
    return neutral if value is None else value


def settings_of(engine: str, params: Mapping) -> SamplingSettings:
    """The settings in a transformers ``GenerationConfig`` (as a dict, or its ``to_dict()``) or a vLLM sampling
    parameter dict."""
    top_k = int(_number(params.get("top_k"), 0))
    temperature = float(_number(params.get("temperature"), 1.0))  # (vLLM's greedy, below 1e-5, is refused: config)
    extra = ()
    if engine == "transformers":
        neutral = {"typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None}
        extra = tuple(
            (name, params[name])
            for name in EXTRA_TRANSFORMERS_WARPERS
            if params.get(name) is not None and params[name] != neutral[name]
        )
    return SamplingSettings(
        engine=engine,
        temperature=temperature,
        top_k=max(top_k, 0),
        top_p=float(_number(params.get("top_p"), 1.0)),
        min_p=float(_number(params.get("min_p"), 0.0)),
        repetition_penalty=float(_number(params.get("repetition_penalty"), 1.0)),
        extra_warpers=extra,
        min_new_tokens=int(_number(params.get("min_new_tokens" if engine == "transformers" else "min_tokens"), 0)),
        stop_ids=_ids(params.get("eos_token_id" if engine == "transformers" else "stop_token_ids")),
        suppressed=_ids(params.get("suppress_tokens")) if engine == "transformers" else (),
    )


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)


def processors(settings: SamplingSettings, device: torch.device | str = "cpu"):
    """transformers ``LogitsProcessorList`` applying ``settings`` in the engine's order; it maps ``(context ids,
    scores)`` to processed scores, one row per token to sample."""
    from transformers import LogitsProcessorList
    from transformers.generation import logits_process as lp

    s = settings
    chain = LogitsProcessorList()
    if s.repetition_penalty != 1.0:
        chain.append(lp.RepetitionPenaltyLogitsProcessor(s.repetition_penalty))
    if s.temperature != 1.0:
        chain.append(lp.TemperatureLogitsWarper(s.temperature))
    if s.engine == "vllm":
        if s.min_p > 0.0:
            chain.append(lp.MinPLogitsWarper(s.min_p))
        if s.top_k > 0:
            chain.append(lp.TopKLogitsWarper(s.top_k))
        if s.top_p < 1.0:
            chain.append(lp.TopPLogitsWarper(s.top_p))
        return chain
    # transformers: generate's order (its ``_get_logits_processor``), min_tokens_to_keep 1 as for sampling
    extra = dict(s.extra_warpers)
    if extra.get("top_h") is not None:
        chain.append(lp.TopHLogitsWarper(top_h=extra["top_h"]))
    if s.top_k > 0:
        chain.append(lp.TopKLogitsWarper(s.top_k))
    if s.top_p < 1.0:
        chain.append(lp.TopPLogitsWarper(s.top_p))
    if s.min_p > 0.0:
        chain.append(lp.MinPLogitsWarper(s.min_p))
    if extra.get("typical_p", 1.0) < 1.0:
        chain.append(lp.TypicalLogitsWarper(mass=extra["typical_p"]))
    if 0.0 < extra.get("epsilon_cutoff", 0.0) < 1.0:
        chain.append(lp.EpsilonLogitsWarper(epsilon=extra["epsilon_cutoff"]))
    if 0.0 < extra.get("eta_cutoff", 0.0) < 1.0:
        chain.append(lp.EtaLogitsWarper(epsilon=extra["eta_cutoff"], device=device))
    return chain


def context_ids(prompt_ids: torch.Tensor, completion_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``(T, P + T)`` ids: row ``t`` is what the engine had seen when it sampled completion token ``t`` (the prompt and
    the completion's first ``t`` tokens), the rest filled with ``vocab_size``, an id the repetition penalty skips."""
    steps = completion_ids.numel()
    earlier = torch.arange(steps).unsqueeze(0) < torch.arange(steps).unsqueeze(1)  # [t, j]: j < t
    seen = torch.where(earlier, completion_ids.view(1, -1).cpu(), torch.full((), vocab_size))
    return torch.cat([prompt_ids.view(1, -1).cpu().expand(steps, -1), seen], dim=1)


def sampled_before(sampled_T: torch.Tensor) -> torch.Tensor:
    """For each position, how many tokens the engine had generated in the current turn: the sampled tokens
    (``sampled_T``: 1 sampled, 0 a tool result inserted between turns) since the last inserted one. Each turn is its
    own request to the engine, so its ``min_new_tokens`` counts from there."""
    counts, run = [], 0
    for sampled in sampled_T.tolist():
        counts.append(run if sampled else 0)
        run = run + 1 if sampled else 0
    return torch.tensor(counts, dtype=torch.long)


def processed_logps(
    logits_TV: torch.Tensor,
    prompt_ids: torch.Tensor,
    completion_ids: torch.Tensor,
    chain,
    settings: SamplingSettings | None = None,
    sampled_T: torch.Tensor | None = None,
) -> torch.Tensor:
    """log-prob of each completion token under the processed distribution, shape ``(T,)``; ``-inf`` for a token the
    truncation removes. ``logits_TV`` are the raw logits that predicted each token (no temperature applied),
    ``prompt_ids`` the unpadded prompt (a multi-turn row: everything before its first completion token);
    ``settings.min_new_tokens`` holds the stop tokens back where fewer tokens of the turn were generated
    (``sampled_T`` marks the sampled tokens; all of them by default)."""
    vocab = logits_TV.size(-1)
    history = context_ids(prompt_ids, completion_ids, vocab).to(logits_TV.device)
    logits_TV = logits_TV.float()
    if settings is not None and settings.min_new_tokens > 0 and settings.stop_ids:
        sampled = torch.ones(completion_ids.numel()) if sampled_T is None else sampled_T
        early = (sampled_before(sampled) < settings.min_new_tokens).to(logits_TV.device)
        stop = torch.zeros(vocab, dtype=torch.bool, device=logits_TV.device)
        stop[[i for i in settings.stop_ids if i < vocab]] = True
        logits_TV = logits_TV.masked_fill(early.unsqueeze(1) & stop.unsqueeze(0), -torch.inf)
    suppressed = [i for i in (settings.suppressed if settings is not None else ()) if i < vocab]
    if suppressed:  # as transformers' SuppressTokensLogitsProcessor, every step (an id past the vocabulary: none)
        logits_TV = logits_TV.index_fill(-1, torch.tensor(suppressed, device=logits_TV.device), -torch.inf)
    scores = chain(history, logits_TV)
    return torch.log_softmax(scores, dim=-1).gather(-1, completion_ids.view(-1, 1).to(logits_TV.device)).squeeze(-1)


def unreproduced_settings(engine: str, generation_kwargs: Mapping | None) -> list[str]:
    """The ``generation_kwargs`` keys that reshape ``engine``'s sampling in a way ``processed_logps`` does not
    rebuild."""
    return [key for key in (generation_kwargs or {}) if key in UNREPRODUCED[engine]]


def proximal_logps(
    ids: torch.Tensor,
    mask: torch.Tensor,
    logits: torch.Tensor,
    prompt_width: int,
    settings: SamplingSettings,
    temperature: float,
    sampled: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log pi, log pi processed)`` of the completion tokens (``ids[:, prompt_width:]``) of one forward chunk, from
    its raw ``logits`` of the last ``steps + 1`` positions: the softmax at ``temperature``, as GRPOTrainer's loss
    computes it, and the distribution the engine samples from (``processed_logps``; ``sampled``: the chunk's rows of
    GRPOTrainer's ``tool_mask``, 1 where the engine sampled the token). One forward pass serves both."""
    steps = ids.size(1) - prompt_width
    chain = processors(settings, ids.device)
    logits = logits[:, -steps - 1 : -1].float()  # the logits that predicted each completion token
    completion = ids[:, prompt_width:]
    full = torch.log_softmax(logits / temperature, -1).gather(-1, completion.unsqueeze(-1))[..., 0]
    processed = []
    for row in range(ids.size(0)):
        prompt = ids[row, :prompt_width][mask[row, :prompt_width].bool()]
        marks = None if sampled is None else sampled[row].cpu()
        processed.append(processed_logps(logits[row], prompt, completion[row], chain, settings, marks))
    return full, torch.stack(processed)


def refused_sampling(
    engine: str, fields: Mapping, generation_kwargs: Mapping | None, correcting: bool, bypass: bool
) -> tuple[str, str] | None:
    """``(field, why and the fix)`` when the off-policy correction cannot be exact with these sampling settings
    (``fields``: GRPOConfig's temperature, top_k, top_p, min_p and repetition_penalty), else ``None``."""
    kwargs = dict(generation_kwargs or {})
    if correcting and (unreproduced := unreproduced_settings(engine, kwargs)):
        return "generation_kwargs", (
            f"{', '.join(unreproduced)} reshape(s) the distribution the {engine} engine samples from in a way the "
            "trainer does not rebuild when it computes the importance ratio, so the ratio would differ from 1 even "
            "at staleness 0: remove it, or set off_policy_correction='none' (stale tokens then train uncorrected)"
        )
    loss_temperature = float(_number(fields.get("temperature"), 1.0))
    if bypass and settings_of(engine, {**fields, **kwargs}).differs_from(loss_temperature):
        return "off_policy_bypass", (
            "the bypass takes mu, the distribution the engine samples from (truncated, penalised, held back by "
            "min_new_tokens, or at another temperature than the loss's), as the proximal policy, while GRPOTrainer's "
            "loss uses the full softmax at its temperature, so the ratios would not start at 1: set "
            "off_policy_bypass=False (one forward pass per batch rebuilds the engine's distribution), or sample with "
            "top_k=0, top_p=1, min_p=None, repetition_penalty=1 and no other sampling setting in generation_kwargs"
        )
    return None
