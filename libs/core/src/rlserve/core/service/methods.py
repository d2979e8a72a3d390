"""The names of the methods a service's controller and worker group call on its ranks.

Workers are called by name (`group.run_all(name, ...)` crosses a process boundary, so
a typo fails only at run time, on every rank). Each name is published once, as a
constant: the ones every rank answers here, each service's own in
`rlserve.<service>.methods`, and every call goes through a constant. The services'
tests check with `missing_methods` that each constant names a method of the worker
class, so renaming a worker method without its constant fails a unit test.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

# RankWorker (rlserve.core.rank_worker): every service's ranks
NODE_ADDRESS = "node_address"
INIT_DISTRIBUTED = "init_distributed"
INFO = "info"

# TrainingRankWorker: the ranks of the services that train (rollout, critic)
CHECK_CHECKPOINT = "check_checkpoint"
SAVE_CHECKPOINT = "save_checkpoint"
LOAD_CHECKPOINT = "load_checkpoint"
RESET = "reset"

RANK_METHODS = (NODE_ADDRESS, INIT_DISTRIBUTED, INFO)
"""What every rank answers (the worker group's start-up, GetInfo)."""
TRAINING_RANK_METHODS = (*RANK_METHODS, CHECK_CHECKPOINT, SAVE_CHECKPOINT, LOAD_CHECKPOINT, RESET)
"""What every rank of a training service answers (checkpoints, Reset)."""


def published_names(module: ModuleType) -> dict[str, str]:
    """constant -> method name of every upper-case string constant of `module`."""
    return {
        name: value
        for name, value in vars(module).items()
        if name.isupper() and not name.startswith("_") and isinstance(value, str)
    }


def missing_methods(worker_class: type, *sources: ModuleType | Iterable[str]) -> list[str]:
    """The names, from `sources` (a module's published constants, or names), that are no
    callable attribute of `worker_class`."""
    names: set[str] = set()
    for source in sources:
        names.update(published_names(source).values() if isinstance(source, ModuleType) else source)
    return sorted(name for name in names if not callable(getattr(worker_class, name, None)))
