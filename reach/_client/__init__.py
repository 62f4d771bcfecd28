"""The client: a facade (``client``) over the request path (``attempts`` -> ``inbox``),
asking every instance at once (``gather``, over ``attempts``), streaming replies
(``stream``, over ``attempts``), broadcast (``topics``) and
two watched buckets, the routing table (``table``) and the routing configuration
(``config``), both followed by ``reach._kv.BucketMirror``."""

from .client import Client, ClientStats
from .gather import Gathered
from .inbox import Reply
from .stream import Stream
from .topics import TopicMessage, TopicSubscription

__all__ = [
    "Client",
    "ClientStats",
    "Gathered",
    "Reply",
    "Stream",
    "TopicMessage",
    "TopicSubscription",
]
