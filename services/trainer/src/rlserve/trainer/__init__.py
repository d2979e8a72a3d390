"""rlserve trainer: the thin PPO controller composing the services over gRPC.

It owns no model: every model call is a gRPC call to a service. Control contract:
proto/rlserve/v1/trainer.proto. Modules: `cli` (the `rlserve` command), `run` (a whole
run: prepare, deploy, train, report), `deploy` (the services a run needs, onto Serve),
`clients` (the services' clients), `loop` (one PPO step), `schedule` (rollout.mode:
when a step's batch is generated), `rewards`, `dynamic_sampling`, `advantages` (token
rewards and advantages), `step_metrics` (a step's metrics), `data` (prompt datasets),
`checkpoint`, `metrics`, `recovery`, `control` (TrainerService: status, checkpoint,
stop), `service_ops` (`rlserve service ...`), `trace_report` (`rlserve trace report`).
"""
