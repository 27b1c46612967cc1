#!/usr/bin/env bash
# GPU check of the vLLM backend, a few minutes on one GPU (benchmarks/gpu_check.py has each mode's verdict):
#   trl_serve       a server started by TRL's own `trl vllm-serve` (NCCL engine), a 1-process DeepSpeed ZeRO-3 trainer
#                   configured with GRPOTrainer's fields (use_vllm=True, vllm_mode='server', vllm_server_base_url)
#   zero3_reattach  the same server: killed after step 2, restarted on its port, re-attached over a new NCCL group
#   zero3_offload   ZeRO-3 with `offload_param: cpu` against the restarted server (mixed-device shards)
#   colocate        one process with vllm_mode='colocate': the trainer starts, uses and stops its own server
# Servers start once and are reused (a start costs about a minute): a new trainer opens a new NCCL group with the
# server it finds. ZeRO-3 runs with one rank (NCCL refuses two ranks on one device): the gather code path, not the
# cross-rank traffic, which tests/distributed/test_distributed.py covers on CPU.
# Needs, in the current Python environment: trl_async, a CUDA build of torch, TRL, DeepSpeed and `vllm`.
# Usage: bash benchmarks/gpu_check.sh [OUT_DIR]   -> OUT_DIR/gpu_check.json (every verdict), exit status 0 when every
# check passed. GPU_CHECK_CONFIGS (default "trl_serve zero3_reattach zero3_offload colocate") chooses which run, in
# that order (each verdict file is written as soon as its run ends); GPU_CHECK_SERVER_ARGS adds arguments to every
# vLLM server (e.g. "--attention-backend TRITON_ATTN").
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-/tmp/gpu_check}}"
mkdir -p "$OUT"
CONFIGS="${GPU_CHECK_CONFIGS:-trl_serve zero3_reattach zero3_offload colocate}"
[ -n "${CONFIGS// /}" ] || { echo "gpu_check: GPU_CHECK_CONFIGS names no configuration" >&2; exit 2; }
for C in $CONFIGS; do  # checked first: a misspelt name would otherwise stop the check after a server start
    case $C in trl_serve|zero3_reattach|zero3_offload|colocate) ;; *) echo "gpu_check: unknown configuration $C" >&2; exit 2 ;; esac
done
python -c "import torch, vllm, trl; assert torch.cuda.is_available(), 'no CUDA device'" || {
    echo "gpu_check: needs a CUDA torch, trl and vllm in this environment" >&2; exit 2; }
export VLLM_USE_FLASHINFER_SAMPLER=0  # vLLM's own sampler: flashinfer's would be compiled at every server start
MODEL="$OUT/tiny-qwen2"
python -c "from trl_async.demo.tiny import save_tiny_model; save_tiny_model('$MODEL', hidden_size=256, num_heads=4)"
python - "$OUT" <<'PY'
import json, sys
base = json.load(open("recipes/accelerate/zero3_offload.json"))
# small parameters stay on the GPU (the norms), the matrices' shards live on the CPU: mixed devices
base["zero_optimization"]["stage3_param_persistence_threshold"] = 1000
json.dump(base, open(f"{sys.argv[1]}/zero3_offload_gpu.json", "w"), indent=1)
PY
PORT=8765
URL="http://127.0.0.1:$PORT"
# TRL's own server command (trl vllm-serve's entry point), with our arguments passed through to `vllm serve`
SERVE=(python -m trl.scripts.vllm_serve --model "$MODEL" --host 127.0.0.1 --port "$PORT" --gpu_memory_utilization 0.3
       --max_model_len 256 --enforce_eager --dtype float32 ${GPU_CHECK_SERVER_ARGS:-})
