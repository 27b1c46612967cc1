"""Start a vLLM server the way ``rollout_backend="vllm"`` needs it (run this in the server's environment).

    trl-async-vllm-serve --model Qwen/Qwen2.5-1.5B --port 8000                 # GPU: NCCL weight push
    trl-async-vllm-serve --model ./tiny --port 8000 --transport gloo -- --dtype float32 --enforce-eager

It is ``vllm serve`` (vLLM's OpenAI-compatible API server) with: ``VLLM_SERVER_DEV_MODE=1`` (pause/resume and the
weight-transfer endpoints), ``--enable-scale-out`` (token-in/token-out ``/inference/v1/generate``, which returns
each token's weight version), ``--logprobs-mode processed_logprobs`` (log-probs of the distribution actually sampled
from) and ``--weight-transfer-config`` with ``nccl`` (GPU) or ``trl_async_gloo`` (CPU; needs trl_async installed in
the server's environment, ``pip install --no-deps trl_async``). ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` lets the
trainer load each version's LoRA adapter (adapter-only sync: add ``-- --enable-lora --max-lora-rank R --max-loras
N``, with R at least the adapters' rank and N = max_staleness + 2, so that requests of every live version batch
together). Arguments after ``--`` go to vLLM unchanged.

The server listens on loopback (127.0.0.1) unless ``--host`` says otherwise. In dev mode anyone who reaches its port
can replace the weights (``/update_weights``, ``/init_weight_transfer_engine``), run methods on its workers
(``/collective_rpc``), and pause or sleep it; vLLM's ``--api-key`` guards only the ``/v1`` routes. For a trainer on
another machine, pass that machine's private address (``--host 10.0.0.5``) on a network only the training job
reaches, never a public one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def server_command(model: str, host: str, port: int, transport: str, extra: list[str]) -> list[str]:
    backend = "trl_async_gloo" if transport == "gloo" else "nccl"
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--enable-scale-out",
        "--logprobs-mode",
        "processed_logprobs",
        "--weight-transfer-config",
        json.dumps({"backend": backend}),
        *extra,
    ]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    ours = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default loopback only; a private address for trainers on other machines)",
    )
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--transport", choices=("nccl", "gloo"), default="nccl")
    args = parser.parse_args(ours)
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"
    os.environ.setdefault("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")  # /v1/load_lora_adapter (LoRA servers only)
    command = server_command(args.model, args.host, args.port, args.transport, extra)
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
