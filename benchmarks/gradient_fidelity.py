"""Gradient fidelity: how close is the corrected gradient of a k-stale batch to the true on-policy gradient?

A tiny policy is trained for K steps on the CPU demo task (on-policy), keeping every version theta_0..theta_K. The
trainer sits at theta_K. For each staleness k, batches are sampled from theta_{K-k} (the behaviour policy mu, with its
log-probs), and GRPOTrainer's own loss (``_compute_loss``, DAPO by default) is differentiated at theta_K with each
correction mode's ``old_per_token_logps`` / ``importance_sampling_ratio``. The reference is the on-policy gradient at
theta_K averaged over many fresh batches. Reported: cosine similarity, mean over repeats (k = 0 shows the noise
ceiling of one batch).

With ``--top_p``/``--top_k`` the workers sample from a truncated distribution. Every mode then takes pi_prox
processed the same way (``trl_async.correction.sampling``), and two more columns show the alternatives: ``decoupled_full``, the
full softmax as pi_prox (the ratio is then the kept mass even at k = 0), and ``decoupled_kept_mu``, pi_prox
renormalised over the tokens mu's sampler kept (the engines would have to return that set per token). The last
columns are each one's mean ratio and gradient norm relative to the same batch's uncorrected (``none``) gradient: the
cosine does not see a gradient scaled by the kept mass.

    python benchmarks/gradient_fidelity.py            # ~2 min on 2 cores
    python benchmarks/gradient_fidelity.py --top_p 0.9 --top_k 20
    python benchmarks/gradient_fidelity.py --quick

Writes benchmarks/results/gradient_fidelity[_truncated].{json,png} and the table in benchmarks/RESULTS.md.
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
from trl_async.correction.importance import off_policy_correction  # noqa: E402
from trl_async.correction.sampling import context_ids, processors  # noqa: E402
from trl_async.demo.tiny import save_tiny_model  # noqa: E402
from trl_async.engines.transformers.worker import generate_groups  # noqa: E402
from trl_async.records import RolloutTask  # noqa: E402

MODES = ["none", "bypass", "tis", "mask", "seq_tis", "seq_mask", "decoupled"]
TRUNCATED_MODES = ["decoupled_full", "decoupled_kept_mu"]  # pi_prox as before the fix; as TRL 1.17 renormalises
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


def completion_logits(model, batch: dict) -> torch.Tensor:
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)).logits
    return logits[:, batch["prompt_ids"].size(1) - 1 : -1].float()


def kept_by_mu(trainer, behaviour, batch: dict) -> torch.Tensor:
    """(B, T, V) bool: the tokens mu's sampler kept at each completion position."""
    logits, chain = completion_logits(behaviour, batch), processors(trainer._sampling)
    return torch.stack([
        torch.isfinite(chain(context_ids(p, c, logits.size(-1)), logits[i]))
        for i, (p, c) in enumerate(zip(batch["prompt_ids"], batch["completion_ids"], strict=True))
    ])  # fmt: skip


def renormalised_over(trainer, batch: dict, kept: torch.Tensor) -> torch.Tensor:
    """log pi_prox(a) - log sum over mu's kept set of pi_prox: TRL 1.17's renormalisation."""
    logps = torch.log_softmax(completion_logits(trainer.model, batch) / trainer.temperature, -1)
    token = logps.gather(-1, batch["completion_ids"].unsqueeze(-1))[..., 0]
    return token - torch.logsumexp(logps.masked_fill(~kept, -torch.inf), -1)


