"""JetStream KV: lease writes (compare-and-set with a TTL) and the one bucket mirror that
the routing table, the registry and the config watch all follow."""

from .leases import (
    KV_OP,
    MARKER_REASON,
    MARKER_TTL,
    Latest,
    LeaseConflict,
    agents_bucket,
    bind_bucket,
    check_replicas,
    latest,
    remove,
    ttl_header,
    write_lease,
)
from .mirror import BucketMirror, KvEntry, MirrorSink

__all__ = [
    "KV_OP",
    "MARKER_REASON",
    "MARKER_TTL",
    "BucketMirror",
    "KvEntry",
    "Latest",
    "LeaseConflict",
    "MirrorSink",
    "agents_bucket",
    "bind_bucket",
    "check_replicas",
    "latest",
    "remove",
    "ttl_header",
    "write_lease",
]
