"""Asynchronous GRPO on GPUs with vLLM: Qwen2.5-0.5B-Instruct on DeepMath-103K, rewarded by TRL's `accuracy_reward`.

    pip install -e ".[vllm]" math-verify

    # one GPU: vLLM generates beside the trainer, on the same GPU
    CUDA_VISIBLE_DEVICES=0 accelerate launch --num_processes 1 examples/quickstart_gpu.py --use_vllm --vllm_mode colocate \
        --vllm_gpu_memory_utilization 0.3

    # GPUs plus a vLLM server: GPU 1 generates (TRL's own server command), GPU 0 trains
    CUDA_VISIBLE_DEVICES=1 trl vllm-serve --model Qwen/Qwen2.5-0.5B-Instruct --host 127.0.0.1 &
    CUDA_VISIBLE_DEVICES=0 accelerate launch examples/quickstart_gpu.py --use_vllm --vllm_mode server \
        --vllm_server_host 127.0.0.1

Every field of `AsyncGRPOConfig` (GRPOConfig's and the async ones) can be given on the command line, or in a YAML
file with `--config`: TRL's `TrlParser` reads them.
"""

from datasets import load_dataset
from trl import TrlParser
from trl.rewards import accuracy_reward

from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer

MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
DEFAULTS = dict(output_dir="outputs/quickstart_gpu", max_staleness=1, logging_steps=1)


def main(args: AsyncGRPOConfig) -> None:
    # conversational prompts (a list of messages) and a `solution` column, which accuracy_reward receives
    dataset = load_dataset("trl-lib/DeepMath-103K", split="train")
    trainer = AsyncGRPOTrainer(model=MODEL, reward_funcs=accuracy_reward, args=args, train_dataset=dataset)
    trainer.train()


if __name__ == "__main__":
    parser = TrlParser(AsyncGRPOConfig)
    parser.set_defaults(**DEFAULTS)
    (args,) = parser.parse_args_and_config()
    main(args)
