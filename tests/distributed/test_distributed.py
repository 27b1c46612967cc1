"""Real 2-process training under `accelerate launch` on CPU (gloo): DDP, DeepSpeed ZeRO-2, ZeRO-3, ZeRO-3 + LoRA,
FSDP2 (resumed from a checkpoint on the way, then GRPOTrainer itself trained in the same launch as the control) and
FSDP2 + LoRA (TRL's FSDP2 config with 2 processes; accelerate's
CPU gate opened by the launched script, tests/distributed/fsdp_cpu.py).

After training, the workers' weights (the last published version, which is the final trainer state since weights
are published after every step) must equal the consolidated trainer weights exactly (LoRA: equal to peft's own merge
of the consolidated weights, up to float rounding of the merge), every adoption must have hashed equal to what the
trainer published, the staleness bound must hold and no worker may survive. The first DeepSpeed launch on a fresh
machine compiles a C++ op (~2 min, cached in ~/.cache/torch_extensions).
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from trl_async.engines.vllm.client import VLLMServer

ROOT = Path(__file__).resolve().parents[2]
# every launched process (ranks and their rollout workers) dumps each thread's Python stack on a fatal signal
# (SIGSEGV, SIGABRT, ...): a native abort leaves more than its exit code (train_and_check.py adds the C++ stack)
LAUNCH_ENV = {"OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}


@pytest.mark.parametrize(
    "config,extra",
    [
        ("ddp", ["--use_cpu", "--iterable"]),  # the prompts from an IterableDataset (map-style: the others)
        ("zero2", []),
        ("zero3", []),
        ("zero3", ["--peft"]),
        ("zero3_offload", []),
        ("fsdp2", ["--fsdp_on_cpu", "--max_staleness", "0", "--resume", "--control"]),
        ("fsdp2", ["--fsdp_on_cpu", "--peft"]),
        ("fsdp2", ["--fsdp_on_cpu", "--peft", "--lora_sync", "merged"]),
    ],
    ids=["ddp-iterable", "zero2", "zero3", "zero3-lora", "zero3-offload", "fsdp2", "fsdp2-lora", "fsdp2-lora-merged"],
)
def test_two_process_training_syncs_exact_weights(tmp_path, tiny_model_dir, config, extra):
    out = tmp_path / "result.json"
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / f"recipes/accelerate/{config}.yaml"),
        str(ROOT / "tests/distributed/train_and_check.py"), "--model", tiny_model_dir, "--out", str(out), *extra,
    ]  # fmt: skip
    env = {**os.environ, **LAUNCH_ENV}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-20000:]  # a native abort: room for its stacks
    result = json.loads(out.read_text())
    assert result["num_processes"] == 2 and result["steps"] == 3
    assert result["zero_stage"] == {"ddp": 0, "zero2": 2, "zero3": 3, "zero3_offload": 3, "fsdp2": 0}[config]
    if config == "fsdp2":  # every parameter sharded across the two ranks (a DTensor), gathered bucket by bucket
        sharded, params = result["sharded_params"]
        assert result["fsdp_version"] == 2 and sharded == params > 0
    if "--control" in extra:  # GRPOTrainer itself trains in this launch: every parameter sharded, and moved
        control = result["control"]
        assert control["steps"] == 2 and control["sharded"] == control["params"] > 0, control
        assert control["changed"] >= control["params"], control  # (a tied output layer counts as its own entry)
    if "--resume" in extra:  # a first run saved at step 2 and ended; a new trainer resumed from its checkpoint
        assert (tmp_path / "run" / "checkpoint-2").is_dir()
    assert result["mismatches"] == []
    assert all("inv_freq" in name for name in result["not_compared"])  # non-persistent buffers only
    assert result["compared"] == result["expected"] - len(result["not_compared"]) >= 20
    assert result["verified_adoptions"] >= 2 and result["max_staleness_seen"] <= 1
    assert result["workers_alive"] == [False]
    # the correction's statistics are global, as GRPOTrainer's metrics are: each rank's own batch differs, and both
    # ranks log the same gathered values
    is_logs = [json.loads((tmp_path / f"result.json.is.rank{r}").read_text()) for r in (0, 1)]
    assert len(is_logs[0]) == 3 and "is/kl_behaviour" in is_logs[0][0] and is_logs[0] == is_logs[1]
    if "--max_staleness" in extra:  # 0: the workers sampled with the weights being trained, token for token
        assert all(abs(log[k] - 1) < 1e-3 for log in is_logs[0] for k in ("is/ratio_min", "is/ratio_max")), is_logs[0]
    if "merged" in extra:  # every version: the merged full weights, gathered and merged per layer on every rank
        assert not result["adapter_only"] and len(result["per_version"]) == result["expected"]
    elif (
        "--peft" in extra
    ):  # adapter-only sync: each version carries the q/v adapters of the 2 layers and their scales
        assert result["adapter_only"]
        assert len(result["per_version"]) == 2 * 2 * 2 + 1 and all(
            ".lora_A." in n or ".lora_B." in n or n == "lora_scales" for n in result["per_version"]
        ), result["per_version"]
    # every rank trains on one whole group of each step's global batch (2 groups), and its advantages are
    # GRPOTrainer's group-normalised rewards, (r - mean) / (std + 1e-4), worked out here from the logged rewards
    traj = {
        r: [json.loads(x) for x in (tmp_path / "run" / f"traj.jsonl.rank{r}").read_text().splitlines()] for r in (0, 1)
    }
    prompts = [x["prompt_index"] for r in (0, 1) for x in traj[r][::4]]  # one group of 4 rows per rank and step
    assert len(prompts) == 6 and len(set(prompts)) == 6, prompts  # none trained twice, across a resume too
    for step in range(3):
        rows = {r: [x for x in traj[r] if x["step"] == step] for r in (0, 1)}
        groups = {r: {x["group_id"] for x in rows[r]} for r in (0, 1)}
        assert len(rows[0]) == len(rows[1]) == 4 and len(groups[0]) == len(groups[1]) == 1 and groups[0] != groups[1]
        for r in (0, 1):
            rewards = torch.tensor([x["rewards"]["reward"] for x in rows[r]])
            expected = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
            assert torch.allclose(torch.tensor([x["advantage"] for x in rows[r]]), expected, atol=1e-4)


@pytest.mark.parametrize("config,extra", [("zero3", []), ("fsdp2", ["--fsdp_on_cpu"])], ids=["zero3", "fsdp2"])
def test_a_sharded_trainer_pushes_its_gathered_weights_to_a_vllm_server(
    tmp_path, vllm_model_dir, vllm_server, config, extra
):
    """2-process ZeRO-3 or FSDP2 (every parameter sharded) generating on a real vLLM CPU server: both ranks stream the
    buckets in lock-step, rank 0 pushes each one over gloo before the next gather; after training the server's greedy
    output is the consolidated model's, and every token trained on was tagged by the server with a version within the
    bound."""
    out = tmp_path / "result.json"
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / f"recipes/accelerate/{config}.yaml"),
        str(ROOT / "tests/distributed/train_and_check.py"), "--model", vllm_model_dir, "--out", str(out),
        "--vllm_url", vllm_server.url, *extra,
    ]  # fmt: skip
    env = {**os.environ, **LAUNCH_ENV}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-20000:]  # a native abort: room for its stacks
    result = json.loads(out.read_text())
    assert result["num_processes"] == 2 and result["steps"] == 3
    assert (result["zero_stage"], result["fsdp_version"]) == {"zero3": (3, None), "fsdp2": (0, 2)}[config]
    assert result["server_version"] == {"0": 3} and result["max_staleness_seen"] <= 1
    check_the_server_samples_the_trained_weights(vllm_model_dir, tmp_path / "final.pt", vllm_server.url)
    for r in (0, 1):
        for row in map(json.loads, (tmp_path / "run" / f"traj.jsonl.rank{r}").read_text().splitlines()):
            assert row["versions"] and all(row["step"] - 1 <= v <= row["step"] for v in row["versions"])


def check_the_server_samples_the_trained_weights(model_dir, final: Path, url: str) -> None:
    """The server's greedy output is that of the consolidated trainer weights (``final``)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.load_state_dict(torch.load(final))  # strict: the consolidated trainer weights, all of them
    server = VLLMServer(url)
    for prompt in ([5, 6, 7, 8, 9], [20, 3, 11]):
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)
        got = server.generate(
            prompt, {"n": 1, "max_tokens": 12, "temperature": 0.0, "logprobs": 0, "ignore_eos": True}
        )
        assert list(got[0].token_ids) == expected[0, len(prompt) :].tolist()