def gradient(trainer, batch: dict, mode: str, stats: list | None = None) -> torch.Tensor:
    model = trainer.model
    inputs = {k: v for k, v in batch.items() if k not in ("mu", "kept")}
    if mode != "none":
        full, processed = trainer._proximal_logps(inputs)
        if mode == "bypass":
            prox = full = batch["mu"]
        elif mode == "decoupled_full":
            prox = full
        elif mode == "decoupled_kept_mu":
            prox = renormalised_over(trainer, inputs, batch["kept"])
        else:
            prox = processed
        name = "tis" if mode == "bypass" else mode.removesuffix("_full").removesuffix("_kept_mu")
        correction = off_policy_correction(
            prox, batch["mu"], inputs["completion_mask"], name, CAPS.get(name, 2.0), 0.5
        )
        inputs["old_per_token_logps"], inputs["importance_sampling_ratio"] = full, correction.weights_BT
        if stats is not None:
            stats.append(correction.stats)
    model.zero_grad()
    trainer._compute_loss(model, inputs).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--top_k", type=int, default=0)
    cli = parser.parse_args()
    truncated = cli.top_p < 1.0 or cli.top_k > 0
    modes = MODES + TRUNCATED_MODES if truncated else MODES
    name = "gradient_fidelity_truncated" if truncated else "gradient_fidelity"
    torch.set_num_threads(1)
    train_steps, staleness_values = (8, [0, 4, 8]) if cli.quick else (16, [0, 1, 2, 4, 8, 16])
    repeats, ref_batches, prompts_per_batch = (3, 4, 16) if cli.quick else (8, 16, 32)

    work = tempfile.mkdtemp(prefix="grad_fidelity_")
    model_dir = str(save_tiny_model(os.path.join(work, "model"), chars=tiny_demo.VOCAB))
    settings = {**tiny_demo.DEMO_DEFAULTS, "output_dir": os.path.join(work, "out"), "max_steps": train_steps}
    settings.update(learning_rate=cli.lr, max_staleness=0, logging_steps=100, top_p=cli.top_p, top_k=cli.top_k)
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

    cos, norm, stats = {}, {}, {}
    for k in staleness_values:
        behaviour.load_state_dict(versions.states[train_steps - k])
        for r in range(repeats):
            batch = sample_batch(trainer, behaviour, prompts, 1_000 * k + r)
            if truncated:
                batch["kept"] = kept_by_mu(trainer, behaviour, batch)
            for mode in modes:
                g = gradient(trainer, batch, mode, stats.setdefault((k, mode), []))
                cos.setdefault((k, mode), []).append(torch.nn.functional.cosine_similarity(g, reference, 0).item())
                if mode == "none":
                    uncorrected = g.norm()
                norm.setdefault((k, mode), []).append((g.norm() / uncorrected).item())
        ess = statistics.fmean(st["ess"] for st in stats[(k, "tis")])
        kl = statistics.fmean(st["kl_behaviour"] for st in stats[(k, "tis")])
        print(
            f"k={k} (ESS {ess:.3f}, KL {kl:.4f}): "
            + ", ".join(f"{m} {statistics.fmean(cos[(k, m)]):.3f}" for m in modes),
            flush=True,
        )

    rows = [
        [k, statistics.fmean(st["kl_behaviour"] for st in stats[(k, "tis")]),
         statistics.fmean(st["ess"] for st in stats[(k, "decoupled")])] + [statistics.fmean(cos[(k, m)]) for m in modes]
        for k in staleness_values
    ]  # fmt: skip
    header = ["staleness k", "KL(μ‖π_prox)", "ESS (decoupled)"] + modes
    if truncated:  # the mean ratio, and the gradient's norm relative to the same batch's uncorrected one
        compared = ("decoupled", "decoupled_full", "decoupled_kept_mu")
        header += [f"{what} {m}" for what in ("ratio mean", "norm") for m in compared]
        rows = [row + [statistics.fmean(st["ratio_mean"] for st in stats[(k, m)]) for m in compared]
                + [statistics.fmean(norm[(k, m)]) for m in compared] for k, row in zip(staleness_values, rows, strict=True)]  # fmt: skip
    table = report.markdown_table(header, rows)
    report.write_json(
        name,
        {"settings": {"train_steps": train_steps, "repeats": repeats, "ref_batches": ref_batches, "top_p": cli.top_p,
                      "top_k": cli.top_k, "temperature": trainer.temperature,
                      "samples_per_batch": prompts_per_batch * trainer.num_generations},
         "cosine": {f"{k}/{m}": v for (k, m), v in cos.items()},
         "norm_ratio": {f"{k}/{m}": v for (k, m), v in norm.items()}},
    )  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in modes:
        ax.plot(staleness_values, [statistics.fmean(cos[(k, m)]) for k in staleness_values], marker="o", label=m)
    ax.set(xlabel="staleness k (behaviour = theta_{K-k})", ylabel="cosine to on-policy gradient")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(report.png_path(name), dpi=110)
    command = "python benchmarks/gradient_fidelity.py" + (" --quick" if cli.quick else "")
    if truncated:
        command += f" --top_p {cli.top_p} --top_k {cli.top_k}"
    sampler = f", sampling at temperature {trainer.temperature} with top_p {cli.top_p}, top_k {cli.top_k}"
    report.update_readme(
        name,
        f"### Gradient fidelity (`{command}`)\n\nCosine similarity between the "
        f"corrected gradient of one {prompts_per_batch * trainer.num_generations}-sample batch from a k-stale policy "
        f"and the on-policy gradient ({ref_batches} fresh batches), mean of {repeats} batches; policy trained "
        f"{train_steps} steps at lr {cli.lr}{sampler if truncated else ''}.\n\n{table}\n\n![](results/{name}.png)",
    )
    print(table)


if __name__ == "__main__":
    main()
