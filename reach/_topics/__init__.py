"""Durable topics on JetStream: stream ``REACH_TOPICS``, one consumer group per agent name.

``store`` names and makes the stream and the consumers; ``publisher`` is the client side
(publishes the server acknowledges, ``since`` history, replaying a dead letter);
``runner`` the agent side (pull, handle, ack, backoff, dead letters, lag). It reuses the
task machinery below it (``_tasks.pull``, ``bounded``, ``opening``, ``dlq``,
``faults``, ``states.retry_delay``) and the JetStream API requester (``reach._jsapi``)
rather than a second copy, and, like ``_tasks``, knows neither the client nor the agent.
"""

from .publisher import REPLAY_OF, DurableTopics, Since
from .runner import TopicCells, TopicDecl, TopicRunner
from .store import TopicStore, stream_name, topic_consumer_name

__all__ = [
    "REPLAY_OF",
    "DurableTopics",
    "Since",
    "TopicCells",
    "TopicDecl",
    "TopicRunner",
    "TopicStore",
    "stream_name",
    "topic_consumer_name",
]
