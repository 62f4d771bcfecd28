"""The live status page: ``GET /`` (the page), ``GET /v1/status`` (its JSON) and
``GET /v1/status/events`` (server-sent events), on the model of ``reach status``.

``feed`` samples the fleet while someone watches and follows the registry's changes;
``hub`` fans events out with a bounded queue per stream and a cap on streams; ``snapshot``
builds the JSON; ``routes`` serves it all. The page itself is three static files in
``static/`` (plain HTML, CSS and JavaScript, no build step), shipped as package data.
"""

from .feed import StatusFeed
from .routes import page_routes

__all__ = ["StatusFeed", "page_routes"]
