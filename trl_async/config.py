"""``AsyncGRPOConfig``: ``trl.GRPOConfig`` plus the few fields asynchronous training needs.

The async fields live once, in ``AsyncFields``; ``AsyncGRPOConfig`` mixes them into ``GRPOConfig``, and a plain
``GRPOConfig`` given to the trainer gets ``AsyncFields()`` defaults. Every field is validated at construction; the
error names the field and the fix.
"""

from __future__ import annotations

import copy
import os
import warnings
from dataclasses import dataclass, field, fields
from typing import Literal, get_args

import torch
from trl import GRPOConfig

from .cores import allowed_cores, parse_cpu_list, split_cores
from .engine_choice import rollout_engine
from .generation_modes import refused_generation_kwargs
from .precision import NativePrecision
from .sampling import SAMPLER_FIELDS, VLLM_GREEDY_BELOW, refused_sampling

# the allowed values, written once: the fields' annotations (which TRL's parser reads as choices) and the checks
RolloutBackend = Literal["transformers", "vllm"]
WeightTransport = Literal["auto", "nccl", "gloo"]
WeightUpdatePoint = Literal["batch", "decode_step"]
OffPolicyCorrection = Literal["decoupled", "tis", "mask", "seq_tis", "seq_mask", "none"]
ROLLOUT_BACKENDS = get_args(RolloutBackend)
ROLLOUT_DTYPES = ("float32", "bfloat16", "float16")
WEIGHT_TRANSPORTS = get_args(WeightTransport)
WEIGHT_UPDATE_POINTS = get_args(WeightUpdatePoint)
OFF_POLICY_CORRECTIONS = get_args(OffPolicyCorrection)
DEFAULT_CAPS = {"decoupled": 5.0}  # AReaL's behav_imp_weight_cap in its examples; 2.0 (verl/SkyRL TIS) otherwise


def available_cores() -> int:
    """How many cores this process may run on (its CPU affinity where the OS reports one)."""
    cores = allowed_cores()
    return len(cores) if cores else os.cpu_count() or 1


