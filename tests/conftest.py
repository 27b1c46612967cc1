import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

# ---- shared helpers (tests import them from here) ----------------------------------------------------------------
import multiprocessing  # noqa: E402

from datasets import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from trl_async import AsyncGRPOConfig  # noqa: E402

COMMON = dict(
    per_device_train_batch_size=8,
    num_generations=4,
    max_completion_length=6,
    learning_rate=1e-2,
    logging_steps=1,
    report_to=[],
    bf16=False,
    use_cpu=True,
    gradient_checkpointing=False,
    save_strategy="no",
    beta=0.0,
)


def text_dataset(n=12):
    return Dataset.from_list([{"prompt": f"q{i % 10}{i // 10}:", "letter": "abcdefghijkl"[i]} for i in range(n)])


def letter_reward(prompts, completions, letter, **kwargs):
    """Depends on the prompt's row (``letter`` column) so a mis-aligned reward would be caught."""
    return [sum(ch <= x for ch in c) / 6 for c, x in zip(completions, letter, strict=True)]


def async_args(tmp_path, **overrides):
    return AsyncGRPOConfig(output_dir=str(tmp_path), **{**COMMON, "max_steps": 4, **overrides})


class KeepPublished(TrainerCallback):
    """The workers' last published weights (and version), read at the end of training, before the pool closes and
    releases them. Set ``trainer`` after constructing the trainer with this callback."""

    def __init__(self) -> None:
        self.trainer, self.weights, self.version = None, None, None

    def on_train_end(self, args, state, control, **kwargs):
        shared = self.trainer.rollout_pool.backend.weights
        self.weights, self.version = {n: t.clone() for n, t in shared.tensors.items()}, shared.version


def trained_staleness(trainer):
    return [h["async/staleness_max"] for h in trainer.state.log_history if "async/staleness_max" in h]


def no_rollout_children():
    return not [p for p in multiprocessing.active_children() if p.name.startswith("trl_async")]


VLLM_FIXTURES = {
    "vllm_server",
    "vllm_tool_server",
    "vllm_server_to_kill",
    "vllm_server_to_restart",
    "vllm_lone_server",
    "vllm_server_to_heal",
    "vllm_pair_to_heal",
    "gpu_plan_rehearsal",
}


def pytest_collection_modifyitems(items):
    """The folder sets the kind: tests/unit/ is `unit` (pure functions, construction checks); tests/integration/,
    tests/vllm/ and tests/distributed/ are `integration`, except a test marked `unit` there (a fast check kept beside
    the ones it belongs with). tests/distributed/ is also `distributed` (2-process launches). A test using a real vLLM
    server (one of VLLM_FIXTURES; most are in tests/vllm/, beside tests of the vLLM engine against stub servers) is
    also `vllm` and runs last: `pytest -m "not vllm"` skips the vLLM install and server."""
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        if folder == "unit":
            item.add_marker(pytest.mark.unit)
        elif item.get_closest_marker("unit") is None:
            item.add_marker(pytest.mark.integration)
        if folder == "distributed":
            item.add_marker(pytest.mark.distributed)
        if VLLM_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.vllm)
    # the vLLM tests last (stable order otherwise): their servers start in the background while the others run
    # (tests/vllm_server.py, Prestart), and `.ci/run` installs the vLLM environment before the tests begin
    uses_vllm = [item.get_closest_marker("vllm") is not None for item in items]
    items[:] = [i for i, v in zip(items, uses_vllm, strict=True) if not v] + [
        i for i, v in zip(items, uses_vllm, strict=True) if v
    ]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from trl_async.demo.tiny import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-qwen2"))


def pytest_collection_finish(session):
    """The vLLM tests' models and servers are prepared in the background from here on (tests/vllm_server.py)."""
    from tests.vllm_server import PRESTART_ORDER, Prestart

    used = {name for item in session.items for name in getattr(item, "fixturenames", ())} & set(PRESTART_ORDER)
    if used and not session.config.option.collectonly:
        session.config.trl_async_prestart = Prestart(used, session.config._tmp_path_factory.mktemp("vllm"))


def pytest_sessionfinish(session):
    prestart = getattr(session.config, "trl_async_prestart", None)
    if prestart is not None:
        prestart.close()


