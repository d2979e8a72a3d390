"""The stateful-service kernel: what the rollout, critic and reference controllers share.

- `methods`: the method names every rank answers (RankWorker, TrainingRankWorker), and
  the check that a service's published names are real methods of its worker class.
  Each service publishes its own worker's names beside it (rlserve.<service>.methods),
  and its controller calls the workers through those constants only.
- `plan`: MiniBatchPlan, the one plan of an update's mini-batches (global row order,
  each rank's share, the global loss units), shared by the actor and the critic.
- `controller`: StatefulController, the lock (rlserve.core.exclusive), the step ledger
  (rlserve.core.steps) with its one checkpoint format, the known/broken state, the one
  update rule (checks → broken? → replay → apply), checkpoints, Reset and health.

The group is rlserve.core.workers.WorkerGroup, the rank rlserve.core.rank_worker
.RankWorker, and the one in-process group of the unit tests (the group's interface over
workers in the test's process) the root conftest's `in_process_group` fixture: test
helpers stay out of shipped modules. This package imports neither Ray's worker
transport nor any model code, so a Serve replica stays light.
"""
