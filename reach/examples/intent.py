"""Intent agent: classifies a customer's question and routes it to the right capability.

python -m reach.examples.intent [AGENT_ID]
"""

import sys
from typing import Any

import msgspec

from reach import Agent, Context, ReachSettings


class Question(msgspec.Struct):
    customer: str
    text: str
    order_id: str = ""


ROUTES = {
    "refund": "aftersales.refund",
    "parcel": "logistics.track",
    "track": "logistics.track",
    "arrive": "logistics.track",
    "delivery": "logistics.track",
}


def build(settings: ReachSettings, agent_id: str | None = None) -> Agent:
    """The agent, on settings made by whoever runs it (this file's ``__main__``, the demo)."""
    agent = Agent("intent", agent_id, tags=["frontdesk"], settings=settings)

    @agent.capability("support.ask", version="1.0", description="classify and route a question")
    async def ask(q: Question, ctx: Context) -> dict[str, Any]:
        text = q.text.lower()
        target = next((cap for word, cap in ROUTES.items() if word in text), None)
        if target is None:
            return {"intent": "smalltalk", "answer": "We are open 9-17, Monday to Friday."}
        reply = await ctx.client.call(target, {"order_id": q.order_id}, timeout=ctx.remaining())
        return {"intent": target, "served_by": reply.agent_id, "answer": reply.value}

    return agent


if __name__ == "__main__":
    agent_id = sys.argv[1] if len(sys.argv) > 1 else None
    build(ReachSettings(), agent_id).run()
