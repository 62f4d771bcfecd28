"""The registry's request/reply API: ``register``, ``deregister``, ``list`` and ``route``.

An agent registers on ``<prefix>.registry.register.<agent_id>`` and deregisters on
``<prefix>.registry.deregister.<agent_id>``: with the id in the subject, a server's
permissions can let each agent's user send only its own (services/nats/nats-server.conf),
and a body that names another agent than its subject is refused (``bad_request``, counted
in ``mismatched_requests``, logged at most once a minute per subject id). The old subjects
without an id are still answered, so agents from before can register while a fleet is
upgraded (registries first); they are counted in ``legacy_requests``, and the secured
config lets no agent send them.

Each request is answered, always: with its reply, with ``bad_request`` naming the field
when the body does not decode or does not check out (counted), or with ``failed``. Only
the decoding and checking step (``parse``) and the size checks below can make a
``bad_request``: any other error raised while serving is ours, and answered ``failed``
(or ``agent_unavailable`` when the server is away).

Everything must fit in one NATS message (``max_payload``, headers included: the server
closes the connection of a client that sends more, and with it the registry's view). A
``list`` answer: callers that page (``limit``/``after``) get as many records as fit and
``next_after``; a caller that asked for everything gets ``bad_request`` saying to page or
filter, rather than nothing. A registration: it may take max_payload less ``RECORD_ROOM``
(the heartbeat, transitions and headers its record adds), else ``bad_request`` "record
too large"; a record that does not fit anyway is not sent, and answered the same.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec
from nats.aio.msg import Msg

from .._codec import encode_json, error_reply, now_ms
from .._nats import TRANSIENT
from .._routing import explain_miss, rank
from .._subjects import validate_agent_id, validate_capability
from ..errors import PayloadTooLarge
from ..wire import (
    RECORD_ROOM,
    AgentRecord,
    Candidate,
    Deregistration,
    ErrorCode,
    ListQuery,
    ListReply,
    RegisterReply,
    Registration,
    RouteQuery,
    RouteReply,
    Status,
    Transition,
)
from .checks import check_registration
from .state import Core
from .writer import ALIVE, MAX_TRANSITIONS, WRITE_FAILED, RecordWriter

__all__ = ["Api"]

log = logging.getLogger("reach.registry")

_registration = msgspec.json.Decoder(Registration)
_deregistration = msgspec.json.Decoder(Deregistration)
_list_query = msgspec.json.Decoder(ListQuery)
_route_query = msgspec.json.Decoder(RouteQuery)

Handler = Callable[[Msg], Awaitable[None]]
Q = TypeVar("Q")

#: Room left in a reply for everything but the records (envelope, headers, cursor).
_REPLY_OVERHEAD = 1024
MAX_PAGE = 10_000


class TooLarge(Exception):
    """An answer that cannot fit in one NATS message; the text says what to ask instead."""


class Mismatch(ValueError):
    """A register or deregister body naming another agent than its subject does."""


class Api:
    """Handlers for the ``<prefix>.registry.`` subjects, one per subject (``handlers``)."""

    def __init__(self, core: Core, writer: RecordWriter) -> None:
        self.core = core
        self.writer = writer

    def handlers(self) -> dict[str, Handler]:
        """Each subject the registry answers (in queue group ``registry``), with its handler."""
        s = self.core.subjects
        register = self._guard(_parse_registration, self._on_register)
        deregister = self._guard(_parse_deregistration, self._on_deregister)
        return {
            s.register("*"): self._guard(_parse_registration, self._on_register, bound=_reg_id),
            s.deregister("*"): self._guard(_parse_deregistration, self._on_deregister, bound=str),
            s.registry("register"): self._legacy(register),
            s.registry("deregister"): self._legacy(deregister),
            s.registry("list"): self._guard(_parse_list, self._on_list),
            s.registry("route"): self._guard(_parse_route, self._on_route),
        }

    def _legacy(self, handle: Handler) -> Handler:
        """An old subject without the agent id: served as before, and counted."""
        stats = self.core.stats

        async def counted(msg: Msg) -> None:
            if msg.reply:
                stats.legacy_requests += 1
            await handle(msg)

        return counted

    def _guard(
        self,
        parse: Callable[[bytes], Q],
        serve: Callable[[Q], Awaitable[bytes]],
        bound: Callable[[Q], str] | None = None,
    ) -> Handler:
        """Answer every request; a body that does not decode or check is ``bad_request``,
        and so is one naming (``bound``) another agent than the subject's last token."""
        core = self.core

        async def handle(msg: Msg) -> None:
            if not msg.reply:
                return
            headers: dict[str, str] | None = None
            try:
                query = parse(msg.data)
                if bound is not None:
                    _check_bound(msg.subject, bound(query))
            except (msgspec.DecodeError, ValueError) as exc:
                core.stats.bad_requests += 1
                if isinstance(exc, Mismatch):
                    self._refused(msg.subject, exc)
                body, headers = error_reply(ErrorCode.BAD_REQUEST, f"invalid request: {exc}")
            else:
                body, headers = await self._serve(msg, serve, query)
            try:
                await core.conn().publish(msg.reply, body, headers=headers)
            except TRANSIENT as exc:
                log.warning("registry %s: reply lost: %s", core.registry_id, exc)

        return handle

    def _refused(self, subject: str, exc: Mismatch) -> None:
        core = self.core
        core.stats.mismatched_requests += 1
        if core.warned.allow(subject.rpartition(".")[2][:128]):
            log.warning("registry %s: refused: %s", core.registry_id, exc)

    async def _serve(
        self, msg: Msg, serve: Callable[[Q], Awaitable[bytes]], query: Q
    ) -> tuple[bytes, dict[str, str] | None]:
        core = self.core
        try:
            return await serve(query), None
        except TooLarge as exc:
            core.stats.bad_requests += 1
            return error_reply(ErrorCode.BAD_REQUEST, str(exc))
        except PayloadTooLarge as exc:  # a record no message can carry: not sent
            core.stats.bad_requests += 1
            text = f"record too large ({exc.size} bytes > limit {exc.limit})"
            return error_reply(ErrorCode.BAD_REQUEST, text)
        except WRITE_FAILED as exc:
            core.stats.write_errors += 1
            log.warning("registry %s: %s not served: %s", core.registry_id, msg.subject, exc)
            return error_reply(ErrorCode.AGENT_UNAVAILABLE, "registry unavailable")
        except Exception:
            log.exception("registry %s: request on %s failed", core.registry_id, msg.subject)
            return error_reply(ErrorCode.FAILED, "registry failed")

    async def _on_register(self, reg: Registration) -> bytes:
        core = self.core
        agent_id = reg.info.agent_id
        size, limit = len(encode_json(reg)), core.conn().max_payload - RECORD_ROOM
        if size > limit:
            raise TooLarge(
                f"record too large ({size} bytes > limit {limit}): a registration may take "
                f"the server's max_payload ({limit + RECORD_ROOM}) less {RECORD_ROOM} bytes "
                "for the rest of its record; register without schemas, or with fewer or "
                "shorter descriptions, tags or metadata"
            )
        status = reg.status if reg.status in ALIVE else Status.UP
        now = now_ms()
        core.stats.registrations += 1
        events: list[Transition] = []

        def change(before: AgentRecord | None) -> tuple[AgentRecord, float]:
            events.clear()
            t = Transition(
                old=before.status if before else None, new=status, reason="registered", at_ms=now
            )
            events.append(t)
            history = before.transitions[-(MAX_TRANSITIONS - 1) :] if before else []
            # The same process registering again keeps its last heartbeat; a new one
            # (restarted, so its seq starts over) must not be compared with the old one's.
            same = before is not None and before.info.started_ms == reg.info.started_ms
            record = AgentRecord(
                info=reg.info,
                status=status,
                heartbeat=before.heartbeat if same and before else None,
                registered_ms=now,
                last_seen_ms=now,
                transitions=[*history, t],
                registry=core.registry_id,
            )
            return record, core.lease_ttl

        await self.writer.update(agent_id, change)
        core.throttle.forget(agent_id)
        for t in events:
            await self.writer.announce(agent_id, t, removed=False)
        reply = RegisterReply(
            lease_ttl=core.lease_ttl,
            heartbeat_interval=core.settings.heartbeat_interval,
            registry=core.registry_id,
        )
        return encode_json(reply)

    async def _on_deregister(self, agent_id: str) -> bytes:
        core = self.core
        core.stats.deregistrations += 1
        entry = core.entries.get(agent_id)
        previous = entry.record if entry is not None else None
        # Nothing stored: write nothing, or every made-up id would leave a marker behind.
        if previous is not None or await self.writer.exists(agent_id):
            await self.writer.remove(agent_id, last=None)
        if previous is not None:
            t = Transition(
                old=previous.status, new=Status.DOWN, reason="deregistered", at_ms=now_ms()
            )
            await self.writer.announce(agent_id, t, removed=True)
        return b"{}"

    async def _on_list(self, query: ListQuery) -> bytes:
        self.core.cells.queries["list"] += 1
        agents = [
            r
            for r in self.core.entries.records().values()
            if (
                query.capability is None
                or any(c.name == query.capability for c in r.info.capabilities)
            )
            and (query.tag is None or query.tag in r.info.tags)
            and (query.status is None or r.status == query.status)
            and (query.after is None or r.info.agent_id > query.after)
        ]
        agents.sort(key=lambda r: r.info.agent_id)
        paging = query.limit is not None or query.after is not None
        wanted = agents[: query.limit] if query.limit is not None else agents
        budget = self.core.conn().max_payload - _REPLY_OVERHEAD
        page: list[AgentRecord] = []
        for r in wanted:
            budget -= len(encode_json(r)) + 1
            if budget < 0:
                break
            page.append(r)
        if len(page) < len(wanted) and (not paging or not page):
            raise TooLarge(
                f"limit: {len(wanted)} agents do not fit in one message (max_payload "
                f"{self.core.conn().max_payload} bytes); page with limit and after, or "
                f"filter by capability, tag or status"
            )
        more = len(page) < len(agents)
        next_after = page[-1].info.agent_id if more and page else None
        return encode_json(ListReply(agents=page, next_after=next_after))

    async def _on_route(self, query: RouteQuery) -> bytes:
        self.core.cells.queries["route"] += 1
        records = list(self.core.entries.records().values())
        ranked = rank(records, query.capability, query.version, query.tags, query.priority)
        subjects = self.core.subjects
        candidates = [
            Candidate(
                agent_id=r.info.agent_id,
                subject=subjects.agent(r.info.agent_id, query.capability),
                status=r.status,
                score=round(s, 4),
                reason=why,
            )
            for r, s, why in ranked[:5]
        ]
        reason = (
            ""
            if candidates
            else explain_miss(records, query.capability, query.version, query.tags, query.priority)
        )
        return encode_json(RouteReply(candidates=candidates, reason=reason))


# -- decoding and checking: the only place a request can be refused as bad_request ------


def _parse_registration(data: bytes) -> Registration:
    reg = _registration.decode(data)
    check_registration(reg)
    return reg


def _parse_deregistration(data: bytes) -> str:
    return validate_agent_id(_deregistration.decode(data).agent_id)


def _reg_id(reg: Registration) -> str:
    return reg.info.agent_id


def _check_bound(subject: str, agent_id: str) -> None:
    """The body (already checked) must name the agent its subject ends with."""
    token = subject.rpartition(".")[2]
    if token != agent_id:
        raise Mismatch(
            f"agent_id {agent_id!r} is not {token!r}, the agent subject {subject!r} is "
            f"for; an agent registers and deregisters only itself"
        )


def _parse_list(data: bytes) -> ListQuery:
    query = _list_query.decode(data or b"{}")
    if query.limit is not None and not 1 <= query.limit <= MAX_PAGE:
        raise ValueError(f"limit {query.limit} is not in 1..{MAX_PAGE}")
    return query


def _parse_route(data: bytes) -> RouteQuery:
    query = _route_query.decode(data)
    validate_capability(query.capability)  # it becomes part of the subjects we answer
    return query
