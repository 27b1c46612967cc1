#!/usr/bin/env bash
# GPU check of the vLLM backend, a few minutes on one GPU: a CUDA vLLM server (vLLM's NCCL weight-transfer engine)
# and a 1-process DeepSpeed ZeRO-3 trainer on the same GPU (NCCL refuses two ranks on one device, so ZeRO-3 runs
# with one rank: the gather code path, not the cross-rank traffic, which tests/test_distributed.py covers on CPU).
# Needs, in the current Python environment: trl_async (pip install -e .), a CUDA build of torch and `vllm`.
# Usage: bash benchmarks/gpu_check.sh [OUT_DIR]   -> OUT_DIR/gpu_check.json, exit status 0 when every check passed
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-/tmp/gpu_check}}"
mkdir -p "$OUT"
python -c "import torch, vllm; assert torch.cuda.is_available(), 'no CUDA device'" || {
    echo "gpu_check: needs a CUDA torch and vllm in this environment" >&2; exit 2; }
MODEL="$OUT/tiny-qwen2"
python -c "from trl_async.tiny import save_tiny_model; save_tiny_model('$MODEL', hidden_size=256, num_heads=4)"
PORT=8765
python -m trl_async.vllm_serve --model "$MODEL" --host 127.0.0.1 --port "$PORT" --transport nccl -- \
    --gpu-memory-utilization 0.3 --max-model-len 256 --enforce-eager > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true' EXIT
cat > "$OUT/zero3_1gpu.yaml" <<YAML
compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  deepspeed_config_file: recipes/accelerate/zero3.json
  zero3_init_flag: false
num_machines: 1
num_processes: 1
machine_rank: 0
use_cpu: false
YAML
accelerate launch --config_file "$OUT/zero3_1gpu.yaml" benchmarks/gpu_check.py \
    "$OUT/gpu_check.json" "$MODEL" "http://127.0.0.1:$PORT" 4 2>&1 | tail -40
python -c "import json,sys; v=json.load(open('$OUT/gpu_check.json')); print(v); sys.exit(0 if v['ok'] else 1)"
