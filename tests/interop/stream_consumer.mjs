// A plain nats.js caller that consumes a Reach stream from PROTOCOL.md section 3.3 alone
// (no Reach code): the request with Reach-Stream-Window, the opened frame (Reach-Chunk: 0)
// whose reply-to is the stream's subject, chunks numbered from 1, credit and keepalives to
// the stream's subject, the end in Reach-End.
//
//   node stream_consumer.mjs NATS_URL CAPABILITY [PAYLOAD_JSON] [WINDOW] [SUBJECT_PREFIX]
//
// Prints each chunk's body as one JSON line on stdout, in order, and exits 0 after an end
// frame that counts them all. Anything else (an error reply or frame, a chunk out of
// order, a lost frame, no frame for 10 s) is a line on stderr and exit status 1.
import { connect, createInbox, headers } from "@nats-io/transport-node";

const [url, capability, payload = "null", windowArg = "4", prefix = "reach"] =
  process.argv.slice(2);
if (!url || !capability) {
  console.error("usage: stream_consumer.mjs NATS_URL CAPABILITY [PAYLOAD] [WINDOW] [PREFIX]");
  process.exit(2);
}
const window = Number.parseInt(windowArg, 10);
const FRAME_WAIT_MS = 10_000; // our own bound on each frame (the agent knows nothing of it)
const KEEPALIVE_MS = 200; // well within the agent's patience (5 s by default)

const nc = await connect({ servers: url, name: "nats.js stream consumer" });
let status = 1;
let keepalive;
let streamSubject = null; // the stream's subject, from the first frame
let ended = false;
try {
  const inbox = createInbox();
  const sub = nc.subscribe(inbox);
  await nc.flush(); // the subscription is in place before the request goes out
  const h = headers();
  h.set("Reach-Stream-Window", String(window));
  nc.publish(`${prefix}.cap.${capability}`, new TextEncoder().encode(payload), {
    reply: inbox,
    headers: h,
  });

  const frames = sub[Symbol.asyncIterator]();
  const next = async () => {
    let timer;
    const late = new Promise((_, reject) => {
      timer = setTimeout(() => reject(new Error(`no frame for ${FRAME_WAIT_MS} ms`)), FRAME_WAIT_MS);
    });
    try {
      const { value, done } = await Promise.race([frames.next(), late]);
      if (done) throw new Error("subscription closed");
      return value;
    } finally {
      clearTimeout(timer);
    }
  };

  let lastSent = Date.now();
  const send = (body) => {
    nc.publish(streamSubject, new TextEncoder().encode(JSON.stringify(body)));
    lastSent = Date.now();
  };
  const fail = (msg, why) => {
    const code = msg.headers?.get("Nats-Service-Error-Code");
    const text = msg.headers?.get("Nats-Service-Error");
    throw new Error(code ? `${why}: error ${code}: ${text} ${msg.string()}` : why);
  };

  let received = 0; // chunks read
  let owed = 0; // chunks read and not yet granted back
  const grantEvery = Math.max(1, Math.floor(window / 2)); // half a window at a time
  for (;;) {
    const msg = await next();
    const chunk = msg.headers?.get("Reach-Chunk") ?? "";
    const end = msg.headers?.get("Reach-End") ?? "";
    if (chunk === "" && end === "") {
      // not a stream at all: a refusal before the opened frame, or a whole answer
      if (msg.headers?.has("Nats-Service-Error-Code")) fail(msg, "refused");
      process.stdout.write(`${msg.string()}\n`);
      status = 0;
      break;
    }
    if (streamSubject === null) {
      streamSubject = msg.reply; // the first frame names the stream's subject
      keepalive = setInterval(() => {
        if (Date.now() - lastSent >= KEEPALIVE_MS) send({ type: "reach.stream.credit", credit: 0 });
      }, KEEPALIVE_MS);
    } else if (msg.reply !== streamSubject) {
      throw new Error(`frame from another stream: ${msg.reply}`);
    }
    if (end !== "") {
      ended = true;
      if (msg.headers.has("Nats-Service-Error-Code")) fail(msg, `stream ended after ${end} chunk(s)`);
      if (Number(end) !== received) throw new Error(`end says ${end} chunks, ${received} received`);
      console.error(`end: ${end} chunk(s)`);
      status = 0;
      break;
    }
    if (chunk === "0" && received === 0 && msg.data.length === 0) continue; // the opened frame
    if (Number(chunk) !== received + 1) throw new Error(`chunk ${chunk} after ${received}`);
    received += 1;
    process.stdout.write(`${JSON.stringify(JSON.parse(msg.string()))}\n`);
    owed += 1;
    if (owed >= grantEvery) {
      send({ type: "reach.stream.credit", credit: owed });
      owed = 0;
    }
  }
  await sub.unsubscribe();
} catch (err) {
  console.error(`error: ${err.message}`);
  status = 1;
  if (streamSubject !== null && !ended) {
    // we stop reading early: the agent cancels the handler at once
    nc.publish(streamSubject, new TextEncoder().encode(JSON.stringify({ type: "reach.stream.cancel" })));
  }
} finally {
  clearInterval(keepalive);
  await nc.close();
}
process.exit(status);