def _prepared(request, name: str):
    prestart = getattr(request.config, "trl_async_prestart", None)
    if prestart is None:  # e.g. a fixture requested dynamically: made now
        from tests.vllm_server import Prestart

        prestart = request.config.trl_async_prestart = Prestart(set(), request.config._tmp_path_factory.mktemp("vllm"))
    return prestart.get(name)


@pytest.fixture(scope="session")
def gpu_plan_rehearsal(request) -> Path:
    """The work folder of the GPU plan's rehearsal on this CPU, run in the background (tests/vllm_server.py)."""
    return _prepared(request, "gpu_plan_rehearsal")


@pytest.fixture(scope="session")
def vllm_model_dir(request) -> str:
    """A tiny model vLLM's CPU attention accepts (head size 64)."""
    return _prepared(request, "vllm_model_dir")


@pytest.fixture(scope="session")
def vllm_server(request):
    """One real vLLM CPU server for the whole session; tests push their own weights to it."""
    return _prepared(request, "vllm_server")


@pytest.fixture
def vllm_server_to_kill(request):
    """A server of its own for the one test that kills it (serving ``vllm_model_dir``)."""
    server = _prepared(request, "vllm_server_to_kill")
    yield server
    server.stop()


@pytest.fixture
def vllm_server_to_restart(request):
    """Another server of its own, for the test that kills it and restarts it on its port (tests/vllm/test_vllm_reattach.py)."""
    server = _prepared(request, "vllm_server_to_restart")
    yield server
    server.stop()


@pytest.fixture
def vllm_lone_server(request):
    """A server of its own, started as TRL's `trl vllm-serve` starts it, killed and restarted as the only server of a
    run (tests/vllm/test_vllm_reattach.py)."""
    server = _prepared(request, "vllm_lone_server")
    yield server
    server.stop()


@pytest.fixture
def vllm_server_to_heal(request):
    """A server of its own, killed and restarted at chosen moments (tests/vllm/test_vllm_self_healing.py)."""
    server = _prepared(request, "vllm_server_to_heal")
    yield server
    server.stop()


@pytest.fixture
def vllm_pair_to_heal(request):
    """Two servers of their own, each killed and restarted once (tests/vllm/test_vllm_self_healing.py)."""
    pair = (_prepared(request, "vllm_pair_to_heal_a"), _prepared(request, "vllm_pair_to_heal_b"))
    yield pair
    for server in pair:
        server.stop()


@pytest.fixture(scope="session")
def vllm_tool_model_dir(request) -> str:
    """The tool-calling tiny model (tests/tool_model.py) in a size vLLM's CPU attention accepts (head size 64)."""
    return _prepared(request, "vllm_tool_model_dir")


@pytest.fixture(scope="session")
def vllm_tool_server(request):
    """A second real vLLM CPU server, serving the tool-calling model (multi-turn episodes on the vLLM backend). It
    never loads the tokenizer: requests carry token ids and ask for no text."""
    return _prepared(request, "vllm_tool_server")


def loss_batch(completion_mask=None) -> dict:
    """A 2-row batch in GRPOTrainer's loss-input format (2 prompt tokens, 3 completion tokens per row), for calling
    ``trainer._compute_loss`` directly."""
    mask = torch.ones(2, 3, dtype=torch.long) if completion_mask is None else torch.tensor(completion_mask)
    return {
        "prompt_ids": torch.tensor([[5, 6], [7, 8]]),
        "prompt_mask": torch.ones(2, 2, dtype=torch.long),
        "completion_ids": torch.tensor([[9, 10, 11], [12, 13, 14]]),
        "completion_mask": mask,
        "advantages": torch.tensor([1.0, -0.5]),
        "num_items_in_batch": mask.sum(),
    }


def current_logps(trainer, batch: dict) -> torch.Tensor:
    """The trainer's per-token log-probs of the batch's completions now (no grad); puts the model in train mode and
    sets what Trainer's loop would (``current_gradient_accumulation_steps``) so the loss can be called directly."""
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    with torch.no_grad():
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        return trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, ids.size(1) - 2)[0]


@pytest.fixture(scope="session")
def tool_model_dir(tmp_path_factory) -> str:
    """A tiny model fitted to make real tool calls (tests/tool_model.py), shared by the multi-turn tests."""
    from .tool_model import build_tool_model

    return str(build_tool_model(tmp_path_factory.mktemp("tool_model")))
