"""Tests for rlserve.core.algos.notes: the algorithm notes, and the registries that one
decorator per entry fills (checked through the registries themselves)."""

from __future__ import annotations

import pytest
import torch

from rlserve.core.algos.advantage_registry import ADVANTAGE_ESTIMATOR_NOTES, ADVANTAGE_ESTIMATORS
from rlserve.core.algos.aggregation import LOSS_AGG_MODE_NOTES, LOSS_AGG_MODES
from rlserve.core.algos.kl import KL_KIND_NOTES, KL_KINDS
from rlserve.core.algos.notes import Registry
from rlserve.core.algos.policy_loss_registry import POLICY_LOSS_NOTES, POLICY_LOSSES


def test_every_registered_name_has_a_one_line_note_with_a_paper():
    catalogue = {
        "advantage estimators": (ADVANTAGE_ESTIMATORS, ADVANTAGE_ESTIMATOR_NOTES),
        "policy losses": (POLICY_LOSSES, POLICY_LOSS_NOTES),
        "KL estimators": (KL_KINDS, KL_KIND_NOTES),
        "aggregation modes": (LOSS_AGG_MODES, LOSS_AGG_MODE_NOTES),
    }
    for family, (names, notes) in catalogue.items():
        assert list(names) == list(notes), family
        for name, note in notes.items():
            assert note.summary and note.paper, (family, name)
            assert "\n" not in note.line(), (family, name)


def test_every_entry_has_a_note_and_each_loss_with_a_clip_its_default_range(
    make_mask, policy_batch
):
    # estimators and losses: a one-line note with a paper on every entry
    entries = [*ADVANTAGE_ESTIMATORS.items(), *POLICY_LOSSES.items()]
    for name, entry in entries:
        assert entry.note.summary and entry.note.paper, name
        assert "\n" not in entry.note.line(), name
    # a loss has default clip ratios exactly when its value depends on the clip range:
    # a tiny range against a wide one changes every clipped loss on this batch
    gen = torch.Generator().manual_seed(0)
    mask = make_mask("right_padded", gen)
    old, new, adv = policy_batch(gen, mask)
    narrow = {"clip_ratio_low": 1e-3, "clip_ratio_high": 1e-3}
    wide = {"clip_ratio_low": 0.9, "clip_ratio_high": 9.0}
    for name, entry in POLICY_LOSSES.items():
        losses = [
            entry.loss(old, new, adv, mask, clip, generator=torch.Generator().manual_seed(1))[0]
            for clip in (narrow, wide)
        ]
        reads_clip = not torch.equal(*losses)
        assert (entry.default_clip_ratios is not None) == reads_clip, name
        if entry.default_clip_ratios is not None:
            low, high = entry.default_clip_ratios
            assert 0 <= low < 1 and high >= 0, name


def test_a_registry_refuses_a_second_entry_of_one_name():
    registry = Registry("toy")
    registry.add("a", 1)
    with pytest.raises(ValueError, match="toy 'a' is registered twice"):
        registry.add("a", 2)
    assert registry.lookup("a") == 1
    with pytest.raises(ValueError, match="unknown toy 'b'; valid choices: a"):
        registry.lookup("b")