SERVER=
server_pgid() { if [ -f "$OUT/gpu_check_zero3_reattach.json.pgid" ]; then cat "$OUT/gpu_check_zero3_reattach.json.pgid"; else echo "$SERVER"; fi; }
stop_server() {
    local pgid; pgid=$(server_pgid)
    [ -n "$pgid" ] && { kill -KILL -- -"$pgid" 2>/dev/null || true; }
    [ -n "$SERVER" ] && { wait "$SERVER" 2>/dev/null || true; }
    SERVER=; rm -f "$OUT/gpu_check_zero3_reattach.json.pgid"
}
trap stop_server EXIT
fail() { python -c 'import json, sys; json.dump({"ok": False, "error": sys.argv[2]}, open(sys.argv[1], "w"))' "$1" "$2"; }
# Wait for the server's /health; a server that exits first fails the configuration at once, with the end of its log.
server_up() {
    local config=$1 log=$2 start=$SECONDS
    until python -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' "$URL/health" 2>/dev/null; do
        if ! kill -0 -- -"$(server_pgid)" 2>/dev/null || [ $((SECONDS - start)) -gt 300 ]; then
            tail -30 "$log"
            fail "$OUT/gpu_check_$config.json" "the vLLM server did not start: $(grep -E 'Error|error' "$log" | tail -1)"
            return 1
        fi
        sleep 1
    done
    echo "server for $config healthy after $((SECONDS - start)) s"
}
launch() {  # $1 config, $2 DeepSpeed json, $3 steps
    cat > "$OUT/$1_1gpu.yaml" <<YAML
compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  deepspeed_config_file: $2
  zero3_init_flag: false
num_machines: 1
num_processes: 1
machine_rank: 0
use_cpu: false
YAML
    accelerate launch --config_file "$OUT/$1_1gpu.yaml" benchmarks/gpu_check.py "$OUT/gpu_check_$1.json" "$MODEL" "$1" \
        "$URL" "$3" 2>&1 | tail -40 || true
}
for C in $CONFIGS; do
    T0=$SECONDS
    if [ "$C" = colocate ]; then
        stop_server  # the colocated server's own memory and processes are what the verdict looks at
        python benchmarks/gpu_check.py "$OUT/gpu_check_colocate.json" "$MODEL" colocate "" 4 2>&1 | tail -40 || true
        cp /tmp/gpu_check_out/vllm_colocate_0.log "$OUT/server_colocate.log" 2>/dev/null || true
        echo "== $C took $((SECONDS - T0)) s"; continue
    fi
    if [ -z "$SERVER" ] || ! kill -0 -- -"$(server_pgid)" 2>/dev/null; then
        stop_server
        setsid "${SERVE[@]}" > "$OUT/server_$C.log" 2>&1 &  # its own process group: killed whole (engine included)
        SERVER=$!
        server_up "$C" "$OUT/server_$C.log" || { stop_server; continue; }
    fi
    case $C in
        trl_serve) launch "$C" recipes/accelerate/zero3.json 4 ;;
        zero3_reattach)
            export GPU_CHECK_SERVER_PGID=$(server_pgid)
            export GPU_CHECK_RESTART=$(python -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "${SERVE[@]}")
            launch "$C" recipes/accelerate/zero3.json 6
            unset GPU_CHECK_RESTART GPU_CHECK_SERVER_PGID
            if [ -f "$OUT/gpu_check_zero3_reattach.json.pgid" ]; then  # the restarted server serves what follows
                SERVER=$(cat "$OUT/gpu_check_zero3_reattach.json.pgid"); rm -f "$OUT/gpu_check_zero3_reattach.json.pgid"
                cp "$OUT/gpu_check_zero3_reattach.json.restarted.log" "$OUT/server_restarted.log" 2>/dev/null || true
            fi ;;
        zero3_offload) launch "$C" "$OUT/zero3_offload_gpu.json" 4 ;;
    esac
    echo "== $C took $((SECONDS - T0)) s"
done
stop_server
python - "$OUT" $CONFIGS <<'PY'
import json, os, sys
out = sys.argv[1]
verdicts = {}
for config in sys.argv[2:]:
    path = f"{out}/gpu_check_{config}.json"
    verdicts[config] = json.load(open(path)) if os.path.exists(path) else {"ok": False, "error": "no verdict (see log)"}
# the offload run must really have had shards off the GPU (else it checked the flat path twice)
offload = verdicts.get("zero3_offload", {})
if offload.get("ok") and not offload.get("shards_off_device"):
    offload["ok"], offload["error"] = False, "no shard was off the GPU: the offload configuration did not apply"
verdicts["ok"] = all(v["ok"] for v in verdicts.values())
json.dump(verdicts, open(f"{out}/gpu_check.json", "w"), indent=1)
print(verdicts)
sys.exit(0 if verdicts["ok"] else 1)
PY
