"""The HTTP wrapper for programs (``reach wrap`` on the command line): ``HttpWrapper`` runs
a Reach agent that serves each capability by calling an existing HTTP endpoint. It needs the
``edge`` extra (httpx), so ``import reach`` does not import this module; import it yourself.
See ``reach._wrap`` for how it works."""

from ._wrap import (
    Endpoint,
    HealthCheck,
    HttpHeader,
    HttpWrapper,
    WrapSpec,
    WrapStats,
    build_spec,
    load_config,
    redact,
)

__all__ = [
    "Endpoint",
    "HealthCheck",
    "HttpHeader",
    "HttpWrapper",
    "WrapSpec",
    "WrapStats",
    "build_spec",
    "load_config",
    "redact",
]
