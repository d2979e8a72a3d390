"""Serve app builder of the reference service (`import_path: rlserve.reference.app:build_app`).

deploy/serve/reference.yaml deploys it on its own (`serve deploy`), deploy/serve/all.yaml
beside the other services; `args` are the fields of ReferenceServiceConfig, validated before any
deployment starts, so a typo or a bad value fails with a ConfigError naming the field.
"""

from typing import Any

from ray import serve

from rlserve.core.config import validate_config
from rlserve.core.message_limits import bounded
from rlserve.reference.config import ReferenceServiceConfig
from rlserve.reference.deployment import ReferenceDeployment


def build_app(args: dict[str, Any]) -> serve.Application:
    """The reference application for `args` (the fields of ReferenceServiceConfig)."""
    config = validate_config(ReferenceServiceConfig, args)
    return bounded(ReferenceDeployment, config.max_request_tokens).bind(config)
