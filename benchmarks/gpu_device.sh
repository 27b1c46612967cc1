#!/usr/bin/env bash
# The device side of benchmarks/gpu_plan.py, run on the lent GPU machine from the repository root, call N of the
# plan's four carrying .gpu/callN (benchmarks/gpu_stage.sh made them):
#   bash benchmarks/gpu_device.sh N
# Each call unpacks the pieces that are complete and keeps the plan's runner going; the fourth collects the results
# into $OUT until every phase has ended (benchmarks/GPU_PLAN.md).
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p /tmp/site
exec python3 benchmarks/gpu_plan.py call "$1"
