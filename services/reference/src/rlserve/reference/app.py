"""Serve app builder of the reference service (`rlserve.reference.app:build_app`).

A Serve config file reaches it as

    applications:
      - name: reference
        route_prefix: /reference
        import_path: rlserve.reference.app:build_app
        args: {model_path: /models/policy, workers: 2, temperature: 1.0}

`args` is validated into ReferenceServiceConfig before any deployment starts, so a typo
or a bad value fails with a ConfigError naming the field.
"""

from typing import Any

from ray import serve

from rlserve.core.config import validate_config
from rlserve.reference.config import ReferenceServiceConfig
from rlserve.reference.deployment import ReferenceDeployment


def build_app(args: dict[str, Any]) -> serve.Application:
    """The reference application for `args` (the fields of ReferenceServiceConfig)."""
    return ReferenceDeployment.bind(validate_config(ReferenceServiceConfig, args))
