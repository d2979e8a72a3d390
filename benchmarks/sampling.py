"""Watching the machine while other processes do the work: a background thread that
calls a sampling function at a fixed period, and the whole machine's CPU time from
/proc/stat (benchmarks' memory and CPU figures)."""

import os
import threading
import time
from collections.abc import Callable


class PeriodicThread:
    """Calls `sample()` every `period_s` from the moment the `with` block starts until
    it ends (the last call at most `period_s` before the end)."""

    def __init__(self, period_s: float, sample: Callable[[], None]):
        self._period_s = period_s
        self._sample = sample
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "PeriodicThread":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            self._sample()


class MachineCpuSampler:
    """Samples /proc/stat (all cores) with wall-clock times, so the cores a run of other
    processes kept busy in a window can be read; `with cpu.sampling(): ...` samples
    every `period_s` in a thread."""

    def __init__(self, period_s: float = 0.1):
        self.period_s = period_s
        self.samples: list[tuple[float, int, int]] = []  # (unix s, busy jiffies, all)

    def sampling(self) -> PeriodicThread:
        return PeriodicThread(self.period_s, self.sample)

    def sample(self) -> None:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        self.samples.append((time.time(), sum(fields) - idle, sum(fields)))

    def _window(self, start_unix_s: float, end_unix_s: float) -> tuple[int, int]:
        inside = [s for s in self.samples if start_unix_s <= s[0] <= end_unix_s]
        (_, busy0, all0), (_, busy1, all1) = inside[0], inside[-1]
        return busy1 - busy0, all1 - all0

    def busy_cores(self, start_unix_s: float, end_unix_s: float) -> float:
        """Mean busy cores of the whole machine between the two times."""
        busy, everything = self._window(start_unix_s, end_unix_s)
        return busy / everything * os.cpu_count()

    def cpu_s(self, start_unix_s: float, end_unix_s: float) -> float:
        """CPU seconds the whole machine spent between the two times."""
        return self._window(start_unix_s, end_unix_s)[0] / os.sysconf("SC_CLK_TCK")
