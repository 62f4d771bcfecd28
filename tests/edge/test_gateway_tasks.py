"""Durable tasks through the gateway: submit (with Idempotency-Key), read, cancel, and the
Server-Sent Events of a task to its end; real nats-server and agents, app over ASGI."""

from __future__ import annotations

import asyncio

import pytest

from reach import Client, ReachSettings
from reach.testing import eventually

from .gateway_kit import ADMIN, SUBMIT, TOKENS, asgi, error_of, job_agent, parse_sse


@pytest.fixture
def settings(reach_settings: ReachSettings) -> ReachSettings:
    return reach_settings.model_copy(update={"task_ack_wait": 2.0, "task_retry_base": 0.05})


async def test_submit_then_read_the_record_to_its_result(settings):
    async with job_agent(settings), Client(settings=settings) as client, asgi(client) as (http, _):
        r = await http.post(
            "/v1/tasks", json={"capability": "demo.job", "payload": {"n": 1}, "priority": "high"}
        )
        assert r.status_code == 202, r.text
        body = r.json()
        task_id = body["task_id"]
        assert r.headers["location"] == f"/v1/tasks/{task_id}"
        assert body["links"] == {
            "self": f"/v1/tasks/{task_id}",
            "events": f"/v1/tasks/{task_id}/events",
            "cancel": f"/v1/tasks/{task_id}/cancel",
        }

        async def succeeded() -> bool:
            rec = (await http.get(f"/v1/tasks/{task_id}")).json()
            return rec["state"] == "SUCCEEDED"

        await eventually(succeeded, timeout=30)
        rec = (await http.get(f"/v1/tasks/{task_id}")).json()
        assert rec["result"] == {"done": {"n": 1}}
        assert rec["payload"] == {"n": 1}
        assert (rec["priority"], rec["final"], rec["agent_id"]) == ("high", True, "worker-1")


async def test_a_delayed_task_is_scheduled_with_its_due_time(settings):
    """``delay`` holds the task back: the record the gateway shows is SCHEDULED with
    ``due_ms``, and a cancel before then ends it."""
    async with Client(settings=settings) as client, asgi(client) as (http, _):
        r = await http.post("/v1/tasks", json={"capability": "demo.job", "delay": 3600})
        assert r.status_code == 202, r.text
        task_id = r.json()["task_id"]
        rec = (await http.get(f"/v1/tasks/{task_id}")).json()
        assert rec["state"] == "SCHEDULED"
        assert rec["due_ms"] > rec["submitted_ms"] + 3_500_000
        r = await http.post(f"/v1/tasks/{task_id}/cancel")
        assert r.status_code == 200, r.text
        assert (await http.get(f"/v1/tasks/{task_id}")).json()["state"] == "CANCELLED"


async def test_the_same_idempotency_key_gives_the_same_task(settings):
    async with Client(settings=settings) as client, asgi(client) as (http, _):
        job = {"capability": "demo.job", "payload": {"n": 2}}
        first = await http.post("/v1/tasks", json=job, headers={"Idempotency-Key": "order-42"})
        again = await http.post("/v1/tasks", json=job, headers={"Idempotency-Key": "order-42"})
        other = await http.post("/v1/tasks", json=job, headers={"Idempotency-Key": "order-43"})
        plain = await http.post("/v1/tasks", json=job)
        assert first.status_code == again.status_code == 202
        assert first.json()["task_id"] == again.json()["task_id"]
        ids = {r.json()["task_id"] for r in (first, other, plain)}
        assert len(ids) == 3
        rec = (await http.get(f"/v1/tasks/{first.json()['task_id']}")).json()
        assert (rec["idempotency_key"], rec["state"]) == ("open:order-42", "PENDING")


async def test_idempotency_keys_are_per_token(settings):
    """Two callers who pick the same key get their own tasks (and cannot find each
    other's through it)."""
    async with Client(settings=settings) as client, asgi(client, tokens=TOKENS) as (http, _):
        job = {"capability": "demo.job"}
        ids = []
        for token in (SUBMIT, ADMIN, SUBMIT):
            headers = {"Idempotency-Key": "order-42", "Authorization": f"Bearer {token}"}
            r = await http.post("/v1/tasks", json=job, headers=headers)
            assert r.status_code == 202, r.text
            ids.append(r.json()["task_id"])
        assert ids[0] == ids[2] != ids[1]
        r = await http.post(
            "/v1/tasks",
            json=job,
            headers={"Idempotency-Key": "k" * 244, "Authorization": f"Bearer {SUBMIT}"},
        )
        assert r.status_code == 422  # the key, with its caller prefix, must fit 256


