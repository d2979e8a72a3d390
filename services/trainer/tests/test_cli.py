"""`rlserve trace report` is the trace report's command line, reached through `rlserve`."""

import json

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
