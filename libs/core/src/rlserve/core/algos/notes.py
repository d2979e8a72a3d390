"""What a registered algorithm name carries: a one-line note with its paper, and the
registry that maps config names to entries.

Advantage estimators and policy losses are registered by one decorator on each entry
(``register_estimator`` in :mod:`rlserve.core.algos.advantage_registry`,
``register_policy_loss`` in :mod:`rlserve.core.algos.policy_loss_registry`), each
filling one :class:`Registry`; KL estimators and aggregation modes are branches of one
function each and keep a plain dict of notes. Registration order is the order
``rlserve config --describe`` and docs/configuration.md list the names in, each under
the config field that selects it (``choices_extra``).
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

EntryT = TypeVar("EntryT")


@dataclass(frozen=True)
class AlgorithmNote:
    """What a registered name does, in one line, and the paper it comes from.

    Every registry here (advantage estimators, policy losses, KL estimators, loss
    aggregation modes) keeps one note per name; the run config shows them under the
    field that selects them (``rlserve config --describe``), so the descriptions live
    in one place and a test checks that every registered name has one.
    """

    summary: str
    """One line: what it computes."""
    paper: str
    """Authors, year, title and arXiv id (or where the idea comes from)."""

    def line(self) -> str:
        """``summary — paper``, the form ``rlserve config --describe`` prints."""
        return f"{self.summary} — {self.paper}"


def choices_extra(
    notes: Mapping[str, AlgorithmNote], names: tuple[str, ...] | None = None
) -> dict[str, Any]:
    """A config field's json_schema_extra that makes `rlserve config --describe` list each
    choice (those in `names`, or every one) under the field with its one-line note and
    paper."""
    return {"choices": {n: note.line() for n, note in notes.items() if names is None or n in names}}


class Registry(Generic[EntryT]):
    """Entries by config name, in registration order; iterating yields the names.

    Args:
        family: What the names are, for errors ("advantage estimator", "policy loss").
    """

    def __init__(self, family: str) -> None:
        self.family = family
        self._entries: dict[str, EntryT] = {}

    def add(self, name: str, entry: EntryT) -> None:
        """Register ``entry`` as ``name``; ValueError if the name is taken (a second
        decorator with the same name would otherwise replace the first silently)."""
        if name in self._entries:
            raise ValueError(f"{self.family} {name!r} is registered twice")
        self._entries[name] = entry

    def lookup(self, name: str) -> EntryT:
        """The entry registered as ``name``; ValueError naming the valid choices if none."""
        if name not in self._entries:
            raise ValueError(
                f"unknown {self.family} {name!r}; valid choices: {', '.join(self._entries)}"
            )
        return self._entries[name]

    def items(self) -> ItemsView[str, EntryT]:
        """``(name, entry)`` pairs in registration order."""
        return self._entries.items()

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)


class RegistryNotes(Mapping[str, AlgorithmNote]):
    """The notes of a :class:`Registry`'s entries by name, in its order, read when asked:
    the entries register where they are defined, after the registry's module has run.

    Args:
        registry: A registry whose entries carry a ``note``.
    """

    def __init__(self, registry: Registry[Any]) -> None:
        self._registry = registry

    def __getitem__(self, name: str) -> AlgorithmNote:
        if name not in self._registry:
            raise KeyError(name)
        return self._registry.lookup(name).note

    def __iter__(self) -> Iterator[str]:
        return iter(self._registry)

    def __len__(self) -> int:
        return len(list(self._registry))
