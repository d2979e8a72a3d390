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
- `in_process`: InProcessGroup, the worker group's interface over workers in this
  process (the unit tests' group).

The group itself is rlserve.core.workers.WorkerGroup and the rank
rlserve.core.rank_worker.RankWorker. This package imports neither Ray's worker
transport nor any model code, so a Serve replica stays light.
"""