@dataclass
class AsyncFields:
    """The async-only settings. Three of them are the dials of async RL: ``max_staleness``,
    ``rollout_batch_groups`` and ``weight_sync_steps``."""

    rollout_backend: RolloutBackend | None = field(
        default=None,
        metadata={
            "help": "Generation engine. 'transformers': background worker processes that run `model.generate` on "
            "their own copy of the policy. 'vllm': vLLM servers, one lane per server. Default: GRPOConfig's "
            "`use_vllm` decides, as in GRPOTrainer: use_vllm=True with vllm_mode='server' uses the running servers "
            "(vllm_server_base_url, or vllm_server_host and vllm_server_port, or rollout_vllm_urls); with "
            "vllm_mode='colocate' the trainer starts a vLLM server on its own GPU and stops it when training ends."
        },
    )
    rollout_vllm_urls: list[str] | None = field(
        default=None,
        metadata={
            "help": "vLLM server URLs for rollout_backend='vllm' (several servers = more generation throughput behind "
            "the same queue). Default: GRPOConfig's `vllm_server_base_url`, else http://vllm_server_host:"
            "vllm_server_port. The trainer waits `vllm_server_timeout` seconds for them to be healthy."
        },
    )
    rollout_vllm_weight_transport: WeightTransport = field(
        default="auto",
        metadata={
            "help": "How weights reach the vLLM servers: 'nccl' (vLLM's NCCL weight-transfer engine, GPU servers), "
            "'gloo' (the trl_async_gloo engine, CPU servers), 'auto' = the engine the servers were started with (their "
            "/server_info), e.g. nccl for a server started by `trl vllm-serve`."
        },
    )
    rollout_vllm_max_requests: int | None = field(
        default=None,
        metadata={
            "help": "Most concurrent generate requests (one per group, each on its own thread) per vLLM server. "
            "Default: rollout_queue_size, at most 256 (every admitted group may be in flight; admission control "
            "already bounds it)."
        },
    )
    rollout_vllm_adapter_dir: str | None = field(
        default=None,
        metadata={
            "help": "With LoRA and vLLM servers (rollout_lora_sync='adapters'): where each version's adapter is "
            "written for the servers to load. They must read it at the same path (a shared disk for servers on "
            "other machines). Default: the temporary directory."
        },
    )
    rollout_vllm_down_limit_s: float | None = field(
        default=600.0,
        metadata={
            "help": "A vLLM server that stops answering is replaced by a lane that waits for it: what it held is "
            "generated again on the other servers, training goes on with them, and when it answers again at the same "
            "URL, serving the same model, it is re-synced with the current weights and takes work again. Training "
            "stops once one server has been down this many seconds (None: never), or every server for "
            "rollout_vllm_retry_s. Each loss counts toward rollout_max_restarts."
        },
    )
    rollout_vllm_python: str | None = field(
        default=None,
        metadata={
            "help": "vllm_mode='colocate': the Python interpreter that runs the server the trainer starts (vLLM "
            "installed in another environment). Default: the trainer's own."
        },
    )
    rollout_vllm_server_args: list[str] | None = field(
        default=None,
        metadata={
            "help": "vllm_mode='colocate': more `vllm serve` arguments for the server the trainer starts, e.g. "
            "['--enforce-eager']. It already gets the model, vllm_gpu_memory_utilization, vllm_tensor_parallel_size, "
            "vllm_max_model_length and vllm_model_impl."
        },
    )
    rollout_vllm_retry_s: float = field(
        default=30.0,
        metadata={
            "help": "A vLLM request that fails to connect, times out or gets a 5xx is retried with backoff for this "
            "long, then training stops with an error naming the server."
        },
    )
    num_rollout_workers: int = field(
        default=1, metadata={"help": "Number of background rollout worker processes (each holds a policy copy)."}
    )
    rollout_device: str | None = field(
        default=None,
        metadata={
            "help": "Device the transformers rollout workers generate on, e.g. 'cpu' or 'cuda:1'. Default: the CPU "
            "for a CPU trainer; for a CUDA trainer a GPU no trainer rank uses if there is one, else the trainer's "
            "own (said at start)."
        },
    )
    max_staleness: int = field(
        default=1,
        metadata={
            "help": "Staleness tolerance: the most optimizer steps a consumed token's policy version may lag the "
            "trainer. 0 gives synchronous GRPO semantics. Older samples are dropped, never trained on."
        },
    )
    rollout_batch_groups: int | None = field(
        default=None,
        metadata={
            "help": "Rollout batch size: prompt groups a worker generates in one `generate` call. Default: one "
            "generation batch split evenly over the workers."
        },
    )
    weight_sync_steps: int = field(
        default=1,
        metadata={
            "help": "Weight-sync frequency: publish the trainer's weights to the workers every this many "
            "optimizer steps. Must be <= max_staleness + 1."
        },
    )
    rollout_queue_size: int | None = field(
        default=None,
        metadata={
            "help": "Most groups queued or in flight at once (memory bound, backpressure). Default: what "
            "admission control allows, (max_staleness // steps_per_batch + 1) generation batches."
        },
    )
    rollout_weight_update: WeightUpdatePoint | None = field(
        default=None,
        metadata={
            "help": "When generation adopts new weights: 'batch' between generate calls (vLLM: a push waits for "
            "running requests to finish), or 'decode_step' between decode steps (in flight; a completion may then "
            "carry tokens of several versions, each tagged with its own). Default: 'batch' for transformers "
            "workers, 'decode_step' for vLLM servers."
        },
    )
    rollout_torch_threads: int | None = field(
        default=None,
        metadata={
            "help": "torch threads per rollout worker process. Default: the cores this process may run on "
            "(os.sched_getaffinity) divided among the workers, at least 1."
        },
    )
    rollout_cpu_affinity: str | None = field(
        default=None,
        metadata={
            "help": "CPU cores the rollout workers run on, as `taskset -c` writes them ('1', '0-3', '4-7,12'; a "
            "list of ints also works); the trainer process keeps the other cores it may run on while it trains. "
            "Workers share the given cores out in contiguous runs, each with as many torch threads as cores (unless "
            "rollout_torch_threads); the trainer gets as many threads as it keeps cores. This is how a CPU server "
            "gives generation its own cores (and how one emulates a dedicated generation device). With "
            "rollout_backend='vllm' only the trainer is pinned: start the server with `taskset -c CORES` and "
            "VLLM_CPU_OMP_THREADS_BIND=CORES. Linux. Default: no pinning (both sides share every core, the workers "
            "at lower priority, see rollout_nice)."
        },
    )
    rollout_nice: int | None = field(
        default=None,
        metadata={
            "help": "Scheduling niceness added to each rollout worker process (0-19; 19 = lowest priority). Default: "
            "19 when the workers generate on the CPU (they fill the trainer's idle moments instead of competing "
            "with it for the cores the two share), 0 on a GPU or when rollout_cpu_affinity gives them cores of "
            "their own."
        },
    )
    rollout_dtype: str | None = field(
        default=None,
        metadata={
            "help": "dtype the rollout workers generate in ('float32', 'bfloat16', 'float16'). Default: the dtype "
            "the trainer computes in: bfloat16 with `bf16=True` (float32 weights under autocast), float16 with "
            "`fp16=True`, where the workers' device computes that dtype natively (trl_async.precision: AVX512-BF16 "
            "or AMX on x86 CPUs), else the weights' dtype (and always the weights' dtype with rollout_verify_weights). A "
            "precision other than the trainer's is corrected like staleness: behaviour log-probs come from the "
            "worker, pi_prox from the trainer."
        },
    )
    rollout_timeout_s: float = field(
        default=300.0,
        metadata={
            "help": "Longest the trainer waits for rollouts before raising an error that says what it waited "
            "for (includes worker start-up for the first batch). With vLLM servers also how long a server may fail "
            "its health check while it runs a generation; one generation itself may take longer, and is never sent "
            "twice."
        },
    )
    rollout_max_restarts: int = field(
        default=3,
        metadata={
            "help": "How many times a lost rollout worker (killed, crashed or hung) is restarted with the current "
            "weights before training stops with an error. Its in-flight groups are generated again. 0 = fail at "
            "the first loss."
        },
    )
    rollout_heartbeat_timeout_s: float = field(
        default=10.0,
        metadata={
            "help": "A rollout worker that sends no heartbeat (every 0.5 s) for this long is treated as hung "
            "(e.g. stopped): it is killed, then restarted or reported."
        },
    )
    rollout_scoring_threads: int = field(
        default=1,
        metadata={
            "help": "Finished groups scored at once, each on its own thread of the main process. 1: one group at a "
            "time, in arrival order. Raise it when reward functions wait (a verifier, a sandbox, an HTTP judge): "
            "their latency then overlaps. Reward functions must then be safe to call from several threads at once "
            "(each thread gets its own tokenizer copies; async reward functions share one event loop)."
        },
    )
    rollout_tool_threads: int = field(
        default=16,
        metadata={
            "help": "With `tools`: episodes whose tool calls run at once, each on a thread of the main process (async "
            "tools share one event loop). An episode waiting for its tool never holds up another's generation."
        },
    )
    rollout_tool_timeout_s: float | None = field(
        default=120.0,
        metadata={
            "help": "With `tools`: the longest one tool call may take; a call that does not return in time is "
            "reported to the model as a failed call ({'error': ...}) and counted in tools/failure_frequency. None: "
            "wait forever, as GRPOTrainer does. A timed-out sync tool keeps running on a daemon thread."
        },
    )
    rollout_trajectory_file: str | None = field(
        default=None,
        metadata={
            "help": "Append every consumed completion to this JSONL file (relative paths are under output_dir; one "
            "file per process under multi-process training, suffixed .rank<N>): prompt, completion, each reward "
            "function's value, advantage, staleness, per-token versions, and the prompt and completion token ids "
            "with each token's behaviour log-prob mu, for auditing a run (every importance weight can be recomputed)."
        },
    )
    off_policy_correction: OffPolicyCorrection | None = field(
        default=None,
        metadata={
            "help": "Staleness weight w = f(pi_prox/mu) multiplied into GRPOTrainer's per-token loss, whose "
            "clipped ratio is taken against pi_prox. 'decoupled' (AReaL): rho, tokens with rho > cap dropped; "
            "'tis': min(rho, cap); 'mask': rho inside [floor, cap], else 0; 'seq_tis'/'seq_mask': the same with "
            "the geometric mean of a sequence's token ratios; 'none': w = 1, stale samples treated as on-policy "
            "(ablation only). Default None: 'decoupled', or 'tis' under loss_type='vespo' (VESPO folds the token "
            "weights into its own sequence weight, where only truncation composes: see the validation error)."
        },
    )
    importance_sampling_cap: float | None = field(
        default=None,
        metadata={
            "help": "Cap C (upper bound C_max for the mask modes), > 1. Default: 5.0 for 'decoupled', 2.0 otherwise."
        },
    )
    importance_sampling_floor: float = field(
        default=0.5, metadata={"help": "Lower bound C_min of the 'mask'/'seq_mask' band, in [0, 1)."}
    )
    off_policy_bypass: bool = field(
        default=False,
        metadata={
            "help": "Skip the pi_prox forward pass and use pi_prox := mu: GRPOTrainer's clipped ratio becomes "
            "pi_theta/mu and w = 1. Faster, but the trust region then also has to absorb the staleness."
        },
    )
    rollout_consumption_window: int | None = field(
        default=None,
        metadata={
            "help": "Which ready groups the trainer may take. None: in the order they finish (a slow group never "
            "delays the others, but long episodes grow stale while short ones overtake them, so they are dropped "
            "and generated again, or never train: the trained mix leans toward what finishes fast). k: only groups "
            "admitted within k of the oldest group not yet trained, so the oldest is overtaken by at most k - 1 "
            "others (1: strict admission order, which admission control assumes; the trainer then waits for the "
            "slowest group of each batch)."
        },
    )
    dynamic_sampling: bool = field(
        default=False,
        metadata={
            "help": "DAPO's dynamic sampling: a scored group whose rewards give every completion the same advantage "
            "(0: all equal, as GRPOTrainer's frac_reward_zero_std counts them) is dropped before it takes a batch "
            "slot, and another prompt is generated in its place, so every trained group carries signal. Its prompt "
            "counts as consumed (not retried), as in DAPO. Logged: async/filtered_groups (total) and "
            "async/filtered_frac. Default off: every group trains, as in GRPOTrainer."
        },
    )
    dynamic_sampling_limit: int | None = field(
        default=50,
        metadata={
            "help": "With dynamic_sampling: stop with an error after this many generation batches' worth of groups in "
            "a row had no signal (a saturated task, or a reward constant by mistake); a warning after every 5 "
            "batches' worth. None: never stop. (A healthy task that filters 90% of its groups reaches 50 batches' "
            "worth in a row with 2 groups per batch about once in 380,000 groups.)"
        },
    )
    weight_sync_bucket_mb: float = field(
        default=8.0,
        metadata={
            "help": "Weight sync moves the policy in buckets of at most this many MB (under ZeRO-3, one "
            "gather per bucket), which bounds the extra memory a sync needs."
        },
    )
    rollout_verify_weights: bool = field(
        default=False,
        metadata={
            "help": "Debug aid: workers hash the weights they adopt and the trainer checks every hash against "
            "the weights it published (one hash of the model per sync on each side)."
        },
    )
    rollout_lora_sync: str = field(
        default="adapters",
        metadata={
            "help": "With a LoRA peft_config, what a weight sync sends the rollout workers or vLLM servers. 'adapters': "
            "the frozen base once, then only the adapter factors of each version (tens of MB instead of the whole "
            "model): the transformers workers merge them themselves; each vLLM server loads each version as a named "
            "adapter (files in rollout_vllm_adapter_dir; start it with --enable-lora --max-lora-rank R --max-loras "
            "max_staleness+2). 'merged': the merged full weights every time. 'adapters' falls back to 'merged', "
            "saying why once, for LoRA on embeddings, trainable parameters outside the adapters (modules_to_save, "
            "bias='all' or 'lora_only'), and a vLLM server without LoRA or with a smaller --max-lora-rank.",
            "choices": ["adapters", "merged"],
        },
    )

    vllm_colocate: bool = field(default=False, init=False, repr=False)  # resolved: vllm_mode='colocate'

    def validate_async_fields(self, loss_type: str | None = None, use_vllm: bool = False, vllm_mode: str = "colocate",
                              vllm_enable_sleep_mode: bool = False) -> None:  # fmt: skip
        """Check every async field (``ValueError`` naming the field and the fix) and resolve the defaults that
        depend on GRPO's own settings (``loss_type``; ``use_vllm`` and ``vllm_mode`` choose the engine)."""
        choice = rollout_engine(self.rollout_backend, use_vllm, vllm_mode, self.rollout_vllm_urls,
                                vllm_enable_sleep_mode)  # fmt: skip
        self.rollout_backend, self.vllm_colocate = choice.backend, choice.colocate

        def need(ok: bool, name: str, fix: str) -> None:
            if not ok:
                raise ValueError(f"AsyncGRPOConfig.{name}={getattr(self, name)!r} is invalid: {fix}")

        if self.off_policy_correction is None:
            self.off_policy_correction = "tis" if loss_type == "vespo" else "decoupled"
        if loss_type == "vespo":
            # GRPOTrainer's VESPO sums log w over a sequence into its gamma weight instead of multiplying w per token
            # (as TRL itself requires token-level truncation or masking for its vLLM correction under VESPO): a
            # dropped token (w = 0) would zero its whole sequence, and a sequence weight would be raised to the power
            # of the length. Truncation composes: log min(rho, C) per token is VESPO's own token-truncated weight.
            need(
                self.off_policy_correction in ("tis", "none") or self.off_policy_bypass,
                "off_policy_correction",
                "with loss_type='vespo' use 'tis' (the default there): VESPO sums the log of every token's weight "
                "into one sequence weight, so a token dropped by 'decoupled'/'mask' (w = 0) would silence its whole "
                "sequence and a 'seq_*' weight would count once per token",
            )

        if self.rollout_backend == "transformers":
            refused = refused_generation_kwargs(
                getattr(self, "generation_kwargs", None) or {}, getattr(self, "top_k", None)
            )
            need(refused is None, "generation_kwargs", refused or "")
        need(
            self.rollout_backend != "vllm" or "n" not in (getattr(self, "generation_kwargs", None) or {}),
            "generation_kwargs",
            "'n' (vLLM's completions per request) would replace num_generations behind the trainer's back, and each "
            "group would hold a different number of completions than GRPOTrainer's advantages assume: remove 'n' and "
            "set num_generations",
        )
        engine_temperature = (getattr(self, "generation_kwargs", None) or {}).get("temperature")
        need(
            self.rollout_backend != "vllm" or engine_temperature is None or engine_temperature >= VLLM_GREEDY_BELOW,
            "generation_kwargs",
            f"temperature={engine_temperature} makes vLLM sample greedily, and vLLM then refuses more than one "
            "completion per request (num_generations): use a temperature of at least 1e-5",
        )
        beams = (getattr(self, "generation_kwargs", None) or {}).get("num_beams") or 1
        sampler_fields = {name: getattr(self, name, None) for name in SAMPLER_FIELDS}
        refused = refused_sampling(self.rollout_backend, sampler_fields, getattr(self, "generation_kwargs", None),
                                   self.off_policy_correction != "none" or self.off_policy_bypass,
                                   self.off_policy_bypass)  # fmt: skip
        if refused is not None and beams == 1:  # beam tokens have no mu, so no ratio (beams are refused otherwise)
            need(False, *refused)
        need(
            beams == 1 or not self.off_policy_bypass,
            "off_policy_bypass",
            f"generation_kwargs num_beams={beams} is beam search, which samples from no distribution: its tokens "
            "have no behaviour log-prob, and the bypass takes that log-prob as the proximal policy (every beam token "
            "would leave the loss). Use off_policy_bypass=False (beam tokens then train uncorrected, ratio 1, as "
            "with GRPOTrainer) or num_beams=1",
        )
        need(
            beams == 1 or self.rollout_backend != "vllm",
            "rollout_backend",
            f"generation_kwargs num_beams={beams} is transformers' beam search; a vLLM server's sampling parameters "
            "have no num_beams (vLLM's generation_kwargs are its SamplingParams). Remove num_beams, or use "
            "rollout_backend='transformers'",
        )
        need(self.rollout_backend in ROLLOUT_BACKENDS, "rollout_backend", f"choose one of {ROLLOUT_BACKENDS}")
        need(
            self.rollout_vllm_weight_transport in WEIGHT_TRANSPORTS,
            "rollout_vllm_weight_transport",
            f"choose one of {WEIGHT_TRANSPORTS}",
        )
        need(
            self.rollout_vllm_urls is None
            or (
                isinstance(self.rollout_vllm_urls, (list, tuple))
                and all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in self.rollout_vllm_urls)
            ),
            "rollout_vllm_urls",
            "give a list of server URLs such as ['http://10.0.0.2:8000'], or None",
        )
        need(
            self.rollout_vllm_max_requests is None or self.rollout_vllm_max_requests >= 1,
            "rollout_vllm_max_requests",
            "set it to 1 or more, or None for the default",
        )
        need(self.rollout_vllm_retry_s >= 0, "rollout_vllm_retry_s", "set 0 or more seconds")
        need(
            self.rollout_vllm_down_limit_s is None or self.rollout_vllm_down_limit_s > 0,
            "rollout_vllm_down_limit_s",
            "set a positive number of seconds, or None to wait for a lost server as long as others work",
        )
        need(
            self.rollout_vllm_adapter_dir is None or isinstance(self.rollout_vllm_adapter_dir, (str, os.PathLike)),
            "rollout_vllm_adapter_dir",
            "set a directory path the vLLM servers can read, or None for the temporary directory",
        )
        if self.rollout_backend == "vllm":
            need(
                not self.rollout_verify_weights,
                "rollout_verify_weights",
                "weight hashing is for the transformers workers; with vLLM the greedy-output check in the tests "
                "covers the push. Set it to False",
            )
        need(
            isinstance(self.num_rollout_workers, int) and self.num_rollout_workers >= 1,
            "num_rollout_workers",
            "set it to 1 or more",
        )
        try:
            device = torch.device(self.rollout_device or "cpu")
        except (RuntimeError, TypeError) as exc:
            raise ValueError(
                f"AsyncGRPOConfig.rollout_device={self.rollout_device!r} is invalid: use a torch device "
                f"string such as 'cpu' or 'cuda:1' ({exc})"
            ) from exc
        need(device.type in ("cpu", "cuda"), "rollout_device", "use 'cpu' or a 'cuda:N' device")
        need(
            isinstance(self.max_staleness, int) and self.max_staleness >= 0,
            "max_staleness",
            "set it to 0 (synchronous semantics) or more",
        )
        need(
            self.rollout_batch_groups is None or self.rollout_batch_groups >= 1,
            "rollout_batch_groups",
            "set it to 1 or more, or None for the default",
        )
        need(
            isinstance(self.weight_sync_steps, int) and self.weight_sync_steps >= 1,
            "weight_sync_steps",
            "set it to 1 or more",
        )
        need(
            self.weight_sync_steps <= self.max_staleness + 1,
            "weight_sync_steps",
            f"with max_staleness={self.max_staleness} the trainer would wait for samples no worker may generate; "
            f"set weight_sync_steps <= {self.max_staleness + 1} or raise max_staleness to >= "
            f"{self.weight_sync_steps - 1}",
        )
        need(
            self.rollout_queue_size is None or self.rollout_queue_size >= 1,
            "rollout_queue_size",
            "set it to 1 or more, or None for the default",
        )
        need(
            self.rollout_weight_update is None or self.rollout_weight_update in WEIGHT_UPDATE_POINTS,
            "rollout_weight_update",
            f"choose one of {WEIGHT_UPDATE_POINTS}, or None for the backend's default",
        )
        need(
            self.rollout_torch_threads is None
            or (isinstance(self.rollout_torch_threads, int) and self.rollout_torch_threads >= 1),
            "rollout_torch_threads",
            "set it to 1 or more, or None for the cores available divided among the workers",
        )
        need(isinstance(self.dynamic_sampling, bool), "dynamic_sampling", "set True or False")
        need(
            self.rollout_consumption_window is None
            or (type(self.rollout_consumption_window) is int and self.rollout_consumption_window >= 1),
            "rollout_consumption_window",
            "set None (arrival order) or a whole number of groups >= 1 (1: strict admission order)",
        )
        need(
            self.dynamic_sampling_limit is None
            or (isinstance(self.dynamic_sampling_limit, int) and self.dynamic_sampling_limit >= 1),
            "dynamic_sampling_limit",
            "set a number of generation batches >= 1, or None for no limit",
        )
        if self.rollout_cpu_affinity is not None:
            self.validate_cpu_affinity()
        need(
            self.rollout_nice is None or (isinstance(self.rollout_nice, int) and 0 <= self.rollout_nice <= 19),
            "rollout_nice",
            "set a niceness from 0 (same priority as the trainer) to 19 (lowest), or None for the default",
        )
        need(
            self.rollout_dtype is None or self.rollout_dtype in ROLLOUT_DTYPES,
            "rollout_dtype",
            f"choose one of {ROLLOUT_DTYPES}, or None for the trainer's dtype",
        )
        if self.rollout_dtype is not None:
            need(
                self.rollout_backend == "transformers",
                "rollout_dtype",
                "it sets the transformers workers' dtype; a vLLM server's dtype is its own `--dtype`. Set it to None",
            )
            need(
                not self.rollout_verify_weights,
                "rollout_verify_weights",
                "workers converting weights to rollout_dtype cannot reproduce the trainer's bytes. Set one of them "
                "back to its default",
            )
        need(self.weight_sync_bucket_mb > 0, "weight_sync_bucket_mb", "set a positive size in MB")
        need(self.rollout_lora_sync in ("adapters", "merged"), "rollout_lora_sync", "set 'adapters' or 'merged'")
        need(self.rollout_timeout_s > 0, "rollout_timeout_s", "set a positive number of seconds")
        need(
            isinstance(self.rollout_scoring_threads, int) and self.rollout_scoring_threads >= 1,
            "rollout_scoring_threads",
            "set it to 1 or more (1: one group at a time)",
        )
        need(
            isinstance(self.rollout_tool_threads, int) and self.rollout_tool_threads >= 1,
            "rollout_tool_threads",
            "set it to 1 or more",
        )
        need(
            self.rollout_tool_timeout_s is None or self.rollout_tool_timeout_s > 0,
            "rollout_tool_timeout_s",
            "set a positive number of seconds, or None to wait forever",
        )
        need(self.rollout_max_restarts >= 0, "rollout_max_restarts", "set 0 or more (0: fail at the first loss)")
        need(
            self.rollout_heartbeat_timeout_s >= 2.0,
            "rollout_heartbeat_timeout_s",
            "set 2 seconds or more (workers beat every 0.5 s; a busy machine delays beats)",
        )
        need(
            self.off_policy_correction in OFF_POLICY_CORRECTIONS,
            "off_policy_correction",
            f"choose one of {OFF_POLICY_CORRECTIONS}",
        )
        need(
            self.importance_sampling_cap is None or self.importance_sampling_cap > 1.0,
            "importance_sampling_cap",
            "set a cap > 1 (e.g. 2.0), or None for the mode's default",
        )
        need(0.0 <= self.importance_sampling_floor < 1.0, "importance_sampling_floor", "set a floor in [0, 1)")
        if self.off_policy_correction == "none" and self.max_staleness > 0 and not self.off_policy_bypass:
            warnings.warn(
                f"off_policy_correction='none' with max_staleness={self.max_staleness}: samples up to "
                f"{self.max_staleness} steps stale are trained on as if on-policy (meant for ablations). Use "
                "'decoupled' (default) or 'tis' for real runs.",
                UserWarning,
                stacklevel=3,
            )

    def validate_cpu_affinity(self) -> None:
        def refuse(why: str):
            raise ValueError(f"AsyncGRPOConfig.rollout_cpu_affinity={self.rollout_cpu_affinity!r} is invalid: {why}")

        allowed = allowed_cores()
        if allowed is None:
            refuse("this OS does not let a process choose its cores (no os.sched_setaffinity); leave it None")
        try:
            split_cores(parse_cpu_list(self.rollout_cpu_affinity), allowed, self.num_rollout_workers)
        except ValueError as exc:
            refuse(str(exc))

    def core_split(self):
        """``CoreSplit`` of ``rollout_cpu_affinity`` against this process's cores now, or ``None`` when unset."""
        if self.rollout_cpu_affinity is None:
            return None
        return split_cores(parse_cpu_list(self.rollout_cpu_affinity), allowed_cores(), self.num_rollout_workers)

    @property
    def resolved_rollout_threads(self) -> int:
        if self.rollout_torch_threads is not None:
            return self.rollout_torch_threads
        return max(1, available_cores() // self.num_rollout_workers)

    def resolved_rollout_dtype(
        self, weights: torch.dtype, bf16: bool, fp16: bool, native: NativePrecision
    ) -> torch.dtype:
        """``rollout_dtype`` if set; else the dtype the trainer computes in (bf16/fp16 under mixed precision, where
        the trainer's matmuls see its float32 weights rounded to that dtype) where the workers' device computes it
        natively (``native``, trl_async.precision), else the weights' dtype; the weights' dtype always when weights
        are verified bit for bit."""
        if self.rollout_dtype:
            return getattr(torch, self.rollout_dtype)
        if self.rollout_verify_weights or weights != torch.float32:
            return weights
        mixed = torch.bfloat16 if bf16 else torch.float16 if fp16 else weights
        return mixed if native.native(mixed) else weights

    @property
    def resolved_rollout_nice(self) -> int:
        if self.rollout_nice is not None:
            return self.rollout_nice
        if self.rollout_cpu_affinity is not None:
            return 0  # cores of their own: nothing to yield to
        return 19 if torch.device(self.rollout_device or "cpu").type == "cpu" else 0

    @property
    def resolved_weight_update(self) -> str:
        if self.rollout_weight_update is not None:
            return self.rollout_weight_update
        return "decode_step" if self.rollout_backend == "vllm" else "batch"

    @property
    def resolved_importance_sampling_cap(self) -> float:
        if self.importance_sampling_cap is not None:
            return self.importance_sampling_cap
        return DEFAULT_CAPS.get(self.off_policy_correction, 2.0)


def async_fields_of(args: GRPOConfig) -> AsyncFields:
    """The async settings of ``args``: its own for an ``AsyncGRPOConfig``, the defaults for a plain ``GRPOConfig``."""
    settings = AsyncFields(**{f.name: getattr(args, f.name) for f in fields(AsyncFields)
                              if f.init and hasattr(args, f.name)})  # fmt: skip
    settings.validate_async_fields(**trl_engine_fields(args))
    return settings


def trl_engine_fields(args) -> dict:
    """GRPOConfig's fields that the async settings resolve against."""
    return {"loss_type": getattr(args, "loss_type", None), "use_vllm": getattr(args, "use_vllm", False),
            "vllm_mode": getattr(args, "vllm_mode", "colocate"),
            "vllm_enable_sleep_mode": getattr(args, "vllm_enable_sleep_mode", False)}  # fmt: skip


def for_grpo_trainer(args):
    """``args`` as GRPOTrainer's own set-up must see them: with ``use_vllm`` off (a copy), since the async settings
    already turned TRL's vLLM fields into the rollout engine, and GRPOTrainer would otherwise start or connect to a
    vLLM of its own."""
    if args is None or not getattr(args, "use_vllm", False):
        return args
    parent = copy.copy(args)
    parent.use_vllm = False
    return parent


@dataclass
class AsyncGRPOConfig(GRPOConfig, AsyncFields):
    """``trl.GRPOConfig`` with the async fields of ``AsyncFields`` (see each field's help)."""

    def __post_init__(self):
        super().__post_init__()
        given = self.rollout_backend
        self.validate_async_fields(**trl_engine_fields(self))
        # kept as set: the engine is resolved again, with use_vllm as it is then, wherever the settings are read
        # (async_fields_of), so a config copied with another use_vllm follows it
        self.rollout_backend, self.vllm_colocate = given, False
