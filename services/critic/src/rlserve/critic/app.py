"""Serve app builder of the critic service (import_path `rlserve.critic.app:build_app`).

A Serve config file reaches it as

    applications:
      - name: critic
        route_prefix: /critic
        import_path: rlserve.critic.app:build_app
        args: {model_path: /models/policy, workers: 2, zero_stage: 1}

`args` is validated into CriticServiceConfig before any deployment starts, so a typo or a
bad value fails with a ConfigError naming the field.
"""

from typing import Any

from ray import serve

from rlserve.core.config import validate_config
from rlserve.critic.config import CriticServiceConfig
from rlserve.critic.deployment import CriticDeployment


def build_app(args: dict[str, Any]) -> serve.Application:
    """The critic application for `args` (the fields of CriticServiceConfig)."""
    config = validate_config(CriticServiceConfig, args)
    return CriticDeployment.bind(config)
