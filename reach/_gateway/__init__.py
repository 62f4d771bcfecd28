"""The HTTP edge's gateway: FastAPI routes over a ``reach.Client`` (``reach gateway``).

Imported only by the CLI subcommand or by an application that wants the app itself
(``build_app(EdgeDeps(client, settings))``): ``import reach`` never loads FastAPI.
"""

from .app import build_app
from .deps import EdgeDeps
from .edge import Edge, build_edge
from .settings import GatewaySettings, Scope

__all__ = ["Edge", "EdgeDeps", "GatewaySettings", "Scope", "build_app", "build_edge"]
