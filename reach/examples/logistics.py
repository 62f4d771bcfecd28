"""Logistics agent: tracks orders and broadcasts status changes. Run several instances.

python -m reach.examples.logistics [AGENT_ID]
"""

import asyncio
import sys
from typing import Any

import msgspec

from reach import Agent, Context, ReachSettings, TaskContext


class OrderRef(msgspec.Struct):
    order_id: str


def build(settings: ReachSettings, agent_id: str | None = None, max_concurrency: int = 4) -> Agent:
    """The agent, on settings made by whoever runs it (this file's ``__main__``, the demo)."""
    agent = Agent(
        "logistics", agent_id, tags=["eu"], max_concurrency=max_concurrency, settings=settings
    )

    @agent.capability("logistics.track", version="1.0", description="where is an order")
    async def track(ref: OrderRef, ctx: Context) -> dict[str, Any]:
        await asyncio.sleep(0.02)  # stands in for a carrier API call
        await ctx.client.publish("order.status", {"order_id": ref.order_id, "status": "in transit"})
        return {"order_id": ref.order_id, "eta_days": 2, "agent": agent.agent_id}

    @agent.task("logistics.reroute", version="1.0", timeout=30, description="book a new carrier")
    async def reroute(ref: OrderRef, ctx: TaskContext) -> dict[str, Any]:
        # A durable task: it survives this instance dying. Booking with the carrier is
        # keyed on the task id, so a second attempt cannot book twice.
        for step in range(4):
            await asyncio.sleep(0.25)  # stands in for the carrier's booking API
            await ctx.progress((step + 1) / 4, f"step {step + 1} of 4")
        return {"order_id": ref.order_id, "booking": f"BK-{ctx.task_id[-6:]}", "by": ctx.agent_id}

    return agent


if __name__ == "__main__":
    agent_id = sys.argv[1] if len(sys.argv) > 1 else None
    build(ReachSettings(), agent_id).run()
