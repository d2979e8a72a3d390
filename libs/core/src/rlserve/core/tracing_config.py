"""`TracingConfig`: whether and where a process exports its spans.

The run config's `trainer.tracing` and every service config's `tracing` are this one
model; rlserve.core.tracing (the OpenTelemetry set-up it configures) and
rlserve.core.serving (a replica's set-up from it) read it. It lives apart from tracing so
that a config can name it without importing OpenTelemetry.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from rlserve.core.config import ConfigError, ConfigModel

__all__ = ["TracingConfig"]


class TracingConfig(ConfigModel):
    """OpenTelemetry tracing: one trace per PPO step, spans across every service.

    The trainer hands its section to every service it deploys; a service deployed on
    its own embeds the same model as its `tracing` field."""

    enabled: bool = False
    """Export spans."""
    otlp_endpoint: str | None = "http://localhost:4317"
    """OTLP/gRPC collector, e.g. Jaeger's (http:// plaintext, https:// TLS); None = no
    OTLP export (file_path only)."""
    sampling_ratio: float = Field(1.0, ge=0, le=1)
    """Fraction of PPO steps traced (the trainer decides per step and the services follow;
    a service applies it to calls that arrive without a trace)."""
    file_path: str | None = None
    """Also append spans as OTLP/JSON lines to this file, for `rlserve trace report`
    (each process appends to it on its own node)."""

    @model_validator(mode="after")
    def _has_a_destination(self) -> TracingConfig:
        if self.enabled and self.otlp_endpoint is None and self.file_path is None:
            raise ConfigError(
                "otlp_endpoint", "tracing is enabled but neither it nor file_path is set"
            )
        return self
