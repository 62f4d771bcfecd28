"""The client: a facade (``client``) over the request path (``attempts`` -> the muxed
``reach._inbox``), asking every instance at once (``gather``, over ``attempts``), streaming replies
(``stream``, over ``attempts``),
broadcast (``topics``) and two watched buckets, the routing table
(``table``) and the routing configuration (``config``), both followed by
``reach._kv.BucketMirror``."""

from .._inbox import Reply
from .client import Client, ClientStats
from .gather import Gathered
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