@pytest.mark.parametrize("config,extra", [("zero3", []), ("fsdp2", ["--fsdp_on_cpu"])], ids=["zero3", "fsdp2"])
def test_a_sharded_reward_model_scores_on_rank_0_without_the_other_rank(tmp_path, tiny_model_dir, config, extra):
    """Under ZeRO-3 GRPOTrainer shards reward models with DeepSpeed, so their forward is a collective; our scorer runs
    on rank 0's background thread, where the other rank never joins. Rank 0 keeps an unsharded copy for scoring: the
    run finishes, and every recorded score equals the reward model's own output on that text. Under FSDP2
    GRPOTrainer leaves reward models whole on every rank (accelerate's prepare_model in evaluation mode does not
    shard): the scorer uses them as they are, and a TRL that starts sharding them fails here."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, Qwen2Config

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    rm_config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    rm_dir = tmp_path / "rm"
    AutoModelForSequenceClassification.from_config(rm_config).save_pretrained(rm_dir)
    tokenizer.save_pretrained(rm_dir)
    out = tmp_path / "result.json"
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / f"recipes/accelerate/{config}.yaml"),
        str(ROOT / "tests/distributed/train_and_check.py"), "--model", tiny_model_dir, "--out", str(out),
        "--reward_model", str(rm_dir), *extra,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **LAUNCH_ENV}, start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired as exc:
        import psutil  # torchrun starts each rank in its own session: kill the whole tree, then the pipes close

        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"{config} training with a reward model hung (300 s)") from exc
    assert proc.returncode == 0, stdout[-2000:] + stderr[-20000:]
    result = json.loads(out.read_text())
    assert (result["zero_stage"], result["fsdp_version"]) == {"zero3": (3, None), "fsdp2": (0, 2)}[config]
    if config == "fsdp2":
        assert result["sharded_reward_params"] == [0]
    rm = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    rows = [json.loads(x) for r in (0, 1) for x in (tmp_path / "run" / f"traj.jsonl.rank{r}").read_text().splitlines()]
    assert len(rows) == 3 * 8
    for row in rows:
        ids = tokenizer(row["prompt"] + row["completion"], return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            expected = rm(**ids).logits[0, 0].item()
        assert row["rewards"]["rm"] == pytest.approx(expected, abs=1e-4)


def test_a_rank_that_stops_arriving_is_named_not_waited_for_forever(tmp_path, tiny_model_dir):
    out = tmp_path / "result.json"
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "recipes/accelerate/ddp.yaml"),
        str(ROOT / "tests/distributed/train_and_check.py"), "--model", tiny_model_dir, "--out", str(out), "--use_cpu",
        "--stall_rank1", "300",
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONFAULTHANDLER": "1"}
    )
    assert proc.returncode != 0  # failed well before rank 1 woke up (300 s) and before the 300 s test timeout
    error = json.loads(out.read_text())["error"]
    assert "not every rank reached the next rollout batch" in error and "Ranks 1 failed" in error


def launch_machines(tmp_path: Path, config: str, model_dir: str, extra: list[str], per_machine: int = 1) -> list[Path]:
    """Two "machines" on this host, ``per_machine`` ranks each: two `accelerate launch` commands with
    ``--num_machines 2``, each writing into a folder of its own (its own disk). Returns each machine's folder."""
    from trl_async.engines.vllm.weight_push.fan_out import free_port

    port, folders, procs = free_port(), [], []
    for machine in (0, 1):
        folders.append(tmp_path / f"machine{machine}")
        folders[-1].mkdir()
        cmd = [
            sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / f"recipes/accelerate/{config}.yaml"),
            "--num_machines", "2", "--machine_rank", str(machine), "--num_processes", str(2 * per_machine),
            "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
            *(["--deepspeed_multinode_launcher", "standard"] if config.startswith("zero") else []),  # torchrun
            str(ROOT / "tests/distributed/train_and_check.py"), "--model", model_dir,
            "--out", str(folders[-1] / "result.json"), *extra,
        ]  # fmt: skip
        procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env={**os.environ, **LAUNCH_ENV}, start_new_session=True))  # fmt: skip
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=400)[0])
    finally:
        for proc in procs:  # torchrun starts each rank in a session of its own: the whole tree goes
            if proc.poll() is None:
                import psutil

                for child in psutil.Process(proc.pid).children(recursive=True):
                    child.kill()
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    for machine, (proc, output) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"machine {machine}:\n{output[-20000:]}"
    return folders


