"""metrics.jsonl survives a write cut short: the torn last line is cut with a message
before a resume restores anything; damage elsewhere is named, not guessed at."""

import json

import pytest

from rlserve.core.config import dump_config
from rlserve.core.run_config import RunConfig
from rlserve.trainer import cli
from rlserve.trainer.checkpoint import STATE_FILE, checkpoint_dir, write_trainer_state
from rlserve.trainer.metrics import MetricsLog, read_metrics, repair_torn_tail


def _log_with_steps(run_dir, steps: int):
    log = MetricsLog(run_dir, tensorboard=False)
    for step in range(1, steps + 1):
        log.write(step, {"reward/mean": step / 10})
    return log.path


def test_a_torn_last_line_is_cut_and_the_records_before_it_kept(tmp_path):
    path = _log_with_steps(tmp_path, 3)
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"step": 4, "reward/me')
    message = repair_torn_tail(path)
    assert "dropped a torn last line (22 bytes" in message and "3 whole records" in message
    assert path.read_bytes() == whole
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    assert repair_torn_tail(path) is None  # whole now: nothing to say


def test_a_torn_line_that_ends_in_a_newline_is_cut_too(tmp_path):
    path = _log_with_steps(tmp_path, 2)
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"step": 3,\n')
    assert "dropped a torn last line" in repair_torn_tail(path)
    assert path.read_bytes() == whole


def test_a_whole_last_record_without_its_newline_gets_one(tmp_path):
    path = _log_with_steps(tmp_path, 2)
    path.write_bytes(path.read_bytes().rstrip(b"\n"))
    assert repair_torn_tail(path) is None
    MetricsLog(tmp_path, tensorboard=False).write(3, {"reward/mean": 0.3})
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]


def test_damage_before_the_last_line_is_named(tmp_path):
    path = _log_with_steps(tmp_path, 3)
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + "not json\n" + "".join(lines[1:]))
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 2 is not a JSON record; fix or"):
        repair_torn_tail(path)
    assert repair_torn_tail(tmp_path / "absent.jsonl") is None


def _resumable_run(tmp_path):
    runs = tmp_path / "runs"
    run_dir = runs / "run1"
    checkpoint = checkpoint_dir(run_dir, 2)
    checkpoint.mkdir(parents=True)
    write_trainer_state(checkpoint, {"step": 2})
    config = RunConfig.model_validate({"trainer": {"run_dir": str(runs)}})
    (run_dir / "config.yaml").write_text(dump_config(config))
    return run_dir


def test_resume_names_a_damaged_metrics_file_before_any_cluster_starts(tmp_path, capsys):
    run_dir = _resumable_run(tmp_path)
    records = [json.dumps({"step": step}) for step in (1, 2)]
    (run_dir / "metrics.jsonl").write_text(f"{records[0]}\n{{oops\n{records[1]}\n")
    assert cli.main(["resume", str(run_dir)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and "metrics.jsonl: line 2 is not a JSON record" in error
    assert not (run_dir / "inputs.json").exists()  # nothing was prepared or started


def test_resume_without_a_complete_checkpoint_exits_2_naming_the_run(tmp_path, capsys):
    run_dir = _resumable_run(tmp_path)
    (checkpoint_dir(run_dir, 2) / STATE_FILE).unlink()
    assert cli.main(["resume", str(run_dir)]) == 2
    assert f"{run_dir} holds no complete checkpoint to resume from" in capsys.readouterr().err
