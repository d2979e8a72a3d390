"""A background thread that calls a sampling function at a fixed period, for benchmarks
that watch the machine (memory, CPU) while other processes do the work."""

import threading
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
