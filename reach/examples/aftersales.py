"""After-sales agent: refunds, and it listens to every order-status broadcast.

python -m reach.examples.aftersales [AGENT_ID]
"""

import sys
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from reach import Agent, BadRequest, ReachSettings


class OrderRef(msgspec.Struct):
    order_id: str


async def print_status(update: dict[str, Any], topic: str) -> None:
    print(f"{topic}: {update}", flush=True)


def build(
    settings: ReachSettings,
    agent_id: str | None = None,
    on_status: Callable[[dict[str, Any], str], Awaitable[None]] = print_status,
) -> Agent:
    """The agent, on settings made by whoever runs it; ``on_status`` hears ``order.*``."""
    agent = Agent("aftersales", agent_id, settings=settings)

    @agent.capability("aftersales.refund", version="1.0")
    async def refund(ref: OrderRef) -> dict[str, Any]:
        if not ref.order_id:
            raise BadRequest("order_id is empty")  # a refusal the caller is meant to read
        return {"order_id": ref.order_id, "refund": "approved"}

    @agent.on_topic("order.*")
    async def on_order_status(update: dict[str, Any], topic: str) -> None:
        await on_status(update, topic)

    return agent


if __name__ == "__main__":
    agent_id = sys.argv[1] if len(sys.argv) > 1 else None
    build(ReachSettings(), agent_id).run()