def test_two_machines_train_with_workers_on_the_global_main_rank_alone(tmp_path, tiny_model_dir):
    """FSDP2, one rank per machine (DDP: two per machine, below). The second machine's rank is its machine's main
    process but not the global main: it starts no rollout pool (no workers, no scorers), receives its share of each
    batch, and writes only its own trajectories; the first machine's workers hold the consolidated trainer weights
    exactly after every sync."""
    folders = launch_machines(tmp_path, "fsdp2", tiny_model_dir, ["--fsdp_on_cpu"])
    places = [json.loads((folders[r] / f"result.json.place.rank{r}").read_text()) for r in (0, 1)]
    assert places == [{"local_index": 0, "pool": True}, {"local_index": 0, "pool": False}]
    assert not (folders[1] / "result.json").exists()  # the result (and the weights compared) are rank 0's
    result = json.loads((folders[0] / "result.json").read_text())
    assert result["num_processes"] == 2 and result["steps"] == 3 and result["mismatches"] == []
    assert result["compared"] == result["expected"] - len(result["not_compared"]) >= 20
    assert result["verified_adoptions"] >= 2 and result["workers_alive"] == [False]
    assert result["fsdp_version"] == 2
    traj = [
        [json.loads(x) for x in (folders[r] / "run" / f"traj.jsonl.rank{r}").read_text().splitlines()] for r in (0, 1)
    ]
    assert [list((folders[r] / "run").iterdir()) for r in (0, 1)] == [
        [folders[r] / "run" / f"traj.jsonl.rank{r}"] for r in (0, 1)
    ]  # each machine's disk holds its own rank's trajectories, nothing else
    prompts = [x["prompt_index"] for rows in traj for x in rows[::4]]  # one group of 4 rows per rank and step
    assert len(prompts) == 6 and len(set(prompts)) == 6, prompts


