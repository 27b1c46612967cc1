"""The async-only fields, each with its default and help. ``AsyncGRPOConfig`` mixes them into ``GRPOConfig``.

Allowed values are written once, as ``Literal`` annotations: TRL's argument parser offers them as choices, and the
checks (``checks.py``) derive their tuples from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from .defaults import ResolvedDefaults

RolloutBackend = Literal["transformers", "vllm"]
WeightTransport = Literal["auto", "nccl", "gloo"]
WeightUpdatePoint = Literal["batch", "decode_step"]
OffPolicyCorrection = Literal["decoupled", "tis", "mask", "seq_tis", "seq_mask", "none"]
RolloutDtype = Literal["float32", "bfloat16", "float16"]
LoraSync = Literal["adapters", "merged"]
ROLLOUT_BACKENDS = get_args(RolloutBackend)
WEIGHT_TRANSPORTS = get_args(WeightTransport)
WEIGHT_UPDATE_POINTS = get_args(WeightUpdatePoint)
OFF_POLICY_CORRECTIONS = get_args(OffPolicyCorrection)
ROLLOUT_DTYPES = get_args(RolloutDtype)
LORA_SYNCS = get_args(LoraSync)


@dataclass
class AsyncFields(ResolvedDefaults):
    """The async-only settings. Three of them are the dials of async RL: ``max_staleness``,
    ``rollout_batch_groups`` and ``weight_sync_steps``. A run's own copy is resolved once and then sealed
    (``resolve_settings``): read-only from then on."""

    def seal(self) -> None:
        object.__setattr__(self, "_sealed", True)

    def __setattr__(self, name, value):
        if self.__dict__.get("_sealed"):
            raise AttributeError(f"the run's settings are resolved once and read-only: {name} cannot change now")
        super().__setattr__(name, value)

    rollout_backend: RolloutBackend | None = field(
        default=None,
        metadata={
            "help": "Generation engine. 'transformers': background worker processes that run `model.generate` on "
            "their own copy of the policy. 'vllm': vLLM servers, one lane per server. Default: GRPOConfig's "
            "`use_vllm` decides, as in GRPOTrainer: use_vllm=True with vllm_mode='server' uses the running servers "
            "(vllm_server_base_url, or vllm_server_host and vllm_server_port, or rollout_vllm_urls); with "
            "vllm_mode='colocate' the trainer starts a vLLM server process beside itself on its own GPU, pushes "
            "weights to it over NCCL, and stops it when training ends (colocate has not yet run on a GPU: see "
            "docs/distributed.md)."
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
            "help": "How weights reach the vLLM servers: 'nccl' (vLLM's NCCL weight-transfer engine, GPU servers; "
            "the trainer's environment needs vLLM, the version the servers run), 'gloo' (the trl_async_gloo engine, "
            "CPU servers; the servers' environment needs trl_async), 'auto' = the engine the servers were started "
            "with (their /server_info), e.g. nccl for a server started by `trl vllm-serve`."
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
            "installed in another environment). Default: the trainer's own, so vLLM must be installed in the "
            "trainer's environment."
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
            "help": "Rollout batch size: prompt groups a worker generates at once (one `generate` call; with "
            "use_transformers_continuous_batching, its rows decoding at once). Default: one generation batch split "
            "evenly over the workers."
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
            "help": "When generation adopts new weights: 'batch' between generate calls (continuous batching: when "
            "no row is decoding; vLLM: a push waits for running requests to finish), or 'decode_step' between "
            "decode steps (in flight; a completion may then carry tokens of several versions, each tagged with its "
            "own). Default: 'decode_step' for vLLM servers and continuously batching workers, 'batch' for "
            "transformers workers that batch statically."
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
    rollout_dtype: RolloutDtype | None = field(
        default=None,
        metadata={
            "help": "dtype the rollout workers generate in ('float32', 'bfloat16', 'float16'). Default: the dtype "
            "the trainer computes in: bfloat16 with `bf16=True` (float32 weights under autocast), float16 with "
            "`fp16=True`, where the workers' device computes that dtype natively (trl_async.hardware.precision: AVX512-BF16 "
            "or AMX on x86 CPUs), else the weights' dtype (and always the weights' dtype with "
            "rollout_verify_weights). A precision other than the trainer's is corrected like staleness: behaviour "
            "log-probs come from the worker, pi_prox from the trainer."
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
            "batches' worth. None: never stop. The default is far beyond chance for a healthy task: if 9 groups in "
            "10 are filtered independently, 100 in a row (50 batches of 2 groups) have probability 0.9^100, about "
            "3e-5."
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
    rollout_lora_sync: LoraSync = field(
        default="adapters",
        metadata={
            "help": "With a LoRA peft_config, what a weight sync sends the rollout workers or vLLM servers. "
            "'adapters': the frozen base once, then only the adapter factors of each version (tens of MB instead of "
            "the whole model): the transformers workers merge them themselves; each vLLM server loads each version as "
            "a named adapter (files in rollout_vllm_adapter_dir; start it with --enable-lora --max-lora-rank R "
            "--max-loras max_staleness+2). 'merged': the merged full weights every time. 'adapters' falls back to "
            "'merged', saying why once, for LoRA on embeddings, trainable parameters outside the adapters "
            "(modules_to_save, bias='all' or 'lora_only'), and a vLLM server without LoRA or with a smaller "
            "--max-lora-rank.",
        },
    )

    vllm_colocate: bool = field(default=False, init=False, repr=False)  # resolved: vllm_mode='colocate'
