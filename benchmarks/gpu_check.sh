#!/usr/bin/env bash
# GPU check of the vLLM backend, a few minutes on one GPU: a CUDA vLLM server (vLLM's NCCL weight-transfer engine)
# and a 1-process DeepSpeed ZeRO-3 trainer on the same GPU (NCCL refuses two ranks on one device, so ZeRO-3 runs
# with one rank: the gather code path, not the cross-rank traffic, which tests/test_distributed.py covers on CPU).
# Needs, in the current Python environment: trl_async (pip install -e .), a CUDA build of torch and `vllm`.
# Usage: bash benchmarks/gpu_check.sh [OUT_DIR]   -> OUT_DIR/gpu_check.json (one verdict per ZeRO-3 configuration),
# exit status 0 when every check passed. GPU_CHECK_CONFIGS (default "zero3 zero3_offload zero3_reattach") chooses
# which configurations run, in that order (each verdict file is written as soon as its run ends);
# GPU_CHECK_SERVER_ARGS adds arguments to every vLLM server (e.g. "--attention-backend TRITON_ATTN").
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-/tmp/gpu_check}}"
mkdir -p "$OUT"
CONFIGS="${GPU_CHECK_CONFIGS:-zero3 zero3_offload zero3_reattach}"
[ -n "${CONFIGS// /}" ] || { echo "gpu_check: GPU_CHECK_CONFIGS names no configuration" >&2; exit 2; }
for ZERO in $CONFIGS; do  # checked first: a misspelt name would otherwise stop the check after a server start
    case $ZERO in zero3|zero3_offload|zero3_reattach) ;; *) echo "gpu_check: unknown configuration $ZERO" >&2; exit 2 ;; esac
done
python -c "import torch, vllm; assert torch.cuda.is_available(), 'no CUDA device'" || {
    echo "gpu_check: needs a CUDA torch and vllm in this environment" >&2; exit 2; }
MODEL="$OUT/tiny-qwen2"
python -c "from trl_async.tiny import save_tiny_model; save_tiny_model('$MODEL', hidden_size=256, num_heads=4)"
# Two trainer configurations, each against a fresh server (a server's NCCL group belongs to one trainer):
# - zero3: every shard on the GPU, pushed by the flat shard-to-rank-0 path (trl_async/sync/policy.py);
# - zero3_offload: `offload_param: cpu` with small parameters persistent on the GPU (threshold 1000 elements: the
#   norms stay on the GPU, the matrices' shards live on the CPU): mixed devices, which must take DeepSpeed's
#   GatheredParameters path and still push exact weights (issue 22 item 3; on CPU the offload shards sit on the
#   compute device, so only a GPU exercises this).
# - zero3_reattach: every shard on the GPU; after step 2 the server is SIGKILLed and started again on its port, and
#   the trainer must re-attach it over a new NCCL group (issue 24) and end with its greedy output equal to the
#   trained model's (the weights that came over the new group).
python - "$OUT" <<'PY'
import json, sys
base = json.load(open("recipes/accelerate/zero3_offload.json"))
base["zero_optimization"]["stage3_param_persistence_threshold"] = 1000
json.dump(base, open(f"{sys.argv[1]}/zero3_offload_gpu.json", "w"), indent=1)
PY
PORT=8765
SERVER=
# Wait for the server's /health; a server that exits first (a missing package, a kernel it lacks) fails its
# configuration at once, with the end of its log, instead of the trainer waiting out vllm_server_timeout.
server_up() {
    local zero=$1 deadline=$((SECONDS + 600))
    until python -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' \
            "http://127.0.0.1:$PORT/health" 2>/dev/null; do
        if ! kill -0 "$SERVER" 2>/dev/null || [ "$SECONDS" -gt "$deadline" ]; then
            tail -30 "$OUT/server_$zero.log"
            python -c 'import json, sys; json.dump({"ok": False, "error": "the vLLM server did not start: " + sys.argv[2]},
                       open(sys.argv[1], "w"))' "$OUT/gpu_check_$zero.json" "$(grep -E 'Error|error' "$OUT/server_$zero.log" | tail -1)"
            return 1
        fi
        sleep 2
    done
    echo "server for $zero healthy after $((SECONDS - ${2:-0})) s"
}
trap 'if [ -n "$SERVER" ]; then kill -KILL -- -$SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true; fi' EXIT
for ZERO in $CONFIGS; do
    case $ZERO in
        zero3|zero3_reattach) DS_JSON=recipes/accelerate/zero3.json ;;
        zero3_offload) DS_JSON="$OUT/zero3_offload_gpu.json" ;;
    esac
    SERVE=(python -m trl_async.vllm_serve --model "$MODEL" --host 127.0.0.1 --port "$PORT" --transport nccl --
           --gpu-memory-utilization 0.3 --max-model-len 256 --enforce-eager ${GPU_CHECK_SERVER_ARGS:-})
    setsid "${SERVE[@]}" > "$OUT/server_$ZERO.log" 2>&1 &  # its own process group: killed whole (engine included)
    SERVER=$!
    if ! server_up "$ZERO" "$SECONDS"; then
        kill -KILL -- -$SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true; SERVER=
        continue
    fi
    unset GPU_CHECK_RESTART GPU_CHECK_SERVER_PGID
    if [ "$ZERO" = zero3_reattach ]; then
        export GPU_CHECK_SERVER_PGID=$SERVER
        export GPU_CHECK_RESTART=$(python -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "${SERVE[@]}")
    fi
    cat > "$OUT/${ZERO}_1gpu.yaml" <<YAML
compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  deepspeed_config_file: $DS_JSON
  zero3_init_flag: false
num_machines: 1
num_processes: 1
machine_rank: 0
use_cpu: false
YAML
    STEPS=4; [ "$ZERO" = zero3_reattach ] && STEPS=6
    accelerate launch --config_file "$OUT/${ZERO}_1gpu.yaml" benchmarks/gpu_check.py \
        "$OUT/gpu_check_$ZERO.json" "$MODEL" "http://127.0.0.1:$PORT" $STEPS 2>&1 | tail -40 || true
    kill -KILL -- -$SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true; SERVER=
    if [ -f "$OUT/gpu_check_$ZERO.json.pgid" ]; then  # the restarted server
        kill -KILL -- -"$(cat "$OUT/gpu_check_$ZERO.json.pgid")" 2>/dev/null || true
    fi
done
unset GPU_CHECK_RESTART GPU_CHECK_SERVER_PGID
python - "$OUT" $CONFIGS <<'PY'
import json, os, sys
out = sys.argv[1]
verdicts = {}
for zero in sys.argv[2:]:
    path = f"{out}/gpu_check_{zero}.json"
    verdicts[zero] = json.load(open(path)) if os.path.exists(path) else {"ok": False, "error": "no verdict (see log)"}
# the offload run must really have had shards off the GPU (else it checked the flat path twice)
offload = verdicts.get("zero3_offload", {})
if offload.get("ok") and not offload.get("shards_off_device"):
    offload["ok"], offload["error"] = False, "no shard was off the GPU: the offload configuration did not apply"
verdicts["ok"] = all(v["ok"] for v in verdicts.values())
json.dump(verdicts, open(f"{out}/gpu_check.json", "w"), indent=1)
print(verdicts)
sys.exit(0 if verdicts["ok"] else 1)
PY
