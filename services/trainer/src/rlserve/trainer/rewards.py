"""A step's rewards: the reward service's scores, DAPO's overlong penalty, GDPO's kinds,
and the tools' outcomes of a multi-turn batch (step rewards, failed calls).

`Rewards` makes the ComputeReward calls and sums the figures the service reports with
them (http_failures, http_s, rule_s...) over a step's calls; the step reports them as
reward/<name> and warns when HTTP samples fell back (`warn_reward_failures`).
"""

import logging
from collections import Counter

import torch

from rlserve.core import api
from rlserve.core.algos.advantage_registry import estimator_needs
from rlserve.core.algos.dapo import overlong_penalty
from rlserve.core.batch import Batch
from rlserve.core.rpc import ServiceClient
from rlserve.core.run_config import RunConfig
from rlserve.v1 import reward_pb2

logger = logging.getLogger(__name__)


class Rewards:
    """Scores batches through the reward service; see the module docstring."""

    def __init__(self, client: ServiceClient, config: RunConfig):
        self.client = client
        self.algorithm = config.algorithm
        self.max_new_tokens = config.rollout.max_new_tokens
        self.agent = config.rollout.agent
        self.figures: Counter[str] = Counter()
        """The reward service's figures summed since the step began (`figures.clear()`)."""
        self._info: reward_pb2.RewardServiceGetInfoResponse | None = None
        # GDPO's reward kinds and weights, from the reward service on first use
        self._kind_weights: dict[str, float] | None = None

    async def score(self, batch: Batch) -> dict[str, torch.Tensor]:
        """The reward service's answer: "scores" (B,), and "scores_<kind>" per kind.
        Token ids go only to a service with a reward model: the others read text alone,
        and a rule or HTTP replica on a node without torch could not take tensors by the
        handle route."""
        reads_tokens = "model" in (await self._service_info()).kind_weights
        reward_input = batch.select(
            tensor_keys=["input_ids", "attention_mask"] if reads_tokens else [],
            non_tensor_keys=["response_text", "ground_truth", "prompt_text"],
            meta_keys=[],
        )
        answer = await self.client.call_api(api.ComputeRewardRequest(reward_input))
        self.figures.update(answer.metrics)
        return {key: torch.from_numpy(scores) for key, scores in answer.scores.items()}

    async def rewards(self, batch: Batch) -> dict[str, torch.Tensor]:
        """{"scores": (B,) float32}: the reward service's scores, plus DAPO's overlong
        penalty when it is on (algorithm.overlong_buffer_tokens). For GDPO also
        "reward_components" (B, K): each reward kind's score (and the overlong penalty as
        a kind of its own), in the order of `component_weights`."""
        scored = await self.score(batch)
        scores = self._with_tool_outcomes(batch, scored["scores"].float())
        penalty = self.overlong_penalty(batch) if self.algorithm.overlong_buffer_tokens else None
        if penalty is not None:
            scores = scores + penalty
        rewards = {"scores": scores}
        if "reward_components" in estimator_needs(self.algorithm.adv_estimator):
            kinds = await self.kinds()
            columns = [scored[f"scores_{kind}"].float() for kind in kinds]
            if penalty is not None:
                columns.append(penalty)
            rewards["reward_components"] = torch.stack(columns, dim=1)
        return rewards

    def _with_tool_outcomes(self, batch: Batch, scores: torch.Tensor) -> torch.Tensor:
        """A multi-turn batch's scores with the tools' step rewards added
        (rollout.agent.tool_reward_weight), and 0 for a response with a failed call
        when rollout.agent.on_tool_error is "zero_reward"."""
        agent = self.agent
        if agent is None or "tool_rewards" not in batch.tensors:
            return scores
        scores = scores + agent.tool_reward_weight * batch["tool_rewards"].float()
        if agent.on_tool_error == "zero_reward":
            scores = torch.where(batch["tool_errors"] > 0, torch.zeros_like(scores), scores)
        return scores

    async def kinds(self) -> list[str]:
        """The reward service's kinds, in a fixed order (asked once)."""
        if self._kind_weights is None:
            info = await self._service_info()
            self._kind_weights = dict(sorted(info.kind_weights.items()))
        return list(self._kind_weights)

    async def _service_info(self) -> reward_pb2.RewardServiceGetInfoResponse:
        """The reward service's GetInfo (asked once: its kinds are fixed while it runs)."""
        if self._info is None:
            self._info = await self.client.call("GetInfo", reward_pb2.RewardServiceGetInfoRequest())
        return self._info

    def component_weights(self) -> torch.Tensor | None:
        """GDPO's weight per column of reward_components: each kind's weight in the
        reward service, then 1 for the overlong penalty."""
        if self._kind_weights is None:
            return None
        weights = list(self._kind_weights.values())
        if self.algorithm.overlong_buffer_tokens:
            weights.append(1.0)
        return torch.tensor(weights, dtype=torch.float32)

    def overlong_penalty(self, batch: Batch) -> torch.Tensor:
        """DAPO's penalty per response for running into the last
        algorithm.overlong_buffer_tokens of rollout.max_new_tokens. Shape: (B,)."""
        return overlong_penalty(
            batch["response_mask"].sum(dim=1),
            self.max_new_tokens,
            self.algorithm.overlong_buffer_tokens,
            self.algorithm.overlong_penalty_factor,
        )


def warn_reward_failures(step: int, figures: Counter[str]) -> None:
    """Warns of the step's HTTP reward samples that failed and got the fallback score."""
    failures = int(figures.get("http_failures", 0))
    if failures:
        logger.warning(
            "step %d: %d reward HTTP samples failed (%d requests sent) and were "
            "scored reward.kinds.http.fallback_score (on_failure: fallback)",
            step + 1,
            failures,
            int(figures.get("http_requests", 0)),
        )
