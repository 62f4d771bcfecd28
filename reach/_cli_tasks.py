"""The durable-task commands of ``reach``: ``submit``, ``tasks`` (list, show, cancel) and
``dlq`` (list, show, replay). They use the public ``Client`` API only; errors end the
command through ``cli.main`` (``error: <code>: <message>``, exit 1)."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import msgspec

from ._cli_common import (
    PAYLOAD_HELP,
    format_duration,
    json_or_text,
    parse_duration,
    print_value,
    read_payload,
    table,
)
from ._client import Client
from ._tasks import DeadLetter, TaskRecord, unserved
from .errors import ReachError
from .settings import ReachSettings
from .wire import Priority
from .wire.tasks import TaskState

__all__ = ["add_task_commands"]

_NAME = "reach-cli"


def _stamp(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms / 1000)) if ms else "-"


def _seconds(ms: int) -> str:
    return f"{ms / 1000:.3f}s"


def _record_json(rec: TaskRecord) -> dict[str, Any]:
    """A record as JSON, payload and result decoded when they are JSON."""
    out: dict[str, Any] = msgspec.to_builtins(rec)
    out["payload"] = json_or_text(rec.payload)
    out["result"] = json_or_text(rec.result)
    return out


def _task_payload(dl: DeadLetter) -> Any:
    """The task payload of a dead letter that is a task (None for anything else)."""
    try:
        return json_or_text(dl.submit().payload)
    except ReachError:
        return None


def _letter_json(dl: DeadLetter) -> dict[str, Any]:
    return {
        "seq": dl.seq,
        "task_id": dl.task_id,
        "capability": dl.capability,
        "topic": dl.topic,
        "group": dl.group,
        "kind": dl.kind,
        "reason": dl.reason,
        "error": dl.error,
        "attempts": msgspec.to_builtins(dl.attempts),
        "time": dl.time.isoformat() if dl.time else None,
        "headers": dl.headers,
        "data": json_or_text(dl.data),
        "payload": _task_payload(dl),
    }


def _dump(value: Any) -> None:
    print(json.dumps(value, indent=2, ensure_ascii=False))


def _local(t: datetime.datetime | None) -> str:
    return t.astimezone().strftime("%Y-%m-%d %H:%M:%S") if t else "-"


# -- submit --------------------------------------------------------------------------------


async def _submit(args: argparse.Namespace, settings: ReachSettings) -> int:
    payload = read_payload(args.payload)
    async with Client(settings=settings, name=_NAME) as client:
        ref = await client.submit(
            args.capability,
            payload,
            priority=args.priority,
            timeout=args.timeout,
            max_attempts=args.max_attempts,
            idempotency_key=args.idempotency_key,
            require_agent=args.require_agent,
            delay=args.delay,
        )
        why = None if args.require_agent else unserved(await client.agents(), args.capability)
        if why is not None:  # accepted all the same: a worker may start later
            print(f"warning: {why}; the task waits until one does, however long", file=sys.stderr)
        if not args.wait:
            print(ref.task_id)
            return 0
        print(f"# task {ref.task_id}", file=sys.stderr, flush=True)
        await ref.result(timeout=args.wait_timeout)  # the task's error raised, if it failed
        rec = await ref.status()
    print_value(rec.result or b"")
    return 0


# -- tasks ---------------------------------------------------------------------------------


async def _tasks(args: argparse.Namespace, settings: ReachSettings) -> int:
    target: list[str] = args.target
    if target == ["init"]:
        return await _init(settings, args.json)
    if len(target) > 2 or (len(target) == 2 and target[0] != "cancel") or target == ["cancel"]:
        usage = "use 'reach tasks [ID]' or 'reach tasks cancel ID'"
        print(f"error: bad_request: {usage}", file=sys.stderr)
        return 2
    async with Client(settings=settings, name=_NAME) as client:
        if len(target) == 2:
            return await _cancel(client, target[1], args.json)
        if target:
            rec = await client.task_record(target[0])
            if args.json:
                _dump(_record_json(rec))
            else:
                _show_record(rec)
            return 0
        records = await client.list_tasks(
            state=args.state.upper() if args.state else None,
            capability=args.capability,
            limit=args.limit,
        )
    if args.json:
        _dump([_record_json(r) for r in records])
    elif not records:
        print("no tasks", file=sys.stderr)
    else:
        _list_records(records)
    return 0


async def _init(settings: ReachSettings, as_json: bool) -> int:
    """Make the task streams and buckets now (at deploy time, as a user allowed to): agents
    and clients then find them and need no right to create streams."""
    async with Client(settings=settings, name=_NAME) as client:
        store = await client._tasks.ready(client.nc)
        await store.ensure_schedules()  # delayed and periodic tasks, retry later
    if as_json:
        streams = [store.stream, store.dlq_stream, store.events_stream]
        buckets = [store.bucket, store.idem_bucket]
        _dump({"streams": streams, "buckets": buckets, "replicas": settings.stream_replicas})
        return 0
    print(
        f"task streams {store.stream}, {store.dlq_stream}, {store.events_stream} and buckets"
        f" {store.bucket}, {store.idem_bucket} ready ({settings.stream_replicas} replica(s))"
    )
    return 0


async def _cancel(client: Client, task_id: str, as_json: bool) -> int:
    ref = await client.task(task_id)
    rec = await ref.cancel()
    if as_json:
        _dump({"task_id": rec.task_id, "state": str(rec.state), "cancel_requested": True})
    elif rec.state is TaskState.CANCELLED:
        print(f"task {task_id}: CANCELLED")
    elif rec.final:
        print(f"task {task_id} already ended {rec.state}: nothing to cancel")
    else:
        print(f"task {task_id}: cancel requested; its agent stops it ({rec.state} now)")
    return 0


def _list_records(records: list[TaskRecord]) -> None:
    rows = [
        [
            r.task_id,
            r.capability,
            str(r.state),
            str(r.priority),
            f"{r.attempt}/{r.max_attempts or '-'}",
            r.agent_id or "-",
            _stamp(r.updated_ms),
            _due(r),
            (f"{r.error.code}: {r.error.message}" if r.error else "")[:60],
        ]
        for r in records
    ]
    header = ["TASK", "CAPABILITY", "STATE", "PRIO", "ATTEMPT", "AGENT", "UPDATED", "DUE", "ERROR"]
    print(table(rows, header))


def _due(r: TaskRecord) -> str:
    """When a task waiting for a time is due (a delayed one, or a retry later)."""
    waiting = r.state in (TaskState.SCHEDULED, TaskState.RETRYING)
    return _stamp(r.due_ms) if r.due_ms and waiting else "-"


def _show_record(r: TaskRecord) -> None:
    lines = [
        ("task", r.task_id),
        ("capability", r.capability + (f" (version {r.version})" if r.version else "")),
        ("state", f"{r.state} (attempt {r.attempt} of {r.max_attempts or 'agent default'})"),
        ("priority", str(r.priority)),
        ("agent", r.agent_id or "-"),
        ("submitted", f"{_stamp(r.submitted_ms)} by {r.caller or '?'}"),
        ("updated", _stamp(r.updated_ms)),
        ("duration", _seconds(r.duration_ms)),
    ]
    if r.progress and not r.final:
        lines.append(("progress", f"{r.progress:.0%} {r.progress_note}".rstrip()))
    if r.due_ms:
        lines.append(("due", _stamp(r.due_ms)))
    if r.schedule:
        lines.append(("schedule", r.schedule))
    if r.replay_of:
        lines.append(("replay of", r.replay_of))
    if r.idempotency_key:
        lines.append(("idempotency key", r.idempotency_key))
    if r.callback:
        lines.append(("callback", f"{r.callback} ({r.callback_state or 'not yet'})"))
    if r.cancel_requested and not r.final:
        lines.append(("cancel", "requested"))
    if r.error:
        lines.append(("error", f"{r.error.code}: {r.error.message}"))
    if r.state is TaskState.SUCCEEDED:
        lines.append(("result", json.dumps(json_or_text(r.result), ensure_ascii=False)))
    width = max(len(k) for k, _ in lines)
    for key, value in lines:
        print(f"{key:<{width}}  {value}")
    print("history:")
    start = r.history[0].at_ms if r.history else r.submitted_ms
    for step in r.history:
        note = f"  {step.note}" if step.note else ""
        offset = "+" + _seconds(step.at_ms - start)
        print(f"  {offset:>11}  {step.state}{note}")
    print("attempts:" if r.attempts else "attempts: none")
    for a in r.attempts:
        took = _seconds(a.ended_ms - a.started_ms) if a.ended_ms else "running"
        error = f"  {a.error}" if a.error else ""
        print(f"  #{a.n}  {a.agent_id}  {a.outcome}  {took}  from {_stamp(a.started_ms)}{error}")


# -- dlq -----------------------------------------------------------------------------------


def _dlq_seq(text: str) -> int:
    """A dead letter's sequence number (argparse type): given anything else, a task id
    say, the error says what is wanted and where to find it."""
    try:
        seq = int(text)
    except ValueError:
        seq = 0
    if seq > 0:
        return seq
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a dead letter's SEQ (a positive number; a task id is not one):"
        " 'reach dlq list' shows each dead letter's SEQ beside its TASK"
    )


async def _dlq_list(args: argparse.Namespace, settings: ReachSettings) -> int:
    async with Client(settings=settings, name=_NAME) as client:
        letters = await client.dead_letters(args.capability, limit=args.limit, topic=args.topic)
    if args.json:
        _dump([_letter_json(d) for d in letters])
        return 0
    if not letters:
        print("no dead letters", file=sys.stderr)
        return 0
    rows = [
        [
            str(d.seq),
            d.task_id or "-",
            d.capability or f"{d.topic} ({d.group})",
            d.kind,
            d.reason,
            str(len(d.attempts)),
            _local(d.time),
            d.error[:60],
        ]
        for d in letters
    ]
    header = ["SEQ", "TASK", "CAPABILITY/TOPIC", "KIND", "REASON", "ATTEMPTS", "TIME", "ERROR"]
    print(table(rows, header))
    return 0


async def _dlq_show(args: argparse.Namespace, settings: ReachSettings) -> int:
    async with Client(settings=settings, name=_NAME) as client:
        dl = await client.dead_letter(args.seq)
    if args.json:
        _dump(_letter_json(dl))
        return 0
    for key, text in (
        ("seq", str(dl.seq)),
        ("task", dl.task_id or "-"),
        ("capability", dl.capability or "-"),
        *([("topic", dl.topic), ("agent", dl.group or "-")] if dl.kind == "topic" else []),
        ("kind", dl.kind),
        ("reason", dl.reason),
        ("error", dl.error or "-"),
        ("time", _local(dl.time)),
    ):
        print(f"{key:<10}  {text}")
    print("attempts:" if dl.attempts else "attempts: none recorded")
    for a in dl.attempts:
        print(f"  #{a.n}  {a.agent_id}  {a.outcome}  {_seconds(a.ended_ms - a.started_ms)}")
    print("headers:")
    for k, v in sorted(dl.headers.items()):
        print(f"  {k}: {v}")
    try:
        value, what = json_or_text(dl.submit().payload), "payload (of the task)"
    except ReachError:
        value, what = json_or_text(dl.data), "data"
    print(f"{what}:")
    print(json.dumps(value, indent=2, ensure_ascii=False))
    return 0


async def _dlq_replay(args: argparse.Namespace, settings: ReachSettings) -> int:
    if (args.seq is None) == (args.capability is None):
        print("error: bad_request: give a SEQ or --capability C (one of them)", file=sys.stderr)
        return 2
    async with Client(settings=settings, name=_NAME) as client:
        if args.seq is not None and (dl := await client.dead_letter(args.seq)).kind == "topic":
            seq = await client.replay_topic(args.seq)
            to = f"agent {dl.group}'s subscription" if dl.group else "every subscriber"
            print(
                f"# dead letter {args.seq} (topic {dl.topic}) delivered again to {to}"
                f" as message {seq}",
                file=sys.stderr,
            )
            print(seq)
            return 0
        if args.seq is not None:
            ref = await client.replay(args.seq)
            print(f"# dead letter {args.seq} replayed as task {ref.task_id}", file=sys.stderr)
            print(ref.task_id)
            return 0
        refs = await client.replay_capability(args.capability)
        for ref in refs:
            print(ref.task_id)
        left = await client.dead_letters(args.capability, limit=1000)
    print(f"# {len(refs)} dead letter(s) of {args.capability} replayed", file=sys.stderr)
    for dl in left:
        print(
            f"# dead letter {dl.seq} ({dl.kind}, {dl.reason}) cannot be replayed; it stays",
            file=sys.stderr,
        )
    return 1 if left else 0


async def _dlq_purge(args: argparse.Namespace, settings: ReachSettings) -> int:
    """Count first; remove only with ``--yes N``, N the count shown (so what goes is what
    was seen: a count that changed meanwhile removes nothing, and a letter stored after
    the purge's own count stays, as the purge stops below it). The count alone is what
    was asked for, not a failure: exit 0, whatever it is."""
    what = f"of {args.capability}" if args.capability else "(tasks, callbacks and topics)"
    age = f" older than {format_duration(args.older_than)}" if args.older_than is not None else ""
    async with Client(settings=settings, name=_NAME) as client:
        if args.yes is None:
            n = await client.count_dead_letters(args.capability, args.older_than)
            if n == 0:
                print(f"no dead letters {what}{age}")
            else:
                print(f"{n} dead letters {what}{age}; to remove them: add --yes {n}")
            return 0
        gone = await client.purge_dead_letters(args.capability, args.older_than, expect=args.yes)
    print(f"{gone} dead letters {what}{age} removed")
    return 0


# -- the parser ----------------------------------------------------------------------------


def add_task_commands(
    sub: Any, with_url: Callable[[argparse.ArgumentParser], argparse.ArgumentParser]
) -> None:
    """Add ``submit``, ``tasks`` and ``dlq`` to the ``reach`` parser's subcommands."""
    p = with_url(sub.add_parser("submit", help="submit a durable task; print its id"))
    p.add_argument("capability")
    p.add_argument("payload", nargs="?", default="null", help=PAYLOAD_HELP)
    p.add_argument(
        "--priority", default="normal", type=str.lower, choices=[x.value for x in Priority]
    )
    p.add_argument("--timeout", type=float, default=None, help="seconds per attempt")
    p.add_argument("--max-attempts", type=int, default=None)
    p.add_argument("--idempotency-key", default=None)
    p.add_argument(
        "--delay",
        type=parse_duration,
        default=None,
        metavar="DURATION",
        help="hold the task back this long (SCHEDULED), e.g. 90s, 10m, 2h",
    )
    p.add_argument("--wait", action="store_true", help="wait for the end; print the result")
    p.add_argument(
        "--wait-timeout",
        type=float,
        default=60.0,
        help="seconds --wait waits for the result (default 60); the task itself goes on",
    )
    p.add_argument(
        "--require-agent",
        action="store_true",
        help="refuse (capability_not_found) unless a live agent serves the task capability;"
        " without it a task nobody serves is queued, with a warning",
    )
    p.set_defaults(run=_submit, is_async=True)

    p = with_url(
        sub.add_parser(
            "tasks",
            help="list tasks; 'tasks ID' shows one; 'tasks cancel ID'; 'tasks init' makes"
            " the task streams (deploy time)",
        )
    )
    p.add_argument("target", nargs="*", metavar="ID | cancel ID | init")
    p.add_argument(  # any case: --state running, --state RUNNING
        "--state", default=None, type=str.lower, choices=[s.lower() for s in TaskState]
    )
    p.add_argument("--capability", default=None)
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_tasks, is_async=True)

    p = sub.add_parser("dlq", help="dead letters: list, show, replay, purge")
    dlq = p.add_subparsers(dest="dlq_command", required=True)
    p = with_url(dlq.add_parser("list", help="dead letters, newest first"))
    p.add_argument("--capability", default=None)
    p.add_argument("--topic", default=None, help="those of durable topic T (wildcards allowed)")
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_dlq_list, is_async=True)
    p = with_url(dlq.add_parser("show", help="one dead letter: why, attempts, headers, data"))
    p.add_argument("seq", type=_dlq_seq, metavar="SEQ", help="its SEQ in 'reach dlq list'")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_dlq_show, is_async=True)
    p = with_url(
        dlq.add_parser(
            "replay",
            help="run dead letters again as new tasks; a topic message goes again to the"
            " agent name that gave up on it",
        )
    )
    p.add_argument(
        "seq", type=_dlq_seq, nargs="?", default=None, metavar="SEQ", help="from 'reach dlq list'"
    )
    p.add_argument("--capability", default=None, help="replay every dead letter of C")
    p.set_defaults(run=_dlq_replay, is_async=True)
    p = with_url(
        dlq.add_parser(
            "purge", help="remove dead letters for good: counts them, removes with --yes N"
        )
    )
    p.add_argument("--capability", default=None, help="only those of capability C")
    p.add_argument(
        "--older-than",
        type=parse_duration,
        default=None,
        metavar="DURATION",
        help="only those stored longer ago than this (7d, 12h)",
    )
    p.add_argument(
        "--yes",
        type=int,
        default=None,
        metavar="N",
        help="remove them; N is the count shown without --yes (nothing goes if it changed)",
    )
    p.set_defaults(run=_dlq_purge, is_async=True)
