#!/usr/bin/env bash
# The device side of benchmarks/gpu_stage.sh, run on the lent GPU machine from the repository root:
#   bash benchmarks/gpu_device.sh install b             install the wheels carried in .gpu/b into /tmp/site
#   bash benchmarks/gpu_device.sh install c run         the same for .gpu/c, then the GPU check
# The check's verdicts (verdicts.txt, gpu_check.json) and its logs (logs.tgz) are written to $OUT, which comes back.
# GPU_CHECK_CONFIGS and GPU_CHECK_TIMEOUT (seconds, default 600: each server start took 100 s on an H200) bound what runs.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
while [ $# -gt 0 ]; do
    case $1 in
        install)
            python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site ".gpu/$2"/*.whl \
                > /tmp/pip_$2.log 2>&1 || { tail -5 /tmp/pip_$2.log; exit 1; }
            shift 2 ;;
        run)
            # the flash-attention kernels were left out (their size): let vLLM import without them
            sed -i 's/^if not (FA2_AVAILABLE or FA3_AVAILABLE):/if False:/' /tmp/site/vllm/vllm_flash_attn/__init__.py
            python3 -c "import torch, vllm.entrypoints.openai.api_server, vllm.entrypoints.cli.main, trl, deepspeed, trl_async
print('torch', torch.__version__, torch.cuda.get_device_name())" || exit 1
            G=/tmp/gpu_check; mkdir -p $G
            export GPU_CHECK_CONFIGS="${GPU_CHECK_CONFIGS:-trl_serve zero3_reattach zero3_offload colocate}"
            GPU_CHECK_SERVER_ARGS="--attention-backend TRITON_ATTN" timeout "${GPU_CHECK_TIMEOUT:-600}" \
                bash benchmarks/gpu_check.sh $G > $G/gpu_check.log 2>&1
            status=$?
            echo "gpu_check exit status $status"
            for f in $G/gpu_check*.json; do echo "== $f"; cat "$f"; echo; done > "$OUT/verdicts.txt" 2>&1
            cp $G/gpu_check.json "$OUT/" 2>/dev/null
            (cd $G && tar czf "$OUT/logs.tgz" ./*.log ./*.restarted.log 2>/dev/null)
            grep -v "Writing model\|it/s\]" $G/gpu_check.log | tail -60
            cat "$OUT/verdicts.txt"
            [ "$status" -eq 0 ] || exit "$status"
            shift ;;
        *) echo "unknown step $1" >&2; exit 2 ;;
    esac
done
