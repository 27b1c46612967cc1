"""The GSM8K recipe's parsing and setup path on CPU: its YAML + command-line overrides through TrlParser, a local
dataset file, a tiny local model, two real async training steps. Its reward functions against hand-made cases."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "recipes"))
import gsm8k_async  # noqa: E402

ROWS = [
    {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "A pen costs 1,200 cents. How many cents do 2 cost?", "answer": "2 * 1200 = 2400\n#### 2,400"},
    {"question": "Half of 9?", "answer": "9 / 2 = 4.5\n#### 4.5"},
    {"question": "5 minus 8?", "answer": "#### -3"},
]


def test_correctness_compares_the_last_number_with_the_reference():
    completions = ["3 + 4 = 7\n#### 7", "so 2400 cents", "#### 2,400", "answer 4.50", "7 then 8", "no number", "-3"]
    solution = ["7", "2400", "2400", "4.5", "7", "7", "-3"]
    assert gsm8k_async.correctness(completions, solution) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    chat = [[{"role": "assistant", "content": "it is 12\n#### 12"}]]  # conversational completions
    assert gsm8k_async.correctness(chat, ["12"]) == [1.0]


def test_format_reward_wants_the_final_line_marker():
    completions = ["x\n#### 7", "#### 2,400  ", "7", "#### seven", "#### 7 is it"]
    assert gsm8k_async.format_reward(completions) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_reference_answer_is_the_text_after_the_marker():
    assert [gsm8k_async.reference_answer(r["answer"]) for r in ROWS] == ["7", "2400", "4.5", "-3"]


def test_recipe_parses_its_yaml_with_overrides_and_trains_on_a_local_file(tmp_path, tiny_model_dir, capsys):
    from trl import TrlParser

    from trl_async import AsyncGRPOConfig

    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    parser = TrlParser((gsm8k_async.GSM8KArguments, AsyncGRPOConfig, gsm8k_async.ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config(
        [
            "--config", str(ROOT / "recipes/configs/gsm8k_async.yaml"),
            "--model_name_or_path", tiny_model_dir, "--dtype", "float32", "--dataset_path", str(data),
            "--output_dir", str(tmp_path / "out"), "--max_steps", "2", "--per_device_train_batch_size", "4",
            "--gradient_accumulation_steps", "1", "--num_generations", "2", "--max_completion_length", "8",
            "--bf16", "false", "--use_cpu", "true", "--gradient_checkpointing", "false", "--logging_steps", "1",
            "--save_strategy", "no", "--disable_tqdm", "true",
        ]
    )  # fmt: skip
    # from the YAML, not overridden
    assert training_args.max_staleness == 2 and training_args.loss_type == "dapo"
    assert training_args.learning_rate == pytest.approx(1e-6) and script_args.dataset_name == "openai/gsm8k"
    prompts = gsm8k_async.load_gsm8k(script_args)
    assert prompts[1]["solution"] == "2400" and prompts[1]["prompt"][-1]["content"] == ROWS[1]["question"]

    summary = gsm8k_async.main(script_args, training_args, model_args)
    assert summary["steps"] == 2
    assert 0.0 <= summary["reward_first"] <= 2.0 and summary["staleness_max"] <= 2
    assert (tmp_path / "out" / "model.safetensors").exists()  # the trained model was saved
    assert "gsm8k async GRPO" in capsys.readouterr().out


def test_recipe_parses_the_vllm_server_command_line():
    """The docstring's multi-server command: two URLs become a list, the backend and transport are validated."""
    from trl import TrlParser

    from trl_async import AsyncGRPOConfig

    parser = TrlParser((gsm8k_async.GSM8KArguments, AsyncGRPOConfig, gsm8k_async.ModelConfig))
    _, training_args, _ = parser.parse_args_and_config(
        [
            "--config", str(ROOT / "recipes/configs/gsm8k_async.yaml"), "--output_dir", "out", "--bf16", "false",
            "--rollout_backend", "vllm", "--rollout_vllm_urls", "http://localhost:8000", "http://localhost:8001",
        ]
    )  # fmt: skip
    assert training_args.rollout_vllm_urls == ["http://localhost:8000", "http://localhost:8001"]
    assert training_args.resolved_weight_update == "decode_step"
    with pytest.raises(ValueError, match="rollout_vllm_urls"):
        parser.parse_args_and_config(["--config", str(ROOT / "recipes/configs/gsm8k_async.yaml"), "--output_dir",
                                      "out", "--bf16", "false", "--rollout_vllm_urls", "localhost:8000"])  # fmt: skip


