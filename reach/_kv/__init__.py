"""JetStream KV: the one compare-and-set writer (``cas``: writes with a TTL, ``Conflict``,
the server's error codes by name), binding buckets (``buckets``) and the one bucket mirror
(``mirror``) that the routing table, the registry and the config watch all follow."""

from .buckets import agents_bucket, bind_bucket, check_replicas, routes_bucket
from .cas import (
    CONFLICT_CODES,
    KV_OP,
    MARKER_REASON,
    MARKER_TTL,
    TTL,
    Conflict,
    GetLast,
    JsErrorCode,
    Latest,
    Publish,
    conflicts,
    delete,
    latest,
    ttl_header,
    write,
)
from .mirror import BucketMirror, KvEntry, MirrorSink

__all__ = [
    "CONFLICT_CODES",
    "KV_OP",
    "MARKER_REASON",
    "MARKER_TTL",
    "TTL",
    "BucketMirror",
    "Conflict",
    "GetLast",
    "JsErrorCode",
    "KvEntry",
    "Latest",
    "MirrorSink",
    "Publish",
    "agents_bucket",
    "bind_bucket",
    "check_replicas",
    "conflicts",
    "delete",
    "latest",
    "routes_bucket",
    "ttl_header",
    "write",
]