def test_two_machines_of_two_ranks_each_keep_the_pool_on_the_global_main_rank(tmp_path, tiny_model_dir):
    """DDP on two "machines" of two ranks each: the second machine's local main (global rank 2) is not mistaken for
    the global main; every rank trains its own share of each batch, no prompt twice; the workers hold the trainer's
    weights exactly after every sync."""
    folders = launch_machines(tmp_path, "ddp", tiny_model_dir, ["--use_cpu"], per_machine=2)
    machine_of = {0: 0, 1: 0, 2: 1, 3: 1}
    places = [json.loads((folders[machine_of[r]] / f"result.json.place.rank{r}").read_text()) for r in range(4)]
    assert places == [{"local_index": local, "pool": rank == 0} for rank, local in enumerate([0, 1, 0, 1])]
    assert not (folders[1] / "result.json").exists()
    result = json.loads((folders[0] / "result.json").read_text())
    assert result["num_processes"] == 4 and result["steps"] == 3 and result["mismatches"] == []
    assert result["compared"] == result["expected"] - len(result["not_compared"]) >= 20
    assert result["verified_adoptions"] >= 2 and result["workers_alive"] == [False]
    for machine, ranks in ((0, (0, 1)), (1, (2, 3))):  # each machine's disk: its own ranks' trajectories alone
        assert sorted(p.name for p in (folders[machine] / "run").iterdir()) == [f"traj.jsonl.rank{r}" for r in ranks]
    traj = [
        [json.loads(x) for x in (folders[machine_of[r]] / "run" / f"traj.jsonl.rank{r}").read_text().splitlines()]
        for r in range(4)
    ]
    assert all(sorted({x["step"] for x in rows}) == [0, 1, 2] for rows in traj)
    prompts = [x["prompt_index"] for rows in traj for x in rows[::4]]  # one group of 4 rows per rank and step
    assert len(prompts) == 12 and len(set(prompts)) == 12, prompts


def test_two_machines_push_to_a_vllm_server_from_the_global_main_rank(tmp_path, vllm_model_dir, vllm_server):
    """ZeRO-3 across two "machines": both ranks gather each bucket, the first machine's rank pushes it to the server,
    which then samples exactly as the consolidated trainer weights do."""
    folders = launch_machines(tmp_path, "zero3", vllm_model_dir, ["--vllm_url", vllm_server.url])
    result = json.loads((folders[0] / "result.json").read_text())
    assert result["zero_stage"] == 3 and result["server_version"] == {"0": 3}
    places = [json.loads((folders[r] / f"result.json.place.rank{r}").read_text()) for r in (0, 1)]
    assert [p["pool"] for p in places] == [True, False]
    check_the_server_samples_the_trained_weights(vllm_model_dir, folders[0] / "final.pt", vllm_server.url)
