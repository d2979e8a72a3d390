"""A node that cannot start a task (its raylet stopped) is named and given up on within
the measurement's timeout, instead of stalling whoever measures (the trainer's loop)."""

import logging
import os
import signal
import time

import ray

from rlserve.core.resources import _measure


def test_memory_of_a_stalled_node_is_given_up_within_the_timeout(pool_cluster, caplog):
    here = ray.get_runtime_context().get_node_id()
    stalled, healthy = sorted(pool_cluster.nodes_in("cheap"))
    assert here not in (stalled, healthy)
    pid = os.getpid()  # any pid: each node's task reads it on its own machine (this one)
    os.kill(pool_cluster.raylet_pids[stalled], signal.SIGSTOP)
    try:
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="rlserve.core.resources"):
            sizes = _measure({(stalled, pid), (healthy, pid)}, timeout_s=3.0)
        took_s = time.monotonic() - started
    finally:
        os.kill(pool_cluster.raylet_pids[stalled], signal.SIGCONT)
    assert took_s < 10.0
    assert sizes[stalled, pid] == -1 and sizes[healthy, pid] > 0
    assert f"node {stalled} did not report" in caplog.text
