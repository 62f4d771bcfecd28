"""What an agent serves, declared before it starts: capabilities, topics, durable tasks."""

from __future__ import annotations

from collections.abc import Callable

from .._subjects import validate_capability, validate_topic
from .._tasks import TaskDecl, TaskRunner
from .._tasks.states import check_timeout
from ..errors import ConfigurationError
from ..wire import CapabilityInfo
from .handlers import Handler, inspect_handler
from .lifecycle import Lifecycle
from .model import AgentCells, Served, TopicSpec

__all__ = ["Declarations"]


class Declarations:
    """The decorators of ``Agent``; each refuses once the agent runs."""

    _caps: dict[str, Served]
    _topics: list[TopicSpec]
    _life: Lifecycle
    _tasks: TaskRunner
    _cells_for_new_capability: Callable[[], AgentCells | None]

    def _check_open(self, name: str, what: str) -> None:
        validate_capability(name)
        if self._life.running:
            raise ConfigurationError(f"add {what} before the agent starts")
        if name in self._caps or name in self._tasks.decls:
            raise ConfigurationError(f"{name!r} is already served by this agent")

    def capability(
        self, name: str, *, version: str = "1.0.0", description: str = ""
    ) -> Callable[[Handler], Handler]:
        """Serve ``name`` with the decorated async function ``(payload[, ctx]) -> result``."""
        self._check_open(name, "capabilities")

        def register(fn: Handler) -> Handler:
            self._check_open(name, "capabilities")
            spec = inspect_handler(fn, f"capability {name!r}")
            info = CapabilityInfo(name=name, version=version, description=description)
            self._caps[name] = Served(info, spec, cells=self._cells_for_new_capability())
            return fn

        return register

    def task(
        self,
        name: str,
        *,
        version: str = "1.0.0",
        description: str = "",
        timeout: float | None = None,
        max_attempts: int | None = None,
    ) -> Callable[[Handler], Handler]:
        """Serve ``name`` as a durable task: submitted with ``client.submit``, kept in
        JetStream until an instance runs it to the end. The handler is the same as for a
        capability; its ``ctx`` is a ``TaskContext`` (``task_id``, ``attempt``,
        ``progress()``). ``timeout`` (seconds per attempt) and ``max_attempts`` apply to
        submits that name none (then ``REACH_TASK_TIMEOUT``/``REACH_TASK_MAX_ATTEMPTS``);
        a timeout longer than ``REACH_TASK_RETENTION`` is refused."""
        self._check_open(name, "tasks")
        if timeout is not None and not timeout > 0:
            raise ConfigurationError("timeout must be > 0 seconds")
        if timeout is not None:
            check_timeout(timeout, self._tasks.settings.task_retention, f"task {name!r}")
        if max_attempts is not None and not 1 <= max_attempts <= 100:
            raise ConfigurationError("max_attempts must be between 1 and 100")

        def register(fn: Handler) -> Handler:
            self._check_open(name, "tasks")
            spec = inspect_handler(fn, f"task {name!r}")
            info = CapabilityInfo(name=name, version=version, description=description)
            self._tasks.decls[name] = TaskDecl(info, spec, timeout, max_attempts)
            return fn

        return register

    def on_topic(self, topic: str) -> Callable[[Handler], Handler]:
        """Receive every broadcast on ``topic`` (wildcards allowed), on every instance."""
        validate_topic(topic, wildcards=True)
        if self._life.running:
            raise ConfigurationError("add topic handlers before the agent starts")

        def register(fn: Handler) -> Handler:
            self._topics.append(TopicSpec(topic, inspect_handler(fn, f"topic {topic!r}")))
            return fn

        return register
