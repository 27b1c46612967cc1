import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from trl_async.tiny import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-qwen2"))


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory) -> str:
    """A tiny model vLLM's CPU attention accepts (head size 64)."""
    from trl_async.tiny import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("vllm-tiny") / "tiny-qwen2", hidden_size=128, num_heads=2))


@pytest.fixture(scope="session")
def vllm_server(vllm_model_dir, tmp_path_factory):
    """One real vLLM CPU server for the whole session (engine start ~30 s); tests push their own weights to it."""
    from tests.vllm_server import start_server

    server = start_server(vllm_model_dir, tmp_path_factory.mktemp("vllm-log") / "server.log")
    yield server
    server.stop()
