"""Watching the machine while other processes do the work: a background thread that
calls a sampling function at a fixed period, the whole machine's CPU time from
/proc/stat and each process's from /proc/PID/stat (benchmarks' memory and CPU figures)."""

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


def first_and_last_inside(samples: list, start_unix_s: float, end_unix_s: float) -> tuple:
    """The first and the last of `samples` (tuples led by their Unix time) taken between
    the two times."""
    inside = [s for s in samples if start_unix_s <= s[0] <= end_unix_s]
    return inside[0], inside[-1]


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
        (_, busy0, all0), (_, busy1, all1) = first_and_last_inside(
            self.samples, start_unix_s, end_unix_s
        )
        return busy1 - busy0, all1 - all0

    def busy_cores(self, start_unix_s: float, end_unix_s: float) -> float:
        """Mean busy cores of the whole machine between the two times."""
        busy, everything = self._window(start_unix_s, end_unix_s)
        return busy / everything * os.cpu_count()

    def cpu_s(self, start_unix_s: float, end_unix_s: float) -> float:
        """CPU seconds the whole machine spent between the two times."""
        return self._window(start_unix_s, end_unix_s)[0] / os.sysconf("SC_CLK_TCK")


def process_role(cmdline: str) -> str:
    """The part of a run a process plays, from its command line: a Ray worker or Serve
    replica by its actor name, the trainer, or one of Ray's and Serve's own processes."""
    title = cmdline.split(" ")[0]  # Ray pads its process titles with spaces
    if title.startswith("ray::ServeReplica:"):
        return "replica " + title.removeprefix("ray::ServeReplica:").split(":")[0]  # the app
    if title.startswith("ray::") and title.split(".")[0].endswith("Worker"):
        return title.split(".")[0].removeprefix("ray::")  # ray::ActorWorker.call
    if "rlserve.trainer.cli" in cmdline:
        return "trainer"
    return "Ray and Serve's own processes"


class ProcessCpuSampler:
    """Samples every process's CPU time (/proc/PID/stat) with wall-clock times, so the CPU
    a window of a run spent can be split by process_role; `with s.sampling(): ...`
    samples every `period_s` in a thread. Only processes whose command line `selects`
    (default: every ray:: process, Ray's binaries and the trainer) are counted."""

    def __init__(self, period_s: float = 1.0, selects: Callable[[str], bool] | None = None):
        self.period_s = period_s
        self.selects = selects or (lambda cmd: "ray" in cmd or "rlserve.trainer.cli" in cmd)
        self.samples: list[tuple[float, dict[int, tuple[int, str]]]] = []

    def sampling(self) -> PeriodicThread:
        return PeriodicThread(self.period_s, self.sample)

    def sample(self) -> None:
        ticks: dict[int, tuple[int, str]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            pid = int(entry)
            try:
                with open(f"/proc/{pid}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
                # read every time: a Ray worker's title changes as it starts (python ...
                # default_worker.py, then ray::IDLE, then ray::ActorWorker)
                with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                    name = cmdline.read().replace(b"\0", b" ").decode(errors="replace")
                if not name:
                    continue
            except OSError:  # the process ended meanwhile
                continue
            if self.selects(name):
                ticks[pid] = (int(fields[11]) + int(fields[12]), name)  # utime + stime
        self.samples.append((time.time(), ticks))

    def cpu_s_by_role(self, start_unix_s: float, end_unix_s: float) -> dict[str, float]:
        """CPU seconds per second of wall time each role spent between the two times
        (between the samples nearest inside them), largest first."""
        (t0, first), (t1, last) = first_and_last_inside(self.samples, start_unix_s, end_unix_s)
        tick_s = 1 / os.sysconf("SC_CLK_TCK")
        by_role: dict[str, float] = {}
        for pid, (ticks, name) in last.items():
            spent = (ticks - first.get(pid, (0, name))[0]) * tick_s / (t1 - t0)
            role = process_role(name)
            by_role[role] = by_role.get(role, 0.0) + spent
        return dict(sorted(by_role.items(), key=lambda item: -item[1]))
