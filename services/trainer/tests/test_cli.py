"""The `rlserve` command line: `trace report` delegation, `model import-gguf` arguments,
`config --describe`."""

import json

import pytest

from rlserve.core import tracing
from rlserve.trainer import cli


def test_trace_report_is_delegated_with_its_arguments(tmp_path, capsys):
    path = tmp_path / "spans.jsonl"
    tracing.setup_tracing("rlserve-trainer", None, 1.0, True, path)
    try:
        with tracing.span("ppo.step", step=5), tracing.span("trainer.advantages"):
            pass
    finally:
        tracing.shutdown_tracing()
    assert json.loads(path.read_text().splitlines()[0])["resourceSpans"]
    assert cli.main(["trace", "report", str(path), "--step", "5"]) == 0
    out = capsys.readouterr().out
    assert "step 5  trace " in out and "trainer.advantages (rlserve-trainer)" in out
    assert cli.main(["trace", "report", str(path), "--step", "6"]) == 1
    assert cli.main(["trace", "report", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err


def test_model_import_gguf_help_names_its_arguments(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["model", "import-gguf", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "gguf_file" in out and "out_dir" in out and "--dtype" in out


def test_model_import_gguf_refusals_exit_2_naming_the_argument(tmp_path, capsys):
    missing = tmp_path / "missing.gguf"
    assert cli.main(["model", "import-gguf", str(missing), str(tmp_path / "out")]) == 2
    assert "gguf_file:" in capsys.readouterr().err
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert cli.main(["model", "import-gguf", str(gguf), str(tmp_path)]) == 2
    assert "out_dir:" in capsys.readouterr().err
    assert cli.main(["model", "import-gguf", str(gguf), str(tmp_path / "new"), "--dtype", "x"]) == 2
    assert "dtype: 'x' is not one of" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_a_context_overflow_found_after_loading_is_a_config_error_exit_2(tmp_path, capsys):
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        num_attention_heads=2,
        num_hidden_layers=1,
        max_position_embeddings=64,
    ).save_pretrained(tmp_path / "model")
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "ground_truth": "2"}\n')
    code = cli.main(
        [
            "train",
            f"trainer.run_dir={tmp_path / 'runs'}",
            f"model.path={tmp_path / 'model'}",
            f"data.train_path={data}",
            "data.max_prompt_tokens=60",
            "rollout.max_new_tokens=8",
        ]
    )
    assert code == 2
    error = capsys.readouterr().err
    assert error.startswith("config error: data.max_prompt_tokens: 60 + rollout.max_new_tokens 8")


def test_config_describe_lists_the_algorithm_catalogue(capsys):
    from rlserve.core.algos.advantage_registry import ADVANTAGE_ESTIMATOR_NOTES
    from rlserve.core.algos.aggregation import LOSS_AGG_MODE_NOTES
    from rlserve.core.algos.kl import KL_KIND_NOTES
    from rlserve.core.algos.policy_loss_registry import POLICY_LOSS_NOTES

    assert cli.main(["config", "--describe"]) == 0
    text = capsys.readouterr().out
    notes = (
        ADVANTAGE_ESTIMATOR_NOTES,
        POLICY_LOSS_NOTES,
        KL_KIND_NOTES,
        LOSS_AGG_MODE_NOTES,
    )
    for family in notes:
        for name, note in family.items():
            assert f"      {name}: {note.line()}\n" in text, name


def test_config_with_an_unknown_policy_loss_exits_2_naming_the_choices(capsys):
    assert cli.main(["config", "actor.policy_loss=ppo"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("config error: actor.policy_loss: Input should be 'vanilla'")


def test_service_options_may_follow_the_action():
    before = cli._parser().parse_args(["service", "--address", "h:6379", "deploy", "f.yaml"])
    after = cli._parser().parse_args(["service", "deploy", "f.yaml", "--address", "h:6379"])
    assert vars(before) == vars(after)
    assert after.address == "h:6379" and after.grpc_port == 9000 and after.timeout_s == 600.0
    scaled = cli._parser().parse_args(
        ["service", "scale", "reward", "--replicas", "2", "--timeout-s", "5"]
    )
    assert (scaled.address, scaled.timeout_s, scaled.replicas) == ("auto", 5.0, 2)


def test_config_prints_secrets_redacted_and_the_run_file_is_private(tmp_path, capsys):
    import os
    import stat

    from rlserve.core.config import load_config
    from rlserve.core.run_config import RunConfig
    from rlserve.trainer.run import new_run_dir

    overrides = [
        "reward.kinds.http.url=http://verifier:8000/score",
        "reward.kinds.http.headers={Authorization: Bearer s3cret}",
        f"trainer.run_dir={tmp_path}",
    ]
    assert cli.main(["config", *overrides]) == 0
    out = capsys.readouterr().out
    assert "headers: <redacted>" in out and "s3cret" not in out
    old_umask = os.umask(0o022)
    try:
        run_dir = new_run_dir(load_config(RunConfig, None, overrides))
    finally:
        os.umask(old_umask)
    saved = run_dir / "config.yaml"
    assert stat.S_IMODE(saved.stat().st_mode) == 0o600
    # the run's own copy keeps the value: resume needs it
    assert load_config(RunConfig, saved).reward.kinds.http.headers == {
        "Authorization": "Bearer s3cret"
    }
