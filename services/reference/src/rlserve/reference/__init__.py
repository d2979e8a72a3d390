"""rlserve reference service: log-probs under the frozen initial policy (the KL anchor).

Contract: proto/rlserve/v1/reference.proto. Modules: `config` (ReferenceServiceConfig),
`worker` (one frozen model rank), `controller` (checks, DP dispatch), `deployment` (the
Serve gRPC deployment), `app` (`build_app`, the import_path target).
"""
