"""Serve app builder of the critic service (`import_path: rlserve.critic.app:build_app`).

deploy/serve/critic.yaml deploys it on its own (`serve deploy`), deploy/serve/all.yaml
beside the other services; `args` are the fields of CriticServiceConfig, validated before any
deployment starts, so a typo or a bad value fails with a ConfigError naming the field.
"""

from typing import Any

from ray import serve

from rlserve.core.config import validate_config
from rlserve.core.message_limits import bounded
from rlserve.critic.config import CriticServiceConfig
from rlserve.critic.deployment import CriticDeployment


def build_app(args: dict[str, Any]) -> serve.Application:
    """The critic application for `args` (the fields of CriticServiceConfig)."""
    config = validate_config(CriticServiceConfig, args)
    return bounded(CriticDeployment, config.max_request_tokens).bind(config)
