"""The environment rlserve gives Ray's processes: every cluster's defaults, a private
local cluster's on top, and a user's own settings kept."""

import os

import pytest

from rlserve.core import cluster


@pytest.fixture
def environ(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """os.environ as a plain copy without any of the defaults, so nothing leaks out."""
    copy = {
        key: value
        for key, value in os.environ.items()
        if key not in cluster._RAY_ENV_DEFAULTS and key not in cluster._LOCAL_RAY_ENV_DEFAULTS
    }
    monkeypatch.setattr(os, "environ", copy)
    return copy


def test_a_local_cluster_turns_off_what_only_a_dashboard_reads(environ):
    in_force = cluster.apply_ray_env_defaults(local=True)
    assert in_force["RAY_enable_task_events"] == "0"
    assert in_force["RAY_enable_metrics_collection"] == "0"
    assert in_force["RAY_event_stats"] == "0"
    assert in_force["RAY_LOG_MONITOR_MANY_FILES_THRESHOLD"] == "0"
    assert in_force["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"  # and every cluster's
    assert all(environ[key] == value for key, value in in_force.items())


def test_a_joined_cluster_keeps_rays_observability(environ):
    in_force = cluster.apply_ray_env_defaults()
    assert in_force["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    assert not set(cluster._LOCAL_RAY_ENV_DEFAULTS) & set(in_force)
    assert "RAY_enable_task_events" not in environ


def test_a_users_own_setting_wins(environ):
    environ["RAY_enable_task_events"] = "1"
    environ["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] = "0.1"
    in_force = cluster.apply_ray_env_defaults(local=True)
    assert in_force["RAY_enable_task_events"] == "1"
    assert in_force["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.1"
