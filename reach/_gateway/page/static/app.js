// The Reach status page: follows v1/status/events (server-sent events) and redraws.
// "snapshot" events carry the whole state (the JSON of v1/status); "agent" events carry
// one agent that appeared, went, or changed status, applied at once. Every string from
// the server goes in through textContent, never as HTML.
"use strict";

(() => {
  const STATUSES = ["UP", "DEGRADED", "PAUSED", "UNKNOWN", "DOWN"];
  const state = { snapshot: null, agents: new Map() };
  const $ = (id) => document.getElementById(id);

  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props || {})) {
      if (value === undefined || value === null) continue;
      if (key === "className") node.className = value;
      else if (key === "text") node.textContent = value;
      else if (key.startsWith("data-") || key === "title" || key === "scope" || key === "colspan") {
        node.setAttribute(key, String(value));
      } else node[key] = value;
    }
    for (const child of children) {
      if (child !== null && child !== undefined) node.append(child);
    }
    return node;
  }

  const rate = (x) => (x === null || x === undefined ? "–" : x >= 100 ? x.toFixed(0) : x.toFixed(1));
  const ms = (x) => (x === null || x === undefined ? "–" : x < 10 ? x.toFixed(2) : x.toFixed(1));
  const clock = (t) => (t ? new Date(t).toLocaleTimeString() : "–");

  function ago(t) {
    if (!t) return "–";
    const s = Math.max(0, Math.round((Date.now() - t) / 1000));
    if (s < 60) return `${s} s ago`;
    if (s < 3600) return `${Math.floor(s / 60)} min ago`;
    if (s < 86400) return `${Math.floor(s / 3600)} h ago`;
    return `${Math.floor(s / 86400)} d ago`;
  }

  function badge(status) {
    return el("span", { className: "badge", "data-status": status, text: status });
  }

  function figures(node, pairs) {
    node.replaceChildren(
      ...pairs.map(([name, value]) => el("div", {}, el("dt", { text: name }), el("dd", { text: String(value) })))
    );
  }

  function fillTable(id, rows, columns, empty) {
    const body = $(id).tBodies[0];
    if (rows.length === 0) {
      body.replaceChildren(el("tr", { className: "empty" }, el("td", { colspan: columns, text: empty })));
      return;
    }
    body.replaceChildren(...rows);
  }

  function renderFleet(s) {
    const fleet = s.fleet;
    $("fleet-counts").replaceChildren(
      el("li", {}, el("span", { className: "badge", text: `${fleet.agents} agents` })),
      ...STATUSES.map((st) =>
        el("li", {}, el("span", { className: "badge", "data-status": fleet.instances[st] ? st : null, text: `${st} ${fleet.instances[st] || 0}` }))
      )
    );
    const t = fleet.traffic;
    figures($("traffic"), [
      ["requests/s", rate(t.requests_per_s)],
      ["errors/s", rate(t.errors_per_s)],
      ["mean ms", ms(t.latency_ms)],
      ["in flight", fleet.inflight],
      ["queued", fleet.queue],
    ]);
  }

  function renderCaps(s) {
    const rows = s.capabilities.map((c) => {
      const tasks = c.tasks ? `${c.tasks.waiting}/${c.tasks.running}/${c.tasks.dead}` : "–";
      const kind = c.kinds.map((k) => (k === "request" ? "req" : k)).join("+") || "–";
      const name = el("td", { className: "mono" }, c.name);
      if (c.no_live) name.append(el("span", { className: "sr-only", text: " (no live instance)" }));
      return el(
        "tr",
        { className: c.no_live ? "flagged" : "", "data-capability": c.name, title: c.no_live ? "no live instance" : null },
        name,
        el("td", { text: kind }),
        ...STATUSES.map((st) => {
          const n = c.instances[st] || 0;
          return el("td", { className: "num count", "data-status": n ? st : null, text: String(n) });
        }),
        el("td", { className: "num", text: rate(c.traffic.requests_per_s) }),
        el("td", { className: "num", text: rate(c.traffic.errors_per_s) }),
        el("td", { className: "num", text: ms(c.traffic.latency_ms) }),
        el("td", { className: "num", text: String(c.inflight) }),
        el("td", { className: "num", text: String(c.queue) }),
        el("td", { className: "num", text: tasks })
      );
    });
    fillTable("caps", rows, 13, "No capability is offered.");
  }

  function renderAgents() {
    const agents = [...state.agents.values()].sort((a, b) => (a.id < b.id ? -1 : a.id > b.id ? 1 : 0));
    const rows = agents.map((a) => {
      const serves = [...a.capabilities, ...a.tasks.map((t) => `${t} (task)`)].join(", ");
      return el(
        "tr",
        { "data-agent": a.id },
        el("td", { className: "mono", text: a.id }),
        el("td", { text: a.name }),
        el("td", {}, badge(a.status)),
        el("td", { text: ago(a.since_ms), title: a.reason ? `${a.reason} at ${new Date(a.since_ms).toISOString()}` : null }),
        el("td", { className: "wrap mono", text: serves }),
        el("td", { className: "num", text: String(a.inflight) }),
        el("td", { className: "num", text: String(a.queue) }),
        el("td", { className: "num", text: a.load.toFixed(2) })
      );
    });
    fillTable("agents", rows, 8, "No agent is registered.");
    const s = state.snapshot;
    const note = $("agents-note");
    const hidden = s ? s.agents_total - s.agents.length : 0;
    note.hidden = hidden <= 0;
    note.textContent = hidden > 0 ? `${hidden} more agents (UP) not listed; the counts above include them.` : "";
  }

  function renderTasks(s) {
    const t = s.tasks;
    if (!t) {
      figures($("tasks"), [["tasks", "not in use"]]);
      $("task-states").replaceChildren();
      return;
    }
    figures($("tasks"), [
      ["queued", t.queued],
      ["for no agent yet", t.unassigned],
      ["dead letters", t.dead],
      ["records read", t.capped ? `${t.scanned} of ${t.keys}` : t.scanned],
    ]);
    const states = Object.entries(t.states).sort();
    $("task-states").replaceChildren(
      ...states.map(([name, n]) => el("li", {}, el("span", { className: "badge", "data-state": name, text: `${name} ${n}` })))
    );
  }

  function renderDlq(s) {
    const dlq = s.dlq;
    $("dlq-size").textContent =
      dlq.size === null ? "No dead-letter queue yet." : `${dlq.size} in the queue${dlq.size ? `; the newest ${dlq.latest.length}:` : "."}`;
    const rows = dlq.latest.map((d) =>
      el(
        "tr",
        { "data-seq": d.seq },
        el("td", { className: "num", text: String(d.seq) }),
        el("td", { text: clock(d.time_ms) }),
        el("td", { className: "mono", text: d.capability }),
        el("td", { className: "mono", text: d.task_id }),
        el("td", { text: d.reason }),
        el("td", { className: "wrap", text: d.error }),
        el("td", { className: "num", text: String(d.attempts) })
      )
    );
    fillTable("dlq", rows, 7, "Nothing dead-lettered.");
  }

  function renderMeta(s) {
    $("prefix").textContent = s.prefix ? `prefix ${s.prefix}` : "";
    const updated = $("updated");
    updated.textContent = clock(s.updated_ms);
    updated.dateTime = new Date(s.updated_ms).toISOString();
    $("interval").textContent = s.interval === null ? "– (first sample)" : `${s.interval.toFixed(1)} s`;
    const problem = $("problem");
    problem.hidden = !s.problem;
    problem.textContent = s.problem || "";
    const notes = [...s.notes];
    if (s.fleet.unmeasured) notes.push(`${s.fleet.unmeasured} live agents did not report counters; their traffic is not in the rates.`);
    if (s.page && s.page.frames_dropped) notes.push(`${s.page.frames_dropped} updates dropped for slow viewers.`);
    $("notes").replaceChildren(...notes.map((n) => el("li", { text: n })));
  }

  function applySnapshot(s) {
    state.snapshot = s;
    state.agents = new Map(s.agents.map((a) => [a.id, a]));
    renderMeta(s);
    renderFleet(s);
    renderCaps(s);
    renderAgents();
    renderTasks(s);
    renderDlq(s);
  }

  function applyAgent(change) {
    if (change.gone) state.agents.delete(change.gone);
    else state.agents.set(change.agent.id, change.agent);
    renderAgents();
  }

  function setConn(kind, text) {
    const conn = $("conn");
    conn.dataset.state = kind;
    conn.textContent = text;
  }

  // The stream is read with fetch, not EventSource: EventSource cannot send the
  // Authorization header a gateway with tokens asks for, and a token in the URL would end
  // up in access logs. The token comes from the form below, or once from the URL's
  // fragment (#token=...), which browsers never send; it is kept for this tab only.
  const TOKEN_KEY = "reach-status-token";
  let retry = 1000;
  let stallMs = 15000;

  function token() {
    const m = location.hash.match(/(?:^#|&)token=([^&]+)/);
    if (m) {
      sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(m[1]));
      history.replaceState(null, "", location.pathname + location.search);
    }
    return sessionStorage.getItem(TOKEN_KEY);
  }

  function askToken(status) {
    sessionStorage.removeItem(TOKEN_KEY);
    setConn("closed", status === 403 ? "This token may not read the status" : "A token is needed");
    const form = $("login");
    form.hidden = false;
    $("token").focus();
  }

  $("login").addEventListener("submit", (e) => {
    e.preventDefault();
    const value = $("token").value.trim();
    if (!value) return;
    sessionStorage.setItem(TOKEN_KEY, value);
    $("token").value = "";
    $("login").hidden = true;
    follow();
  });

  function later(text) {
    setConn("reconnecting", `${text}; retrying in ${Math.round(retry / 1000)} s`);
    setTimeout(follow, retry);
    retry = Math.min(retry * 2, 30000);
  }

  function dispatch(block) {
    let event = "message";
    const data = [];
    for (const line of block.split("\n")) {
      const colon = line.indexOf(":");
      if (colon <= 0) continue; // blank, or a comment (": ping")
      const field = line.slice(0, colon);
      const value = line.slice(colon + 1).replace(/^ /, "");
      if (field === "event") event = value;
      else if (field === "data") data.push(value);
    }
    if (data.length === 0) return;
    const value = JSON.parse(data.join("\n"));
    if (event === "snapshot") {
      stallMs = Math.max(15000, 3000 * (value.interval_s || 5));
      applySnapshot(value);
    } else if (event === "agent") applyAgent(value);
  }

  async function follow() {
    const headers = { Accept: "text/event-stream" };
    const t = token();
    if (t) headers.Authorization = `Bearer ${t}`;
    const abort = new AbortController();
    let response;
    try {
      response = await fetch("v1/status/events", { headers, cache: "no-store", signal: abort.signal });
    } catch {
      return later("Disconnected");
    }
    if (response.status === 401 || response.status === 403) return askToken(response.status);
    if (!response.ok) return later(`Refused (${response.status})`);
    retry = 1000;
    setConn("live", "Live");
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    let stall = setTimeout(() => abort.abort(), stallMs);
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        clearTimeout(stall);
        stall = setTimeout(() => abort.abort(), stallMs); // silent too long: reconnect
        buffer += value.replace(/\r\n?/g, "\n");
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          dispatch(buffer.slice(0, end));
          buffer = buffer.slice(end + 2);
        }
      }
    } catch {
      // aborted (stalled) or the connection broke: reconnect below
    } finally {
      clearTimeout(stall);
    }
    later("Stream ended");
  }

  follow();
})();
