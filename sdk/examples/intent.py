"""Intent agent: classifies a customer's question and routes it to the right capability."""

import msgspec

from reach import Agent, Context


class Question(msgspec.Struct):
    customer: str
    text: str
    order_id: str = ""


agent = Agent("intent", tags=["frontdesk"])

ROUTES = {
    "refund": "aftersales.refund",
    "parcel": "logistics.track",
    "track": "logistics.track",
    "arrive": "logistics.track",
}


@agent.capability("support.ask", version="1.0")
async def ask(q: Question, ctx: Context) -> dict:
    target = next((cap for word, cap in ROUTES.items() if word in q.text.lower()), None)
    if target is None:
        return {"intent": "smalltalk", "answer": "We are open 9-17."}
    reply = await ctx.client.call(target, {"order_id": q.order_id}, timeout=ctx.remaining())
    return {"intent": target, "served_by": reply.agent_id, "answer": reply.value}


if __name__ == "__main__":
    agent.run()
