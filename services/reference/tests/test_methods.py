"""Every method name the reference's controller calls is a ReferenceWorker method."""

from rlserve.core.service.methods import RANK_METHODS, missing_methods, published_names
from rlserve.reference import methods
from rlserve.reference.worker import ReferenceWorker


def test_every_published_method_name_is_a_reference_worker_method():
    assert set(published_names(methods).values()) == {"compute_ref_log_prob"}
    assert missing_methods(ReferenceWorker, methods, RANK_METHODS) == []


def test_the_check_finds_a_name_without_a_method():
    assert missing_methods(ReferenceWorker, ["compute_ref_log_probs", "info"]) == [
        "compute_ref_log_probs"
    ]
