"""A plain HTTP service that knows nothing of Reach, for ``reach wrap`` to put in the fleet.

FastAPI on 127.0.0.1:9000 (PORT to change it) with a question endpoint, a search and a
health check; wrap.toml beside it makes it one agent without a line of change here.

python -m reach.examples.http_service          (needs the edge extra: agent-reach-nats[edge])
"""

import os
from typing import Any

from fastapi import FastAPI, Header
from pydantic import BaseModel

app = FastAPI(title="helpdesk (plain HTTP)")

FAQ = {
    "opening hours": "We answer every day from 8:00 to 20:00.",
    "returns": "Returns are free within 30 days.",
}


class Question(BaseModel):
    text: str


@app.post("/ask")
async def ask(q: Question, reach_request_id: str | None = Header(default=None)) -> dict[str, Any]:
    """Answer a question; the wrapper's Reach-Request-Id header shows up in the answer."""
    hits = [answer for topic, answer in FAQ.items() if topic in q.text.lower()]
    answer = hits[0] if hits else "A human will get back to you."
    return {"answer": answer, "request_id": reach_request_id}


@app.get("/search")
async def search(q: str = "") -> dict[str, Any]:
    return {"hits": sorted(topic for topic in FAQ if q.lower() in topic)}


@app.get("/healthz")
async def healthz() -> dict[str, Any]:
    return {"ok": True}


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=int(os.environ.get("PORT", "9000")))
