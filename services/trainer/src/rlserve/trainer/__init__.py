"""rlserve trainer: the thin PPO controller composing the services over gRPC.

It owns no model: every model call is a gRPC call to a service. Control contract:
proto/rlserve/v1/trainer.proto. Modules: `cli` (the `rlserve` command), `run` (a whole
run: prepare, deploy, train, report), `deploy` (the services a run needs, onto Serve),
`loop` (one PPO step), `advantages` (token rewards and advantages), `data` (prompt
datasets), `checkpoint`, `metrics`, `control` (TrainerService: status, checkpoint,
stop), `service_ops` (`rlserve service ...`), `trace_report` (`rlserve trace report`).
"""
