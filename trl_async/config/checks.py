"""The config's checks: a table of one-field rules, then the few rules that relate fields.

Each failed rule raises ``ValueError("AsyncGRPOConfig.<field>=<value> is invalid: <fix>")``. Nothing here writes
into the settings: defaults are filled first, by ``defaults.resolve_defaults``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..correction.generation_modes import refused_generation_kwargs, refused_paged_settings
from ..correction.sampling import SAMPLER_FIELDS, VLLM_GREEDY_BELOW, refused_sampling
from ..hardware.cores import allowed_cores, parse_cpu_list, split_cores
from .async_fields import (
    LORA_SYNCS,
    OFF_POLICY_CORRECTIONS,
    ROLLOUT_BACKENDS,
    ROLLOUT_DTYPES,
    WEIGHT_TRANSPORTS,
    WEIGHT_UPDATE_POINTS,
)


def refuse(settings, name: str, fix: str) -> None:
    raise ValueError(f"AsyncGRPOConfig.{name}={getattr(settings, name)!r} is invalid: {fix}")


def whole(minimum: int, optional: bool = False) -> Callable[[Any], bool]:
    """A whole number >= ``minimum`` (a bool is not one), or None when ``optional``."""
    return lambda v: (optional and v is None) or (type(v) is int and v >= minimum)


def number(above: float | None = None, at_least: float | None = None, optional: bool = False):
    """A real number ``> above`` or ``>= at_least``, or None when ``optional``."""

    def ok(v) -> bool:
        if optional and v is None:
            return True
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            return False
        return (above is None or v > above) and (at_least is None or v >= at_least)

    return ok


def one_of(allowed: tuple, optional: bool = False) -> Callable[[Any], bool]:
    return lambda v: (optional and v is None) or v in allowed


def device_type(value) -> str | None:
    try:
        return torch.device(value or "cpu").type
    except (RuntimeError, TypeError):
        return None


def optional_path(value) -> bool:
    return value is None or isinstance(value, (str, os.PathLike))


def server_urls(value) -> bool:
    return value is None or (
        isinstance(value, (list, tuple))
        and all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in value)
    )


# (field, rule, fix): every field's own range, checked in this order. rollout_cpu_affinity is checked against the
# cores this process may use, in check_cpu_affinity.
FIELD_RULES: list[tuple[str, Callable[[Any], bool], str]] = [
    ("rollout_backend", one_of(ROLLOUT_BACKENDS), f"choose one of {ROLLOUT_BACKENDS}"),
    ("rollout_vllm_weight_transport", one_of(WEIGHT_TRANSPORTS), f"choose one of {WEIGHT_TRANSPORTS}"),
    ("rollout_vllm_urls", server_urls, "give a list of server URLs such as ['http://10.0.0.2:8000'], or None"),
    ("rollout_vllm_max_requests", whole(1, optional=True), "set it to 1 or more, or None for the default"),
    ("rollout_vllm_retry_s", number(at_least=0), "set 0 or more seconds"),
    ("rollout_vllm_down_limit_s", number(above=0, optional=True),
     "set a positive number of seconds, or None to wait for a lost server as long as others work"),
    ("rollout_vllm_adapter_dir", optional_path,
     "set a directory path the vLLM servers can read, or None for the temporary directory"),
    ("num_rollout_workers", whole(1), "set it to 1 or more"),
    ("rollout_device", lambda v: device_type(v) in ("cpu", "cuda"),
     "use a torch device string for the CPU or a GPU, such as 'cpu' or 'cuda:1'"),
    ("max_staleness", whole(0), "set it to 0 (synchronous semantics) or more"),
    ("rollout_batch_groups", whole(1, optional=True), "set it to 1 or more, or None for the default"),
    ("weight_sync_steps", whole(1), "set it to 1 or more"),
    ("rollout_queue_size", whole(1, optional=True), "set it to 1 or more, or None for the default"),
    ("rollout_weight_update", one_of(WEIGHT_UPDATE_POINTS, optional=True),
     f"choose one of {WEIGHT_UPDATE_POINTS}, or None for the backend's default"),
    ("rollout_torch_threads", whole(1, optional=True),
     "set it to 1 or more, or None for the cores available divided among the workers"),
    ("dynamic_sampling", lambda v: isinstance(v, bool), "set True or False"),
    ("rollout_consumption_window", whole(1, optional=True),
     "set None (arrival order) or a whole number of groups >= 1 (1: strict admission order)"),
    ("dynamic_sampling_limit", whole(1, optional=True),
     "set a number of generation batches >= 1, or None for no limit"),
    ("rollout_nice", lambda v: v is None or (type(v) is int and 0 <= v <= 19),
     "set a niceness from 0 (same priority as the trainer) to 19 (lowest), or None for the default"),
    ("rollout_dtype", one_of(ROLLOUT_DTYPES, optional=True), f"choose one of {ROLLOUT_DTYPES}, or None for the "
     "trainer's dtype"),
    ("weight_sync_bucket_mb", number(above=0), "set a positive size in MB"),
    ("rollout_lora_sync", one_of(LORA_SYNCS), "set 'adapters' or 'merged'"),
    ("rollout_timeout_s", number(above=0), "set a positive number of seconds"),
    ("rollout_scoring_threads", whole(1), "set it to 1 or more (1: one group at a time)"),
    ("rollout_tool_threads", whole(1), "set it to 1 or more"),
    ("rollout_tool_timeout_s", number(above=0, optional=True),
     "set a positive number of seconds, or None to wait forever"),
    ("rollout_max_restarts", whole(0), "set 0 or more (0: fail at the first loss)"),
    ("rollout_heartbeat_timeout_s", number(at_least=2.0),
     "set 2 seconds or more (workers beat every 0.5 s; a busy machine delays beats)"),
    ("off_policy_correction", one_of(OFF_POLICY_CORRECTIONS), f"choose one of {OFF_POLICY_CORRECTIONS}"),
    ("importance_sampling_cap", number(above=1.0, optional=True),
     "set a cap > 1 (e.g. 2.0), or None for the mode's default"),
    ("importance_sampling_floor", lambda v: number(at_least=0.0)(v) and v < 1.0, "set a floor in [0, 1)"),
    ("off_policy_bypass", lambda v: isinstance(v, bool), "set True or False"),
    ("rollout_verify_weights", lambda v: isinstance(v, bool), "set True or False"),
    ("rollout_vllm_python", optional_path, "set the path of a Python interpreter, or None for the trainer's own"),
    ("rollout_vllm_server_args", lambda v: v is None or (isinstance(v, (list, tuple))
                                                         and all(isinstance(a, str) for a in v)),
     "give a list of strings such as ['--enforce-eager'], or None"),
    ("rollout_trajectory_file", optional_path, "set a file path, or None to write no trajectories"),
]  # fmt: skip


def check_async_fields(settings, loss_type: str | None = None) -> None:
    """Every rule, on settings whose defaults are resolved: the field table, then the cross-field rules."""
    for name, rule, fix in FIELD_RULES:
        if not rule(getattr(settings, name)):
            refuse(settings, name, fix)
    for check in (
        check_staleness_bound,
        check_engine_only_fields,
        check_generation_kwargs,
        check_sampling,
        check_continuous_batching,
    ):
        check(settings)
    check_vespo(settings, loss_type)
    if settings.rollout_cpu_affinity is not None:
        check_cpu_affinity(settings)
    warn_uncorrected_staleness(settings)


def check_staleness_bound(s) -> None:
    if s.weight_sync_steps > s.max_staleness + 1:
        refuse(
            s,
            "weight_sync_steps",
            f"with max_staleness={s.max_staleness} the trainer would wait for samples no worker may generate; "
            f"set weight_sync_steps <= {s.max_staleness + 1} or raise max_staleness to >= "
            f"{s.weight_sync_steps - 1}",
        )


def check_engine_only_fields(s) -> None:
    """Fields that mean something to one engine only."""
    if s.rollout_backend == "vllm" and s.rollout_verify_weights:
        refuse(
            s,
            "rollout_verify_weights",
            "weight hashing is for the transformers workers; with vLLM the "
            "greedy-output check in the tests covers the push. Set it to False",
        )
    if s.rollout_dtype is not None and s.rollout_backend != "transformers":
        refuse(
            s,
            "rollout_dtype",
            "it sets the transformers workers' dtype; a vLLM server's dtype is its own `--dtype`. Set it to None",
        )
    if s.rollout_dtype is not None and s.rollout_verify_weights:
        refuse(
            s,
            "rollout_verify_weights",
            "workers converting weights to rollout_dtype cannot reproduce the "
            "trainer's bytes. Set one of them back to its default",
        )


def check_continuous_batching(s) -> None:
    """GRPOConfig's ``transformers_continuous_batching_config``, where the transformers workers batch continuously
    (``use_transformers_continuous_batching``; a vLLM server batches by itself, as with GRPOTrainer)."""
    if s.rollout_backend == "transformers" and getattr(s, "use_transformers_continuous_batching", False):
        refused = refused_paged_settings(getattr(s, "transformers_continuous_batching_config", None))
        if refused is not None:
            refuse(s, "transformers_continuous_batching_config", refused)


def check_generation_kwargs(s) -> None:
    """``generation_kwargs`` the chosen engine cannot honour, or that would change GRPO's groups."""
    kwargs = getattr(s, "generation_kwargs", None) or {}
    if s.rollout_backend == "transformers":
        refused = refused_generation_kwargs(kwargs, getattr(s, "top_k", None))
        if refused is not None:
            refuse(s, "generation_kwargs", refused)
        return
    if "n" in kwargs:
        refuse(
            s,
            "generation_kwargs",
            "'n' (vLLM's completions per request) would replace num_generations behind "
            "the trainer's back, and each group would hold a different number of completions than GRPOTrainer's "
            "advantages assume: remove 'n' and set num_generations",
        )
    temperature = kwargs.get("temperature")
    if temperature is not None and temperature < VLLM_GREEDY_BELOW:
        refuse(
            s,
            "generation_kwargs",
            f"temperature={temperature} makes vLLM sample greedily, and vLLM then "
            "refuses more than one completion per request (num_generations): use a temperature of at least 1e-5",
        )
    if (kwargs.get("num_beams") or 1) > 1:
        refuse(
            s,
            "rollout_backend",
            f"generation_kwargs num_beams={kwargs['num_beams']} is transformers' beam "
            "search; a vLLM server's sampling parameters have no num_beams (vLLM's generation_kwargs are its "
            "SamplingParams). Remove num_beams, or use rollout_backend='transformers'",
        )


