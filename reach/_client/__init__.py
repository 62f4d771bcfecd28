"""The client: a facade (``client``) over the request path (``attempts`` -> ``inbox``),
broadcast (``topics``) and two watched buckets, the routing table (``table``) and the
routing configuration (``config``), both followed by ``reach._kv.BucketMirror``."""

from .client import Client, ClientStats
from .inbox import Reply
from .topics import TopicMessage, TopicSubscription

__all__ = ["Client", "ClientStats", "Reply", "TopicMessage", "TopicSubscription"]
