"""Gradient fidelity: how close is the corrected gradient of a k-stale batch to the true on-policy gradient?

A tiny policy is trained for K steps on the CPU demo task (on-policy), keeping every version theta_0..theta_K. The
trainer sits at theta_K. For each staleness k, batches are sampled from theta_{K-k} (the behaviour policy mu, with its
log-probs), and GRPOTrainer's own loss (``_compute_loss``, DAPO by default) is differentiated at theta_K with each
correction mode's ``old_per_token_logps`` / ``importance_sampling_ratio``. The reference is the on-policy gradient at
theta_K averaged over many fresh batches. Reported: cosine similarity, mean over repeats (k = 0 shows the noise
ceiling of one batch).

    python benchmarks/gradient_fidelity.py            # ~2 min on 2 cores
    python benchmarks/gradient_fidelity.py --quick

Writes benchmarks/results/gradient_fidelity.{json,png} and the table in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import report  # noqa: E402
import tiny_demo  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, TrainerCallback  # noqa: E402

from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer  # noqa: E402
from trl_async.correction import off_policy_correction  # noqa: E402
from trl_async.engines.transformers.worker import generate_groups  # noqa: E402
from trl_async.records import RolloutTask  # noqa: E402
from trl_async.tiny import save_tiny_model  # noqa: E402

MODES = ["none", "bypass", "tis", "mask", "seq_tis", "seq_mask", "decoupled"]
CAPS = {"decoupled": 5.0}


class Versions(TrainerCallback):
    def __init__(self):
        self.states = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.states.append({k: v.detach().clone() for k, v in model.state_dict().items()})

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.states.append({k: v.detach().clone() for k, v in model.state_dict().items()})


def sample_batch(trainer, behaviour, prompts: list[str], generator_seed: int) -> dict:
    """Completions from ``behaviour`` (a model at theta_{K-k}), as the tensors GRPOTrainer's loss reads."""
    tok = trainer.processing_class
    g = trainer.num_generations
    tasks = [RolloutTask(i, i, tuple(tok(p)["input_ids"]), 0) for i, p in enumerate(prompts)]
    torch.manual_seed(generator_seed)
    groups = generate_groups(
        behaviour, tasks, trainer.generation_config, g, trainer.eos_token_ids, tok.pad_token_id, lambda: 0
    )
    completions = [c for grp in groups for c in grp.completion_ids]
    logps = [lp for grp in groups for lp in grp.logprobs]
    width = max(len(c) for c in completions)
    n = len(completions)
    completion_ids = torch.full((n, width), tok.pad_token_id)
    mask = torch.zeros(n, width, dtype=torch.long)
    mu = torch.zeros(n, width)
    for i, (c, lp) in enumerate(zip(completions, logps, strict=True)):
        completion_ids[i, : len(c)], mask[i, : len(c)], mu[i, : len(c)] = torch.tensor(c), 1, torch.tensor(lp)
    texts = tok.batch_decode(completion_ids, skip_special_tokens=True)
    rewards = torch.tensor(tiny_demo.spelling_reward(None, texts)).view(-1, g)
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).view(-1)
    prompt_ids = torch.tensor([list(t.prompt_ids) for t in tasks for _ in range(g)])  # equal lengths: no padding
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": mask,
        "advantages": advantages,
        "num_items_in_batch": mask.sum(),
        "mu": mu,
    }


