"""tools/gpu_smoke.py gives a verdict: its phases' timeouts fit the documented eight
minutes, a failing phase fails the run, a missing package SKIPs (never PASSes), a hung
phase is stopped by its timeout, and the staging script keeps within a device call's
64 MiB. The phases themselves run on the CPU as `make test`'s own step
(`gpu_smoke.py --cpu`), not here: that step starts a Ray cluster of its own."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "tools" / "gpu_smoke.py"


@pytest.fixture(scope="module")
def gpu_smoke():
    spec = importlib.util.spec_from_file_location("gpu_smoke", SMOKE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_smoke"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules["gpu_smoke"]


def results(out: Path) -> dict[str, dict]:
    lines = (out / "phases.jsonl").read_text().splitlines()
    return {record["phase"]: record for record in map(json.loads, lines)}


def test_the_gpu_run_ends_within_eight_minutes_by_its_own_timeouts(gpu_smoke):
    assert gpu_smoke.GPU_BUDGET_S == 8 * 60
    assert sum(phase.gpu_timeout_s for phase in gpu_smoke.PHASES) <= gpu_smoke.GPU_BUDGET_S
    assert {phase.name for phase in gpu_smoke.PHASES} == set(gpu_smoke.PHASE_FUNCTIONS)


def test_a_gpu_run_without_a_gpu_fails_and_exits_non_zero(tmp_path):
    # this machine has no CUDA: the GPU run's environment phase must say FAIL, not PASS
    completed = subprocess.run(
        [sys.executable, str(SMOKE), "--out", str(tmp_path), "--phases", "env"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 1, completed.stdout + completed.stderr
    record = results(tmp_path)["env"]
    assert record["status"] == "FAIL"
    assert "no CUDA device" in record["error"]
    assert "0 PASS, 1 FAIL, 0 SKIP" in completed.stdout


def test_the_cpu_environment_phase_passes(tmp_path):
    completed = subprocess.run(
        [sys.executable, str(SMOKE), "--cpu", "--out", str(tmp_path), "--phases", "env"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert results(tmp_path)["env"]["details"]["torch"] != "missing"


def test_a_phase_whose_package_is_missing_skips(gpu_smoke, tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(
        gpu_smoke, "PHASES", (gpu_smoke.Phase("vllm", 1, 1, needs="rlserve_no_such_module"),)
    )
    monkeypatch.setitem(gpu_smoke.PHASE_FUNCTIONS, "vllm", lambda smoke: ran.append(smoke))
    args = gpu_smoke.argparse.Namespace(phase="vllm", out=str(tmp_path), cpu=True)
    assert gpu_smoke.run_one_phase(args) == 0
    record = results(tmp_path)["vllm"]
    assert record["status"] == "SKIP"
    assert "rlserve_no_such_module is not installed" in record["reason"]
    assert not ran


def test_a_raising_phase_fails(gpu_smoke, tmp_path, monkeypatch):
    def broken(smoke):
        raise AssertionError("greedy tokens agree on 3/8 prompts only")

    monkeypatch.setitem(gpu_smoke.PHASE_FUNCTIONS, "lora", broken)
    args = gpu_smoke.argparse.Namespace(phase="lora", out=str(tmp_path), cpu=True)
    assert gpu_smoke.run_one_phase(args) == 1
    record = results(tmp_path)["lora"]
    assert record["status"] == "FAIL"
    assert "3/8" in record["error"]


def test_a_hung_phase_is_stopped_by_its_timeout_and_fails(gpu_smoke, tmp_path, monkeypatch):
    # The child is a script that sleeps past the phase's 1 s timeout.
    hang = tmp_path / "hang.py"
    hang.write_text("import time\ntime.sleep(60)\n")
    monkeypatch.setattr(gpu_smoke, "PHASES", (gpu_smoke.Phase("env", 1, 1),))
    monkeypatch.setattr(gpu_smoke, "__file__", str(hang))
    args = gpu_smoke.argparse.Namespace(out=str(tmp_path / "out"), cpu=True, phases=None)
    assert gpu_smoke.run_phases(args) == 1
    record = results(tmp_path / "out")["env"]
    assert record["status"] == "FAIL"
    assert "timed out after 1 s" in record["error"]


def test_nvidia_smi_fields_that_read_not_available_are_unknown(gpu_smoke, monkeypatch, tmp_path):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho '[N/A]'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    assert gpu_smoke.nvidia_smi_field("driver_version") == "unknown"


def test_the_staging_script_keeps_within_a_device_call(tmp_path):
    script = (REPO / "tools" / "stage_gpu_wheels.sh").read_text()
    assert "limit_mib=64" in script
    subprocess.run(["bash", "-n", str(REPO / "tools" / "stage_gpu_wheels.sh")], check=True)
