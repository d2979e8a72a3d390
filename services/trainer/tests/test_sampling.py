"""The sampling parameters the trainer sends: rollout settings reach GenerateSequences."""

from pathlib import Path

from rlserve.core.config import validate_config
from rlserve.core.run_config import RunConfig
from rlserve.trainer.clients import Clients
from rlserve.trainer.data import PromptRow
from rlserve.trainer.loop import PPOTrainer


def trainer(tmp_path: Path, **rollout) -> PPOTrainer:
    config = validate_config(RunConfig, {"rollout": {"max_new_tokens": 9, **rollout}})
    rows = [PromptRow("1+1=", "2")]
    return PPOTrainer(
        config,
        clients=Clients(rollout=None, reward=None, reference=None, critic=None),
        tokenizer=None,
        train_rows=rows,
        eval_rows=rows,
        run_dir=tmp_path,
    )


def test_ignore_eos_reaches_training_generation_but_not_greedy_evaluation(tmp_path):
    ignoring = trainer(tmp_path, ignore_eos=True, responses_per_prompt=3, temperature=0.5)
    sampling = ignoring._sampling(step=4)
    assert sampling.ignore_eos and sampling.max_new_tokens == 9
    assert (sampling.responses_per_prompt, sampling.temperature) == (3, 0.5)
    greedy = ignoring._sampling(step=4, greedy=True)
    assert not greedy.ignore_eos and greedy.temperature == 0 and greedy.responses_per_prompt == 1
    assert not trainer(tmp_path)._sampling(step=0).ignore_eos