def gradient(trainer, batch: dict, mode: str, stats: list | None = None) -> torch.Tensor:
    model = trainer.model
    inputs = {k: v for k, v in batch.items() if k != "mu"}
    if mode != "none":
        prox = batch["mu"] if mode == "bypass" else trainer._proximal_logps(inputs)
        name = "tis" if mode == "bypass" else mode
        correction = off_policy_correction(
            prox, batch["mu"], inputs["completion_mask"], name, CAPS.get(name, 2.0), 0.5
        )
        inputs["old_per_token_logps"], inputs["importance_sampling_ratio"] = prox, correction.weights_BT
        if stats is not None:
            stats.append(correction.stats)
    model.zero_grad()
    trainer._compute_loss(model, inputs).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--lr", type=float, default=2e-3)
    cli = parser.parse_args()
    torch.set_num_threads(1)
    train_steps, staleness_values = (8, [0, 4, 8]) if cli.quick else (16, [0, 1, 2, 4, 8, 16])
    repeats, ref_batches, prompts_per_batch = (3, 4, 16) if cli.quick else (8, 16, 32)

    work = tempfile.mkdtemp(prefix="grad_fidelity_")
    model_dir = str(save_tiny_model(os.path.join(work, "model"), chars=tiny_demo.VOCAB))
    settings = {**tiny_demo.DEMO_DEFAULTS, "output_dir": os.path.join(work, "out"), "max_steps": train_steps}
    settings.update(learning_rate=cli.lr, max_staleness=0, logging_steps=100)
    versions = Versions()
    dataset = tiny_demo.make_dataset()
    trainer = AsyncGRPOTrainer(
        model=model_dir, reward_funcs=tiny_demo.spelling_reward, args=AsyncGRPOConfig(**settings),
        train_dataset=dataset, callbacks=[versions],
    )  # fmt: skip
    trainer.train()
    trainer.current_gradient_accumulation_steps = 1
    current = versions.states[-1]
    behaviour = AutoModelForCausalLM.from_pretrained(model_dir).eval()  # its own parameters
    prompts = [dataset[i % len(dataset)]["prompt"] for i in range(prompts_per_batch)]

    trainer.model.load_state_dict(current)
    trainer.model.train()
    behaviour.load_state_dict(current)
    reference = torch.stack(
        [gradient(trainer, sample_batch(trainer, behaviour, prompts, 10_000 + i), "none") for i in range(ref_batches)]
    ).mean(0)

    cos, stats = {}, {}
    for k in staleness_values:
        behaviour.load_state_dict(versions.states[train_steps - k])
        for r in range(repeats):
            batch = sample_batch(trainer, behaviour, prompts, 1_000 * k + r)
            for mode in MODES:
                g = gradient(trainer, batch, mode, stats.setdefault((k, mode), []))
                cos.setdefault((k, mode), []).append(torch.nn.functional.cosine_similarity(g, reference, 0).item())
        ess = statistics.fmean(st["ess"] for st in stats[(k, "tis")])
        kl = statistics.fmean(st["kl_behaviour"] for st in stats[(k, "tis")])
        print(
            f"k={k} (ESS {ess:.3f}, KL {kl:.4f}): "
            + ", ".join(f"{m} {statistics.fmean(cos[(k, m)]):.3f}" for m in MODES),
            flush=True,
        )

    rows = [
        [k, statistics.fmean(st["kl_behaviour"] for st in stats[(k, "tis")]),
         statistics.fmean(st["ess"] for st in stats[(k, "decoupled")])] + [statistics.fmean(cos[(k, m)]) for m in MODES]
        for k in staleness_values
    ]  # fmt: skip
    table = report.markdown_table(["staleness k", "KL(μ‖π_prox)", "ESS (decoupled)"] + MODES, rows)
    report.write_json(
        "gradient_fidelity",
        {"settings": {"train_steps": train_steps, "repeats": repeats, "ref_batches": ref_batches,
                      "samples_per_batch": prompts_per_batch * trainer.num_generations},
         "cosine": {f"{k}/{m}": v for (k, m), v in cos.items()}},
    )  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in MODES:
        ax.plot(staleness_values, [statistics.fmean(cos[(k, m)]) for k in staleness_values], marker="o", label=m)
    ax.set(xlabel="staleness k (behaviour = theta_{K-k})", ylabel="cosine to on-policy gradient")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(report.png_path("gradient_fidelity"), dpi=110)
    command = "python benchmarks/gradient_fidelity.py" + (" --quick" if cli.quick else "")
    report.update_readme(
        "gradient_fidelity",
        f"### Gradient fidelity (`{command}`)\n\nCosine similarity between the corrected gradient of one "
        f"{prompts_per_batch * trainer.num_generations}-sample batch from a k-stale policy and the on-policy "
        f"gradient ({ref_batches} fresh batches), mean of {repeats} batches; policy trained {train_steps} steps "
        f"at lr {cli.lr}.\n\n{table}\n\n![](results/gradient_fidelity.png)",
    )
    print(table)


if __name__ == "__main__":
    main()
