"""Logistics agent: tracks orders and broadcasts status changes. Run several instances."""

import asyncio

import msgspec

from reach import Agent, Context


class OrderRef(msgspec.Struct):
    order_id: str


agent = Agent("logistics", tags=["eu"], max_concurrency=4)


@agent.capability("logistics.track", version="1.0", description="where is an order")
async def track(ref: OrderRef, ctx: Context) -> dict:
    await asyncio.sleep(0.02)  # stands in for a carrier API call
    await ctx.client.publish("order.status", {"order_id": ref.order_id, "status": "in transit"})
    return {"order_id": ref.order_id, "eta_days": 2, "agent": agent.agent_id}


if __name__ == "__main__":
    agent.run()
