"""CPU demo: asynchronous GRPO on SmolLM2-135M-Instruct, offline, on 2 CPU cores (``trl_async.demo.cpu_demo``; the
same as the ``trl-async-demo`` command). Any AsyncGRPOConfig field can be given on the command line.

    python recipes/cpu_demo.py
    python recipes/cpu_demo.py --max_steps 24 --max_staleness 2
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read once, when torch loads OpenMP

from trl_async.demo.cpu_demo import cli  # noqa: E402

if __name__ == "__main__":
    cli()
