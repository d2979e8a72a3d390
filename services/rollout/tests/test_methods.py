"""Every method name the rollout's controller and deployment call is an ActorWorker method."""

from rlserve.core.service import methods as rank_methods
from rlserve.core.service.methods import TRAINING_RANK_METHODS, missing_methods
from rlserve.rollout import methods
from rlserve.rollout.worker import ActorWorker


def test_every_published_method_name_is_an_actor_worker_method():
    assert missing_methods(ActorWorker, methods, TRAINING_RANK_METHODS) == []
    assert missing_methods(ActorWorker, rank_methods) == []