@pytest.mark.real_model
def test_recipe_runs_the_arithmetic_task_on_the_real_model(tmp_path, capsys):
    """`--task arithmetic` with its YAML: SmolLM2-135M-Instruct (the default model), the local word problems, two
    async steps, and the held-out greedy accuracy logged by the trainer's own evaluation."""
    from trl_async.demo.pretrained import smollm2_135m_instruct
    from trl_async.hardware.precision import recipe_precision

    argv = [
        "--config", str(ROOT / "recipes/configs/arithmetic_cpu.yaml"), "--output_dir", str(tmp_path / "out"),
        "--max_steps", "2", "--eval_steps", "2", "--heldout_size", "8", "--per_device_train_batch_size", "8",
        "--num_generations", "4", "--per_device_eval_batch_size", "8", "--disable_tqdm", "true",
        "--max_completion_length", "16",  # the recipe runs end to end; its learning is the demo's check (.ci/run)
    ]  # fmt: skip
    script_args, training_args, model_args = gsm8k_async.make_parser(argv).parse_args_and_config(argv)
    assert script_args.task == "arithmetic" and model_args.model_name_or_path is None
    bf16, chosen = recipe_precision("cpu")  # float32 where bf16 is emulated (26x slower on AVX2-only CPUs)
    # None (native bf16) is TRL's default, which GRPOConfig resolves to bf16=True; False (emulated) stays float32
    assert training_args.bf16 is (bf16 is None)
    summary = gsm8k_async.main(script_args, training_args, model_args)
    assert summary["steps"] == 2 and list(summary["heldout_greedy_accuracy"]) == [2]
    assert summary["heldout_greedy_accuracy"][2] in {k / 8 for k in range(9)}  # 8 problems, each right or wrong
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["num_hidden_layers"] == 30 and saved["vocab_size"] == 49_152  # the real model was trained
    out = capsys.readouterr().out
    assert f"arithmetic async GRPO ({smollm2_135m_instruct()})" in out and f"precision: {chosen}" in out
    assert summary["precision"] == chosen


@pytest.mark.real_model
def test_recipe_runs_the_code_task_on_the_real_model(tmp_path):
    """`--task code` with its YAML: SmolLM2-135M-Instruct writes functions, their tests run in the sandbox, and the
    held-out pass rate is measured before training and by the trainer's own evaluation."""
    argv = [
        "--config", str(ROOT / "recipes/configs/code_cpu.yaml"), "--output_dir", str(tmp_path / "out"),
        "--max_steps", "1", "--eval_steps", "1", "--heldout_size", "4", "--per_device_train_batch_size", "8",
        "--num_generations", "4", "--per_device_eval_batch_size", "4", "--disable_tqdm", "true",
        "--max_completion_length", "24",
    ]  # fmt: skip
    script_args, training_args, model_args = gsm8k_async.make_parser(argv).parse_args_and_config(argv)
    assert script_args.task == "code"
    summary = gsm8k_async.main(script_args, training_args, model_args)
    assert summary["steps"] == 1 and list(summary["heldout_greedy_accuracy"]) == [1]
    passes = {k / 16 for k in range(17)}  # 4 problems of 4 tests each
    assert summary["heldout_greedy_accuracy_before"] in passes and summary["heldout_greedy_accuracy"][1] in passes


@pytest.mark.unit
def test_the_arithmetic_config_leaves_bf16_to_the_hardware_and_the_user_wins(monkeypatch):
    from trl_async.hardware.precision import NativePrecision, recipe_precision

    def parsed(*argv):
        return gsm8k_async.make_parser(list(argv)).parse_args_and_config(list(argv))[1]

    arithmetic = ["--config", str(ROOT / "recipes/configs/arithmetic_cpu.yaml"), "--output_dir", "out"]
    native = recipe_precision("cpu")[0] is None
    assert parsed(*arithmetic).bf16 is native  # bf16 where native (AVX512-BF16/AMX), float32 elsewhere
    for given in ("true", "false"):  # the user's explicit choice is honoured either way
        assert parsed(*arithmetic, "--bf16", given).bf16 is (given == "true")
    gsm8k = ["--config", str(ROOT / "recipes/configs/gsm8k_async.yaml"), "--output_dir", "out", "--use_cpu", "true"]
    assert parsed(*gsm8k).bf16 is True  # a config file's `bf16: true` beats the recipe's default
    # with a CPU that emulates bf16, fp16 is not refused for clashing with a forced bf16 default (TRL's rule)
    monkeypatch.setattr("trl_async.hardware.precision.device_precision", lambda d: NativePrecision(True, True, "AMX"))
    args = parsed(*arithmetic, "--fp16", "true")
    assert (args.bf16, args.fp16) == (False, True)


@pytest.mark.unit
def test_the_recipe_reads_the_training_device_before_choosing_its_precision(monkeypatch, tmp_path):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # a GPU machine, as far as the choice goes
    on_cpu = tmp_path / "cpu.yaml"
    on_cpu.write_text("use_cpu: true\n")
    assert gsm8k_async.training_device(["--config", str(on_cpu)]) == "cpu"  # the YAML's use_cpu
    assert gsm8k_async.training_device(["--config", str(on_cpu), "--use_cpu", "false"]) == "cuda"  # CLI wins
    assert gsm8k_async.training_device(["--use_cpu"]) == "cpu"
    assert gsm8k_async.training_device(["--config", str(ROOT / "recipes/configs/gsm8k_async.yaml")]) == "cuda"
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert gsm8k_async.training_device([]) == "cpu"