async def test_unknown_and_invalid_task_ids(settings):
    async with Client(settings=settings) as client, asgi(client) as (http, _):
        for method, path in (
            ("GET", "/v1/tasks/NoSuchTask123"),
            ("POST", "/v1/tasks/NoSuchTask123/cancel"),
            ("GET", "/v1/tasks/NoSuchTask123/events"),
        ):
            r = await http.request(method, path)
            err = error_of(r)
            assert (r.status_code, err["code"], err["task_id"]) == (
                404,
                "task_not_found",
                "NoSuchTask123",
            ), path
        r = await http.get("/v1/tasks/bad*id")
        assert (r.status_code, error_of(r)["code"]) == (400, "bad_request")


async def test_a_task_record_that_does_not_decode_is_500_corrupt_record(settings):
    """Not an anonymous 500: the code and the task say what is broken (the next agent or
    registry to handle the task replaces the record)."""
    async with Client(settings=settings) as client, asgi(client) as (http, _):
        ref = await client.submit("demo.nobody", {"n": 1})
        bucket = f"{settings.subject_prefix}_tasks"
        await client.nc.jetstream().publish(f"$KV.{bucket}.{ref.task_id}", b"\x00junk")
        r = await http.get(f"/v1/tasks/{ref.task_id}")
        err = error_of(r)
        assert (r.status_code, err["code"], err["task_id"]) == (500, "corrupt_record", ref.task_id)


@pytest.mark.parametrize(
    ("body", "headers", "where"),
    [
        ({"capability": "Demo Job"}, {}, ["body", "capability"]),
        ({"capability": "demo.job", "priority": "urgent"}, {}, ["body", "priority"]),
        ({"capability": "demo.job", "timeout": 0}, {}, ["body", "timeout"]),
        ({"capability": "demo.job", "max_attempts": 0}, {}, ["body", "max_attempts"]),
        ({"capability": "demo.job", "tags": ["a b"]}, {}, ["body", "tags"]),
        ({"capability": "demo.job", "version": "?"}, {}, ["body", "version"]),
        ({"capability": "demo.job", "callback": "x"}, {}, ["body", "callback"]),
        ({"capability": "demo.job", "delay": 1e12}, {}, ["body", "delay"]),
        ({"payload": 1}, {}, ["body", "capability"]),
        ({"capability": "demo.job"}, {"Idempotency-Key": "k" * 300}, ["header", "idempotency-key"]),
    ],
)
async def test_invalid_submits_are_422_naming_the_field(settings, body, headers, where):
    async with Client(settings=settings) as client, asgi(client) as (http, _):
        r = await http.post("/v1/tasks", json=body, headers=headers)
        err = error_of(r)
        assert (r.status_code, err["code"]) == (422, "bad_request"), r.text
        assert err["fields"][0]["loc"] == where


async def test_a_timeout_longer_than_a_record_lives_is_400(settings):
    async with Client(settings=settings) as client, asgi(client) as (http, _):
        r = await http.post("/v1/tasks", json={"capability": "demo.job", "timeout": 10**7})
        assert (r.status_code, error_of(r)["code"]) == (400, "bad_request")


async def test_events_follow_a_task_to_its_end(settings):
    async with job_agent(settings), Client(settings=settings) as client, asgi(client) as (http, _):
        r = await http.post("/v1/tasks", json={"capability": "demo.job", "payload": "x"})
        task_id = r.json()["task_id"]
        r = await http.get(f"/v1/tasks/{task_id}/events")
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = parse_sse(r.text)
    kinds = [kind for kind, _ in events]
    assert kinds[-1] == "end"
    assert events[-1][1] == {"task_id": task_id, "state": "SUCCEEDED"}
    last = events[-2][1]
    assert (last["state"], last["result"]) == ("SUCCEEDED", {"done": "x"})
    assert set(kinds[:-1]) <= {"state", "progress"}
    states = [data["state"] for kind, data in events if kind == "state"]
    assert states == sorted(set(states), key=states.index)  # a state event per change


async def test_cancel_a_running_task_and_see_it_end_cancelled(settings):
    gate, entered = asyncio.Event(), asyncio.Event()
    async with (
        job_agent(settings, gate, entered),
        Client(settings=settings) as client,
        asgi(client) as (http, _),
    ):
        r = await http.post("/v1/tasks", json={"capability": "demo.job", "payload": {"hold": True}})
        task_id = r.json()["task_id"]
        await asyncio.wait_for(entered.wait(), 30)
        r = await http.post(f"/v1/tasks/{task_id}/cancel")
        assert r.status_code == 200, r.text
        rec = r.json()
        assert rec["cancel_requested"] or rec["state"] == "CANCELLED"
        r = await http.get(f"/v1/tasks/{task_id}/events")
        events = parse_sse(r.text)
        assert events[-1] == ("end", {"task_id": task_id, "state": "CANCELLED"})
        rec = (await http.get(f"/v1/tasks/{task_id}")).json()
        assert rec["state"] == "CANCELLED"
        assert [a["outcome"] for a in rec["attempts"]] == ["cancelled"]
        # cancelling again is harmless
        r = await http.post(f"/v1/tasks/{task_id}/cancel")
        assert (r.status_code, r.json()["state"]) == (200, "CANCELLED")
