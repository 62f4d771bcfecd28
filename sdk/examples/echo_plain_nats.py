"""The v1 protocol from a plain NATS client (no reach import): serve, call, broadcast.

python sdk/examples/echo_plain_nats.py nats://127.0.0.1:4222
"""

import asyncio
import json
import sys
import time

import nats


async def main(url: str) -> None:
    nc = await nats.connect(url)

    async def serve(msg):
        # Serve capability "demo.echo": queue group cap.demo.echo, JSON in, JSON out.
        try:
            value = json.loads(msg.data)
        except ValueError:
            body = {
                "type": "reach.error",
                "code": "bad_request",
                "message": "payload is not JSON",
                "retryable": False,
            }
            await nc.publish(
                msg.reply,
                json.dumps(body).encode(),
                headers={
                    "Nats-Service-Error-Code": "400",
                    "Nats-Service-Error": body["message"],
                    "Reach-Agent": "plain-echo-1",
                },
            )
            return
        await nc.publish(
            msg.reply, json.dumps(value).encode(), headers={"Reach-Agent": "plain-echo-1"}
        )

    await nc.subscribe("reach.cap.demo.echo", queue="cap.demo.echo", cb=serve)
    await nc.subscribe("reach.agent.plain-echo-1.demo.echo", cb=serve)

    deadline = str(int(time.time() * 1000) + 2000)
    reply = await nc.request(
        "reach.cap.demo.echo",
        b'{"hello": "world"}',
        timeout=2,
        headers={"Reach-Deadline": deadline},
    )
    print("answer:", reply.data.decode(), "from", reply.headers.get("Reach-Agent"))
    await nc.publish("reach.topic.order.status", b'{"order_id": "A-1", "status": "shipped"}')
    await nc.drain()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "nats://127.0.0.1:4222"))
