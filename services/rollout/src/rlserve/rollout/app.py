"""Serve app builder of the rollout service: `import_path: rlserve.rollout.app:build_app`.

A Serve config file deploys it with the service's settings as `args`, e.g.::

    applications:
      - name: rollout
        route_prefix: /rollout
        import_path: rlserve.rollout.app:build_app
        args: {model_path: /models/policy, workers: 2, engine: hf}

The args are validated into RolloutServiceConfig before anything is deployed, so a typo
or an uneven batch split fails here with a ConfigError naming the field.
"""

from __future__ import annotations

from typing import Any

from ray import serve

from rlserve.core.config import validate_config
from rlserve.core.message_limits import bounded
from rlserve.rollout.config import RolloutServiceConfig
from rlserve.rollout.deployment import RolloutDeployment


def build_app(args: dict[str, Any]) -> serve.Application:
    """The rollout application for `args` (the fields of RolloutServiceConfig)."""
    config = validate_config(RolloutServiceConfig, args)
    return bounded(RolloutDeployment, config.max_request_tokens).bind(config)
