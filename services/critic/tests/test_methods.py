"""Every method name the critic's controller calls is a CriticWorker method."""

from rlserve.core.service import methods as rank_methods
from rlserve.core.service.methods import TRAINING_RANK_METHODS, missing_methods, published_names
from rlserve.critic import methods
from rlserve.critic.worker import CriticWorker


def test_every_published_method_name_is_a_critic_worker_method():
    assert set(published_names(methods).values()) == {"compute_values", "update_critic"}
    assert missing_methods(CriticWorker, methods, TRAINING_RANK_METHODS) == []
    assert missing_methods(CriticWorker, rank_methods) == []
