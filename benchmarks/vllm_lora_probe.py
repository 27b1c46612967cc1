"""Does the CPU vLLM build serve a LoRA adapter, and sample from what peft computes? (A check before building
adapter-only sync to vLLM servers.)

Starts the project's CPU vLLM server (tests/vllm_server.py: float32, eager) on SmolLM2-135M-Instruct with
``--enable-lora``, loads a peft adapter (rank 16 on the attention and MLP projections, random factors) from a
directory through ``/v1/load_lora_adapter``, samples completions with it and with the base model, and compares each
sampled token's log-prob (temperature 1, so the processed log-probs are the model's; runtime adapter loading needs
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` in the server's environment) with a teacher-forced forward of
peft's own model with that adapter, and of the base model.

    python benchmarks/vllm_lora_probe.py      # ~2 min on 2 cores

Writes benchmarks/results/vllm_lora_probe.json and its lines in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import json
import sys
import tempfile
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

RANK = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = ["Tom has 3 apples and buys 4 more. How many apples does Tom have now?", "Name a colour."]


def post(url: str, payload: dict) -> dict | str:
    request = urllib.request.Request(url, json.dumps(payload).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        body = response.read().decode()
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        return body


def main() -> None:
    import report
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.vllm_server import start_server
    from trl_async.demo.pretrained import smollm2_135m_instruct

    torch.manual_seed(0)
    model_dir = str(smollm2_135m_instruct())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS,
                                           init_lora_weights=False)).eval()  # fmt: skip
    with torch.no_grad():  # random but moderate factors: the adapter changes the distribution, the text stays text
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.05)
    work = Path(tempfile.mkdtemp(prefix="vllm_lora_"))
    peft_model.save_pretrained(work / "adapter")
    server = start_server(model_dir, work / "server.log",
                          extra_flags=["--enable-lora", "--max-lora-rank", str(RANK), "--max-loras", "3"],
                          extra_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})  # /v1/load_lora_adapter  # fmt: skip
    result: dict = {"rank": RANK, "targets": TARGETS}
    try:
        loaded = post(f"{server.url}/v1/load_lora_adapter", {"lora_name": "v1", "lora_path": str(work / "adapter")})
        result["load_response"] = loaded
        for served, reference in (("v1", peft_model), (model_dir, None)):
            errors, tokens, effect = [], 0, []
            for prompt in PROMPTS:
                ids = list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                         tokenize=True, return_dict=True)["input_ids"])  # fmt: skip
                out = post(f"{server.url}/v1/completions", {"model": served, "prompt": ids, "max_tokens": 24,
                                                            "temperature": 1.0, "seed": 1, "logprobs": 0,
                                                            "return_token_ids": True})  # fmt: skip
                choice = out["choices"][0]
                completion = list(choice["token_ids"])
                logprobs = choice["logprobs"]["token_logprobs"]
                full = torch.tensor([ids + completion])
                with torch.no_grad():
                    if reference is None:
                        with peft_model.disable_adapter():
                            logits = peft_model(input_ids=full).logits
                    else:
                        logits = peft_model(input_ids=full).logits
                expected = torch.log_softmax(logits[0, len(ids) - 1 : -1].float(), -1)
                expected = expected.gather(-1, torch.tensor(completion)[:, None])[:, 0]
                errors += [abs(a - float(b)) for a, b in zip(logprobs, expected, strict=True)]
                if reference is not None:  # how much the adapter moves these tokens' log-probs (the probe's power)
                    with torch.no_grad(), peft_model.disable_adapter():
                        base = torch.log_softmax(peft_model(input_ids=full).logits[0, len(ids) - 1 : -1].float(), -1)
                    base = base.gather(-1, torch.tensor(completion)[:, None])[:, 0]
                    effect.append(float((base - expected).abs().max()))
                tokens += len(completion)
                result.setdefault("samples", []).append({"model": "adapter" if reference else "base",
                                                         "text": tokenizer.decode(completion)})  # fmt: skip
            result["adapter" if reference is not None else "base"] = {"tokens": tokens, "max_abs_err": max(errors)}
            if effect:
                result["adapter_effect_max_abs"] = max(effect)
        # the adapter matters: the base model's log-probs of the adapter's samples differ
        result["serves_lora"] = result["adapter"]["max_abs_err"] < 1e-3 < result["adapter_effect_max_abs"]
    finally:
        server.stop()
    report.write_json("vllm_lora_probe", result)
    print(json.dumps(result, indent=1))
    verdict = "serves" if result["serves_lora"] else "does NOT serve"
    report.update_readme(
        "vllm_lora_probe",
        f"### Does the CPU vLLM build serve LoRA? (`python benchmarks/vllm_lora_probe.py`)\n\nvLLM CPU server "
        f"(float32, eager, `--enable-lora --max-lora-rank {RANK}`) on SmolLM2-135M-Instruct, a peft adapter of rank "
        f"{RANK} on {', '.join(TARGETS)} loaded from a directory with `/v1/load_lora_adapter`: it {verdict} it. "
        f"Sampled tokens' log-probs against a teacher-forced forward of peft's model with the adapter: max |Δ| "
        f"{result['adapter']['max_abs_err']:.2e} over {result['adapter']['tokens']} tokens (the adapter itself moves "
        f"them by up to {result['adapter_effect_max_abs']:.2f}); the base model served "
        f"the same way against peft with the adapter disabled: {result['base']['max_abs_err']:.2e} over "
        f"{result['base']['tokens']} tokens.",
    )


if __name__ == "__main__":
    main()