def check_sampling(s) -> None:
    """The sampler must leave every token a behaviour log-prob the importance ratio can use."""
    kwargs = getattr(s, "generation_kwargs", None) or {}
    beams = kwargs.get("num_beams") or 1
    if beams > 1:  # beam tokens have no mu, so no ratio: they train uncorrected, unless the bypass needs mu
        if s.off_policy_bypass:
            refuse(
                s,
                "off_policy_bypass",
                f"generation_kwargs num_beams={beams} is beam search, which samples from "
                "no distribution: its tokens have no behaviour log-prob, and the bypass takes that log-prob as "
                "the proximal policy (every beam token would leave the loss). Use off_policy_bypass=False (beam "
                "tokens then train uncorrected, ratio 1, as with GRPOTrainer) or num_beams=1",
            )
        return
    sampler_fields = {name: getattr(s, name, None) for name in SAMPLER_FIELDS}
    refused = refused_sampling(
        s.rollout_backend,
        sampler_fields,
        kwargs,
        s.off_policy_correction != "none" or s.off_policy_bypass,
        s.off_policy_bypass,
    )
    if refused is not None:
        refuse(s, *refused)


def check_vespo(s, loss_type: str | None) -> None:
    # GRPOTrainer's VESPO sums log w over a sequence into its gamma weight instead of multiplying w per token (as TRL
    # itself requires token-level truncation or masking for its vLLM correction under VESPO): a dropped token (w = 0)
    # would zero its whole sequence, and a sequence weight would be raised to the power of the length. Truncation
    # composes: log min(rho, C) per token is VESPO's own token-truncated weight.
    if loss_type == "vespo" and s.off_policy_correction not in ("tis", "none") and not s.off_policy_bypass:
        refuse(
            s,
            "off_policy_correction",
            "with loss_type='vespo' use 'tis' (the default there): VESPO sums the log "
            "of every token's weight into one sequence weight, so a token dropped by 'decoupled'/'mask' (w = 0) "
            "would silence its whole sequence and a 'seq_*' weight would count once per token",
        )


def check_cpu_affinity(s) -> None:
    allowed = allowed_cores()
    if allowed is None:
        refuse(
            s,
            "rollout_cpu_affinity",
            "this OS does not let a process choose its cores (no os.sched_setaffinity); leave it None",
        )
    try:
        split_cores(parse_cpu_list(s.rollout_cpu_affinity), allowed, s.num_rollout_workers)
    except ValueError as exc:
        refuse(s, "rollout_cpu_affinity", str(exc))


def warn_uncorrected_staleness(s) -> None:
    if s.off_policy_correction == "none" and s.max_staleness > 0 and not s.off_policy_bypass:
        warnings.warn(
            f"off_policy_correction='none' with max_staleness={s.max_staleness}: samples up to {s.max_staleness} "
            "steps stale are trained on as if on-policy (meant for ablations). Use 'decoupled' (default) or 'tis' "
            "for real runs.",
            UserWarning,
            stacklevel=6,  # the line that built the config
        )
