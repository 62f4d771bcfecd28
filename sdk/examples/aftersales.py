"""After-sales agent: refunds, and it listens to every order-status broadcast."""

import msgspec

from reach import Agent, BadRequest


class OrderRef(msgspec.Struct):
    order_id: str


agent = Agent("aftersales")


@agent.capability("aftersales.refund", version="1.0")
async def refund(ref: OrderRef) -> dict:
    if not ref.order_id:
        raise BadRequest("order_id is empty")  # a refusal the caller is meant to read
    return {"order_id": ref.order_id, "refund": "approved"}


@agent.on_topic("order.*")
async def on_status(update: dict, topic: str) -> None:
    print(f"{topic}: {update}", flush=True)


if __name__ == "__main__":
    agent.run()
