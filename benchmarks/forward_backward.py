"""One forward+backward of SmolLM2-135M-Instruct, the unit of a training step's cost on a CPU: how fast a precision,
a thread count or a core is here.

The batch is the demo's training micro-batch shape (16 rows x 110 tokens), gradient checkpointing on as in TRL's
defaults; each setting is timed twice after loading, and both times are printed. Measured with it
(benchmarks/RESULTS.md): an AVX2-only AMD EPYC, 2 threads, float32 13.3 s, bf16 autocast 347 s; an AMD EPYC with
AVX512-BF16, 1 thread, bf16 6.3 s pinned to core 0, 6.1 s on core 1, 5.9 s unpinned.

    python benchmarks/forward_backward.py --threads 2 --dtypes float32 bf16
    taskset -c 0 python benchmarks/forward_backward.py --threads 1 --dtypes bf16
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python benchmarks/forward_backward.py   # as an AVX2-only CPU
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bf16"], default=["float32", "bf16"])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=110)
    cli = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from trl_async.demo.pretrained import smollm2_135m_instruct
    from trl_async.hardware.precision import cpu_name, device_precision

    torch.set_num_threads(cli.threads)
    model = AutoModelForCausalLM.from_pretrained(smollm2_135m_instruct(), dtype=torch.float32)
    model.gradient_checkpointing_enable()
    ids = torch.randint(0, model.config.vocab_size, (cli.rows, cli.tokens), generator=torch.Generator().manual_seed(0))
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"
    print(f"{cpu_name()}; {device_precision('cpu').why}; {cli.threads} threads on cores {cores}")
    for dtype in cli.dtypes:
        times = []
        for _ in range(2):
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
        print(f"{dtype}: {', '.join(f'{t:.1f} s' for t in times)}", flush=True)


if __name__ == "__main__":
    main()
