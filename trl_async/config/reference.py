"""The async fields, grouped, written out from their help: ``AsyncGRPOConfig``'s docstring and
``docs/configuration.md`` (a test checks the page against the fields, so it cannot drift).

    python -m trl_async.config.reference > docs/configuration.md
"""

from __future__ import annotations

from dataclasses import MISSING, fields

from .async_fields import AsyncFields

GROUPS: dict[str, tuple[str, ...]] = {
    "The three dials": ("max_staleness", "rollout_batch_groups", "weight_sync_steps"),
    "Engine and lanes": (
        "rollout_backend",
        "num_rollout_workers",
        "rollout_device",
        "rollout_vllm_urls",
        "rollout_vllm_weight_transport",
        "rollout_vllm_max_requests",
        "rollout_vllm_adapter_dir",
        "rollout_vllm_down_limit_s",
        "rollout_vllm_retry_s",
        "rollout_vllm_python",
        "rollout_vllm_server_args",
    ),
    "Generation on the workers": (
        "rollout_queue_size",
        "rollout_weight_update",
        "rollout_torch_threads",
        "rollout_cpu_affinity",
        "rollout_nice",
        "rollout_dtype",
    ),
    "Off-policy correction": (
        "off_policy_correction",
        "importance_sampling_cap",
        "importance_sampling_floor",
        "off_policy_bypass",
    ),
    "Which groups train": ("rollout_consumption_window", "dynamic_sampling", "dynamic_sampling_limit"),
    "Rewards and tools": ("rollout_scoring_threads", "rollout_tool_threads", "rollout_tool_timeout_s"),
    "Weight sync": ("weight_sync_bucket_mb", "rollout_verify_weights", "rollout_lora_sync"),
    "Faults": ("rollout_timeout_s", "rollout_max_restarts", "rollout_heartbeat_timeout_s"),
    "Auditing": ("rollout_trajectory_file",),
}

# GRPOConfig's own fields that the async trainer reads differently, and what they become
FROM_TRL = (
    ("use_vllm=False", "transformers worker processes (`rollout_backend='transformers'`)"),
    ("use_vllm=True, vllm_mode='server'", "the running vLLM servers, one lane each (`rollout_backend='vllm'`)"),
    (
        "use_vllm=True, vllm_mode='colocate'",
        "a vLLM server process the trainer starts beside itself on its own GPU and stops at the end (not yet run on a "
        "GPU: docs/distributed.md)",
    ),
    ("vllm_server_base_url, vllm_server_host/port", "the server URL, unless `rollout_vllm_urls` names several"),
    ("vllm_server_timeout", "how long the trainer waits for the servers to be healthy at start"),
    (
        "vllm_importance_sampling_correction",
        "not used: `off_policy_correction` already corrects the engine mismatch and the staleness in one ratio",
    ),
    ("vllm_enable_sleep_mode=True", "refused with colocate (the server must generate while the trainer steps)"),
    ("steps_per_generation, generation_batch_size", "the generation batch the pool hands over per take, unchanged"),
    ("temperature, top_k, top_p, min_p, repetition_penalty", "the workers' sampler; the importance ratio rebuilds it"),
    (
        "use_transformers_continuous_batching (or the older use_transformers_paged)",
        "the transformers workers batch continuously: a finished row's slot takes the next waiting row at once, and "
        "new weights are adopted between decode steps (unless `rollout_weight_update='batch'`), the rows in flight "
        "re-encoded so every token comes from one version. `rollout_batch_groups * num_generations` rows decode at "
        "once per worker. A CPU worker runs a slot loop on one KV cache, a GPU worker transformers' paged engine. "
        "The slot loop applies `repetition_penalty` and `min_new_tokens` per row; the paged engine does not, and "
        "neither applies beam search or the other processors that read a row's history (refused at construction). "
        "Worth it where completion lengths differ (`benchmarks/continuous_batching.py`)",
    ),
    (
        "transformers_continuous_batching_config",
        "with continuous batching on, a non-empty dict makes the workers run transformers' paged engine with "
        "these settings, on a CPU too; its KV cache is sized for the rows (32-token pages) unless the dict sets "
        "`num_blocks` or `max_memory_percent` (transformers' own pages then). "
        "`return_logprobs`, `allow_block_sharing`, `use_async_batching` and `cpu_offload_space` are the workers' "
        "to set (refused if given otherwise)",
    ),
)


def _default(f) -> str:
    if f.default is not MISSING:
        return repr(f.default)
    return repr(f.default_factory()) if f.default_factory is not MISSING else "required"


def _fields() -> dict:
    return {f.name: f for f in fields(AsyncFields) if f.init}


def docstring() -> str:
    """TRL's style: grouped ``name (type, default): help`` entries."""
    by_name = _fields()
    lines = ["``trl.GRPOConfig`` plus the async fields below.", "", "Parameters:"]
    for group, names in GROUPS.items():
        lines += ["", f"    > {group}", ""]
        for name in names:
            f = by_name[name]
            lines.append(f"    {name} (`{f.type}`, defaults to `{_default(f)}`):")
            lines.append(f"        {f.metadata['help']}")
    return "\n".join(lines) + "\n"


def markdown() -> str:
    by_name = _fields()
    out = [
        "# Configuration",
        "",
        "`AsyncGRPOConfig` is `trl.GRPOConfig` plus the fields below; every GRPOConfig field keeps its meaning. A",
        "wrong value raises `ValueError` at construction, naming the field and the fix. This page is generated from",
        "the fields' help (`python -m trl_async.config.reference > docs/configuration.md`).",
        "",
        "## From GRPOConfig",
        "",
        "| GRPOConfig | in the async trainer |",
        "|---|---|",
    ]
    out += [f"| `{trl}` | {ours} |" for trl, ours in FROM_TRL]
    for group, names in GROUPS.items():
        out += ["", f"## {group}", "", "| field | default | meaning |", "|---|---|---|"]
        for name in names:
            f = by_name[name]
            meaning = f.metadata["help"].replace("|", "\\|")
            out.append(f"| `{name}` | `{_default(f)}` | {meaning} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
