// The nulltickets dashboard: plain ES module, no build step. Every figure comes from the API
// (same origin, the session cookie when the server has an admin token); pages redraw when
// GET /events/stream reports something.

const main = document.getElementById("main");
const liveBadge = document.getElementById("live");
const path = location.pathname.replace(/\/+$/, "");
const parts = path.split("/").filter(Boolean).slice(1); // after "ui"
const page = parts[0] || "overview";
// What the server said of this session (ui.py): whether it has a token to log out of, and the
// session's access. Only an admin session is offered the buttons that change tasks; the API
// refuses a read or agent session's writes anyway.
const session = document.body.dataset;
const canAct = session.access === "admin";
if (session.login !== "on") document.querySelector("form.logout")?.remove();

for (const a of document.querySelectorAll("header nav a")) {
  if (a.dataset.page === page || (page === "task" && a.dataset.page === "tasks")) a.classList.add("active");
}

// --- helpers -------------------------------------------------------------------------------

function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

const SVG_NS = "http://www.w3.org/2000/svg";
function s(tag, attrs = {}, ...children) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
  for (const c of children.flat()) el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return el;
}

function csrf() {
  const m = document.cookie.match(/(?:^|;\s*)nt_csrf=([^;]+)/);
  return m ? m[1] : "";
}

class Refused extends Error {}

async function api(method, url, body) {
  const init = { method, credentials: "same-origin", headers: {} };
  if (method !== "GET") {
    init.headers["X-CSRF-Token"] = csrf();
    if (body !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
  }
  const r = await fetch(url, init);
  if (r.status === 401) {
    location.href = "/ui/login?next=" + encodeURIComponent(location.pathname + location.search);
    throw new Refused("unauthorized");
  }
  if (r.status === 204) return null;
  const data = await r.json();
  if (!r.ok) throw new Error(data.error ? `${data.error.code}: ${data.error.message}` : r.statusText);
  return data;
}

const get = (url) => api("GET", url);

function ago(ms) {
  if (ms === null || ms === undefined) return "–";
  const s = Math.round(ms / 1000);
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
}
const when = (ms) => (ms ? new Date(ms).toLocaleString() : "–");
const short = (id) => (id ? id.slice(-8) : "");
// A path segment that arrives whole: the server's HTTP layer decodes the path once before it is
// split, so "/" and "%" inside a segment are escaped first ("%2F", "%25"), then encoded.
const segment = (text) => encodeURIComponent(text.replaceAll("%", "%25").replaceAll("/", "%2F"));
const taskLink = (id, text) => h("a", { href: `/ui/task/${encodeURIComponent(id)}` }, text || short(id));

function setMain(...nodes) {
  main.replaceChildren(...nodes.flat().filter((n) => n !== null && n !== undefined));
  main.dataset.ready = String(Date.now());
}

function showError(err) {
  if (err instanceof Refused) return;
  main.prepend(h("p", { class: "error", role: "alert" }, String(err.message || err)));
}

// --- live updates --------------------------------------------------------------------------

let redrawing = false;
let again = false;
async function redraw(draw) {
  if (redrawing) { again = true; return; }
  redrawing = true;
  try { await draw(); } catch (err) { showError(err); }
  redrawing = false;
  if (again) { again = false; redraw(draw); }
}

// The badge says what the page really does: "live" while it follows the server, "reconnecting"
// while the browser tries again, "not live" once it has given up (or on a page that does not
// follow anything).
const BADGE = {
  live: ["● live", "this page updates by itself"],
  reconnecting: ["○ reconnecting", "the connection was lost; trying again"],
  off: ["○ not live", "this page does not update by itself: reload it"],
};
function setLive(state, title) {
  const [text, why] = BADGE[state];
  liveBadge.textContent = text;
  liveBadge.title = title || why;
  liveBadge.dataset.state = state;
  liveBadge.classList.toggle("on", state === "live");
}

function live(query, onEvent) {
  const url = "/events/stream" + (query ? "?" + new URLSearchParams(query) : "");
  const source = new EventSource(url, { withCredentials: true });
  source.onopen = () => setLive("live");
  // A stream the browser will not open again (refused, or not an event stream) is CLOSED.
  source.onerror = () => setLive(source.readyState === EventSource.CLOSED ? "off" : "reconnecting");
  source.onmessage = (m) => onEvent(JSON.parse(m.data));
  // Close the stream when the page goes away: a browser holds few connections per server,
  // and a stream it kept open for a page left behind would hold one of them.
  addEventListener("pagehide", () => source.close());
  return source;
}

// The shared store writes no events: its page reads again every few seconds instead, and
// redraws only when something changed and nobody is typing into its form.
function polled(read, draw, ms = 5000) {
  let last = null;
  const tick = async () => {
    try {
      const data = await read();
      const seen = JSON.stringify(data);
      const typing = main.contains(document.activeElement) && document.activeElement.matches("input, select");
      if (seen !== last && !typing) { draw(data); last = seen; }
      setLive("live", `this page reads the server again every ${ms / 1000} s`);
    } catch (err) {
      if (err instanceof Refused) { setLive("off"); return; }
      if (last === null) showError(err);
      setLive("reconnecting");
    }
    setTimeout(tick, ms);
  };
  return tick();
}

// A redraw on every event would be wasteful under load: at most one per 300 ms.
function throttled(fn, ms = 300) {
  let timer = null;
  return () => {
    if (timer) return;
    timer = setTimeout(() => { timer = null; fn(); }, ms);
  };
}

// --- overview ------------------------------------------------------------------------------

function chart(perMinute) {
  const w = 600, hgt = 120, pad = 20;
  const max = Math.max(1, ...perMinute);
  const bw = (w - pad * 2) / perMinute.length;
  const svg = s("svg", { viewBox: `0 0 ${w} ${hgt}`, width: w, height: hgt, role: "img", "aria-label": "transitions per minute, last hour", id: "throughput" });
  perMinute.forEach((n, i) => {
    const bh = ((hgt - pad * 2) * n) / max;
    const bar = s("rect", { class: "bar", x: pad + i * bw + 1, y: hgt - pad - bh, width: Math.max(1, bw - 2), height: bh });
    bar.append(s("title", {}, `${60 - i} min ago: ${n}`));
    svg.append(bar);
  });
  svg.append(s("line", { x1: pad, x2: w - pad, y1: hgt - pad, y2: hgt - pad, stroke: "#9aa3b5" }));
  svg.append(s("text", { x: pad, y: hgt - 4 }, "60 min ago"), s("text", { x: w - pad - 24, y: hgt - 4 }, "now"));
  svg.append(s("text", { x: pad, y: 12 }, `max ${max}/min`));
  return svg;
}

async function overview() {
  const [stages, queue, health, pipelines, failing] = await Promise.all([
    get("/ops/stages"), get("/ops/queue"), get("/health"), get("/pipelines"), get("/ops/failing?limit=20"),
  ]);
  const names = Object.fromEntries(pipelines.map((p) => [p.id, p.name]));
  const pipelineName = (id) => h("span", { class: "pipeline", title: id }, names[id] ?? short(id));
  const sum = (k) => stages.stages.reduce((a, r) => a + r[k], 0);
  const cards = h("div", { class: "cards" },
    ["claimable", "leased", "waiting_retry", "blocked", "dead_lettered", "cancelled"].map((k) =>
      h("div", { class: "card", id: `total-${k}` }, h("div", { class: "n" }, sum(k)), h("div", { class: "l" }, k.replace("_", " ")))),
    h("div", { class: "card" }, h("div", { class: "n" }, health.active_leases ?? "–"), h("div", { class: "l" }, "live leases")));
  // Stages with a role, then those without one where dead letters landed (role null): every
  // dead-lettered task counts where it is, as /health counts it.
  const rows = stages.stages.map((r) => h("tr", { "data-role": r.role ?? "", "data-stage": r.stage, "data-pipeline": r.pipeline_id },
    h("td", {}, r.role ?? h("span", { class: "muted" }, "no role")), h("td", {}, h("a", { href: `/ui/tasks?pipeline_id=${r.pipeline_id}&stage=${encodeURIComponent(r.stage)}` }, r.stage)),
    h("td", {}, pipelineName(r.pipeline_id)),
    ...["claimable", "leased", "waiting_retry", "blocked"].map((k) => h("td", { class: `num c-${k}` }, r[k])),
    ...["dead_lettered", "cancelled"].map((k) => h("td", { class: `num c-${k}` },
      r[k] ? h("a", { href: `/ui/failures?kind=${k === "cancelled" ? "cancelled" : "dead"}&pipeline_id=${r.pipeline_id}` }, r[k]) : r[k])),
    h("td", { class: "num" }, r.role === null ? "–" : ago(r.oldest_claimable_age_ms))));
  const roles = queue.roles.map((q) => h("tr", {},
    h("td", {}, q.role), h("td", { class: "num" }, q.claimable_count), h("td", { class: "num" }, ago(q.oldest_claimable_age_ms)),
    h("td", { class: "num" }, q.near_expiry_leases), h("td", { class: "num" }, q.stuck_count), h("td", { class: "num" }, q.failed_count)));
  const looping = failing.items.map((f) => h("tr", { "data-task": f.task_id },
    h("td", {}, taskLink(f.task_id, f.title || short(f.task_id))), h("td", {}, pipelineName(f.pipeline_id)), h("td", {}, f.stage),
    h("td", { class: "num failures" }, f.failures), h("td", { class: "error-text" }, f.error || "lease expired"),
    h("td", {}, `${when(f.last_failed_at_ms)} (${ago(failing.generated_at_ms - f.last_failed_at_ms)} ago)`),
    h("td", { class: "eligible" }, f.next_eligible_at_ms > failing.generated_at_ms ? `in ${ago(f.next_eligible_at_ms - failing.generated_at_ms)}` : "now")));
  setMain(
    h("h1", {}, "Overview"),
    cards,
    looping.length
      ? [h("h2", { class: "error" }, `Failing in a loop: ${looping.length}`),
          h("p", { class: "muted" }, `Tasks with ${failing.min_failures} or more failures in a row in the last hour, none completed since.`),
          h("table", { id: "failing" },
            h("thead", {}, h("tr", {}, ["task", "pipeline", "stage"].map((t) => h("th", {}, t)), h("th", { class: "num" }, "failures"),
              ["last error", "last failure", "claimable again"].map((t) => h("th", {}, t)))),
            h("tbody", {}, looping))]
      : h("p", { class: "muted", id: "no-failing" }, "No task is failing in a loop."),
    h("h2", {}, "Queue by role and stage"),
    h("table", { id: "stages" },
      h("thead", {}, h("tr", {}, ["role", "stage", "pipeline"].map((t) => h("th", {}, t)),
        ["claimable", "leased", "waiting retry", "blocked", "dead-lettered", "cancelled", "oldest claimable"].map((t) => h("th", { class: "num" }, t)))),
      h("tbody", {}, rows.length ? rows : h("tr", {}, h("td", { colspan: 10, class: "muted" }, "No stage has a role yet.")))),
    h("h2", {}, "Per role"),
    h("table", { id: "roles" },
      h("thead", {}, h("tr", {}, h("th", {}, "role"), ["claimable", "oldest", "near-expiry leases", "stuck runs", "failed runs"].map((t) => h("th", { class: "num" }, t)))),
      h("tbody", {}, roles)),
    h("h2", {}, "Throughput: transitions per minute, last hour"),
    chart(stages.transitions_per_minute),
  );
}

// --- tasks ---------------------------------------------------------------------------------

function state(t) {
  // A list's tasks carry no cancelled_at_ms: a cancel parks a task under the reason "cancelled".
  if (t.cancelled_at_ms || t.dead_letter_reason === "cancelled") return h("span", { class: "pill dead" }, "cancelled");
  if (t.dead_letter_reason) return h("span", { class: "pill dead" }, "dead-lettered");
  if (t.latest_run && t.latest_run.status === "running") return h("span", { class: "pill leased" }, "leased");
  return null;
}

async function tasks() {
  const q = new URLSearchParams(location.search);
  const params = new URLSearchParams();
  for (const k of ["pipeline_id", "stage", "role", "q", "cursor"]) if (q.get(k)) params.set(k, q.get(k));
  params.set("limit", q.get("limit") || "50");
  const [pageData, pipelines] = await Promise.all([get("/tasks?" + params), get("/pipelines")]);
  const items = pageData.items;
  const names = Object.fromEntries(pipelines.map((p) => [p.id, p.name]));
  const field = (name, label, opts) => opts
    ? h("select", { name }, h("option", { value: "" }, label), opts.map(([v, t]) => h("option", { value: v, selected: q.get(name) === v }, t)))
    : h("input", { name, placeholder: label, value: q.get(name) || "" });
  const next = new URLSearchParams(q);
  if (pageData.next_cursor) next.set("cursor", pageData.next_cursor);
  const first = new URLSearchParams(q);
  first.delete("cursor");
  setMain(
    h("h1", {}, "Tasks"),
    h("form", { class: "filters", method: "get", action: "/ui/tasks" },
      field("pipeline_id", "any pipeline", pipelines.map((p) => [p.id, p.name])),
      field("stage", "stage"), field("role", "role"), field("q", "title or id contains"),
      q.get("limit") ? h("input", { type: "hidden", name: "limit", value: q.get("limit") }) : null,
      h("button", { type: "submit" }, "Filter")),
    h("table", { id: "task-list" },
      h("thead", {}, h("tr", {}, ["task", "title", "pipeline", "stage", "priority", "created"].map((t) => h("th", {}, t)))),
      h("tbody", {}, items.map((t) => h("tr", { "data-task": t.id, "data-stage": t.stage },
        h("td", {}, taskLink(t.id)), h("td", {}, t.title), h("td", {}, names[t.pipeline_id] || short(t.pipeline_id)),
        h("td", { class: "stage" }, t.stage, " ", state(t)), h("td", { class: "num" }, t.priority), h("td", {}, when(t.created_at_ms)))))),
    h("div", { class: "pager" },
      q.get("cursor") ? h("a", { href: "/ui/tasks?" + first }, "« first page") : null,
      pageData.next_cursor ? h("a", { href: "/ui/tasks?" + next, id: "next-page" }, "next page »") : h("span", { class: "muted" }, "last page")),
  );
}

// --- one task ------------------------------------------------------------------------------

function machine(definition, current) {
  // Stages in breadth-first order from the initial one, laid out left to right in layers.
  const depth = { [definition.initial]: 0 };
  const queue = [definition.initial];
  while (queue.length) {
    const from = queue.shift();
    for (const t of definition.transitions) if (t.from === from && !(t.to in depth)) { depth[t.to] = depth[from] + 1; queue.push(t.to); }
  }
  for (const name of Object.keys(definition.states)) if (!(name in depth)) depth[name] = Math.max(0, ...Object.values(depth)) + 1;
  const layers = {};
  for (const [name, d] of Object.entries(depth)) (layers[d] ||= []).push(name);
  const bw = 120, bh = 34, gx = 60, gy = 24;
  const pos = {};
  let height = 0;
  for (const [d, names] of Object.entries(layers)) {
    names.forEach((n, i) => { pos[n] = { x: 10 + d * (bw + gx), y: 10 + i * (bh + gy) }; });
    height = Math.max(height, names.length * (bh + gy));
  }
  const width = 20 + (Object.keys(layers).length) * (bw + gx);
  const svg = s("svg", { viewBox: `0 0 ${width} ${height + 20}`, width: Math.min(width, 1100), id: "machine", role: "img", "aria-label": "the pipeline's state machine" },
    s("defs", {}, s("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 10, refY: 5, markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" },
      s("path", { d: "M 0 0 L 10 5 L 0 10 z", fill: "#9aa3b5" }))));
  for (const t of definition.transitions) {
    const a = pos[t.from], b = pos[t.to];
    if (!a || !b) continue;
    const back = b.x <= a.x;
    const x1 = back ? a.x + bw / 2 : a.x + bw, y1 = back ? a.y + bh : a.y + bh / 2;
    const x2 = back ? b.x + bw / 2 : b.x, y2 = back ? b.y + bh : b.y + bh / 2;
    const mx = (x1 + x2) / 2, my = back ? Math.max(y1, y2) + 22 : (y1 + y2) / 2;
    svg.append(s("path", { class: "edge", d: `M ${x1} ${y1} Q ${mx} ${my} ${x2} ${y2}` }));
    svg.append(s("text", { x: mx - 18, y: back ? my + 10 : my - 4 }, t.trigger));
  }
  for (const [name, p] of Object.entries(pos)) {
    const st = definition.states[name] || {};
    const cls = ["node", name === current ? "current" : "", st.terminal ? "terminal" : ""].join(" ");
    svg.append(s("g", { class: cls, "data-stage": name },
      s("rect", { x: p.x, y: p.y, width: bw, height: bh, rx: 6 }),
      s("text", { x: p.x + 8, y: p.y + 14 }, name),
      s("text", { x: p.x + 8, y: p.y + 27, fill: "#6b7385" }, st.agent_role ? `role ${st.agent_role}` : st.terminal ? "terminal" : "")));
  }
  return svg;
}

function describe(ev) {
  const d = ev.data || {};
  switch (ev.kind) {
    case "transition": return `transitioned ${d.from_stage || d.from || ""} → ${d.to_stage || d.to || ""} (${d.trigger || ""})`;
    case "checkpoint": return "checkpoint written: " + JSON.stringify(d);
    case "released": return "released: " + (d.reason || "");
    case "lease_expired": return "lease expired";
    case "dead_letter": return "dead-lettered: " + (d.reason || JSON.stringify(d));
    case "retry_scheduled": return "failed; retry scheduled " + (d.next_eligible_at_ms ? "for " + when(d.next_eligible_at_ms) : "");
    case "cancelled": return "cancelled: " + (d.reason || "");
    default: return `${ev.kind}: ${JSON.stringify(d)}`;
  }
}

const events = new Map(); // run id -> events, for the task page

function timeline(task, runsPage, firstPage) {
  // One page of the task's runs (GET /tasks/{id}/runs?order=desc), newest first; on the first
  // page, a run the stream reported before the page was read is added on top.
  const runs = [...runsPage.items];
  if (firstPage && task.latest_run && !runs.some((r) => r.id === task.latest_run.id)) runs.unshift(task.latest_run);
  runs.sort((a, b) => (b.attempt || 0) - (a.attempt || 0));
  if (!runs.length) return h("p", { class: "muted" }, "Never claimed yet.");
  return runs.map((run) => h("div", { class: "run", "data-run": run.id, "data-attempt": run.attempt },
    h("h3", {}, `Run ${run.attempt ?? ""} `, h("code", {}, short(run.id)), " ", h("span", { class: "pill" }, run.status || ""),
      " ", h("span", { class: "agent", title: run.agent_role ? `agent (role ${run.agent_role})` : "agent" }, run.agent_id || "?")),
    h("ul", { class: "timeline" },
      run.started_at_ms ? h("li", { class: "k-claimed" }, `${when(run.started_at_ms)} claimed by ${run.agent_id || "?"} (${run.agent_role || ""})`) : null,
      (events.get(run.id) || []).map((ev) => h("li", { class: `k-${ev.kind}`, "data-kind": ev.kind }, `${when(ev.ts_ms)} ${describe(ev)}`)),
      run.ended_at_ms ? h("li", { class: `k-${run.status}` }, `${when(run.ended_at_ms)} ${run.status}${run.error ? ": " + run.error : ""}`) : null)));
}

function verbButtons(task, after, finished = Boolean(task.cancelled_at_ms)) {
  if (!canAct) return null;
  // Cancel only where it can do something: not on a task that is cancelled already or sits
  // in a terminal stage (the caller knows the pipeline), and only once confirmed.
  const act = async (verb) => {
    if (verb === "cancel" && !confirm(`Cancel task ${task.title ? `"${task.title}"` : short(task.id)}? No agent will claim it again until it is requeued.`)) return;
    try {
      await api("POST", `/tasks/${encodeURIComponent(task.id)}/${verb}`, {});
      await after();
    } catch (err) { showError(err); }
  };
  return h("span", { class: "verbs" },
    h("button", { class: "secondary requeue", type: "button", "data-task": task.id, onclick: () => act("requeue") }, "Requeue"),
    finished ? null : " ",
    finished ? null : h("button", { class: "danger cancel", type: "button", "data-task": task.id, onclick: () => act("cancel") }, "Cancel"));
}

function eligibility(task, now) {
  // When a task waiting on a retry delay is offered to agents again.
  if (task.dead_letter_reason || task.cancelled_at_ms || !(task.next_eligible_at_ms > now)) return null;
  return h("p", { id: "eligible", "data-at": task.next_eligible_at_ms },
    `Waiting on a retry delay: claimable again at ${when(task.next_eligible_at_ms)} (in ${ago(task.next_eligible_at_ms - now)}).`);
}

async function taskPage(id) {
  const q = new URLSearchParams(location.search);
  const runsQuery = new URLSearchParams({ order: "desc", limit: q.get("runs_limit") || "50" });
  if (q.get("runs_cursor")) runsQuery.set("cursor", q.get("runs_cursor"));
  const [task, ops, artifacts, runs] = await Promise.all([
    get(`/tasks/${encodeURIComponent(id)}`),
    get(`/tasks/${encodeURIComponent(id)}/events`),
    get(`/artifacts?task_id=${encodeURIComponent(id)}`),
    get(`/tasks/${encodeURIComponent(id)}/runs?${runsQuery}`),
  ]);
  const pipeline = await get(`/pipelines/${encodeURIComponent(task.pipeline_id)}`);
  const finished = Boolean(task.cancelled_at_ms) || (pipeline.definition.states?.[task.stage] || {}).terminal === true;
  const newer = new URLSearchParams(q);
  newer.delete("runs_cursor");
  const older = new URLSearchParams(q);
  if (runs.next_cursor) older.set("runs_cursor", runs.next_cursor);
  const here = `/ui/task/${encodeURIComponent(id)}?`;
  setMain(
    h("h1", {}, task.title, " ", h("span", { class: "pill", id: "task-stage" }, task.stage), " ", state(task)),
    h("p", { class: "muted" }, h("code", {}, task.id), " · pipeline ", h("span", { id: "task-pipeline" }, pipeline.name), ` · priority ${task.priority} · version ${task.task_version} · created ${when(task.created_at_ms)}`),
    eligibility(task, Date.now()),
    h("p", {}, task.description),
    h("p", {}, verbButtons(task, () => redraw(() => taskPage(id)), finished)),
    h("h2", {}, "State machine"),
    machine(pipeline.definition, task.stage),
    h("div", { class: "grid2" },
      h("div", {}, h("h2", {}, "Runs, newest first"),
        timeline(task, runs, !q.get("runs_cursor")),
        h("div", { class: "pager" },
          q.get("runs_cursor") ? h("a", { href: here + newer, id: "newest-runs" }, "« newest runs") : null,
          runs.next_cursor ? h("a", { href: here + older, id: "older-runs" }, "older runs »") : null)),
      h("div", {},
        h("h2", {}, "Checkpoint"), h("pre", { id: "checkpoint" }, JSON.stringify(task.checkpoint, null, 2)),
        task.dead_letter_reason ? h("p", { class: "error" }, "Dead-letter reason: " + task.dead_letter_reason) : null,
        task.cancel_reason ? h("p", { class: "error" }, "Cancelled: " + task.cancel_reason) : null,
        h("h2", {}, "Failures"),
        task.previous_failures.length
          ? h("ul", {}, task.previous_failures.map((f) => h("li", {}, `attempt ${f.attempt} ${f.status}: ${f.error || "–"} (${when(f.ended_at_ms)})`)))
          : h("p", { class: "muted" }, "None."),
        h("h2", {}, "Dependencies"),
        task.dependencies.length
          ? h("ul", {}, task.dependencies.map((d) => h("li", {}, taskLink(d.depends_on_task_id), d.resolved ? " (done)" : " (waiting)")))
          : h("p", { class: "muted" }, "None."),
        h("h2", {}, "Artifacts"),
        artifacts.items.length
          ? h("ul", {}, artifacts.items.map((a) => h("li", {}, `${a.kind}: `, h("code", {}, a.uri))))
          : h("p", { class: "muted" }, "None."),
        h("h2", {}, "Operator events"),
        ops.items.length
          ? h("ul", {}, ops.items.map((e) => h("li", {}, `${when(e.ts_ms)} ${e.kind} ${JSON.stringify(e.data)}`)))
          : h("p", { class: "muted" }, "None."))),
  );
}

// --- failures ------------------------------------------------------------------------------

// Everything here comes from the server: GET /ops/failures (newest failure first, in pages),
// GET /ops/failures/groups (by last error) and GET /ops/retrying; bulk actions go to
// POST /tasks/requeue and /tasks/cancel and are confirmed first.
const KINDS = [
  ["dead,cancelled", "dead-lettered and cancelled"],
  ["dead", "dead-lettered"],
  ["cancelled", "cancelled"],
  ["failing", "failing (retrying)"],
  ["dead,cancelled,failing", "all failures"],
];
const STATE_KIND = { dead_lettered: "dead", cancelled: "cancelled", failing: "failing" };
const STATE_LABEL = { dead_lettered: "dead-lettered", cancelled: "cancelled", failing: "failing" };
const BULK_MAX = 500; // ids per POST /tasks/requeue or /tasks/cancel
const selected = new Set(); // task ids ticked on the Failures page (kept across redraws)
let bulkReport = null; // what the last bulk action did, shown until the next one

function failurePill(f) {
  const cls = f.state === "failing" ? "pill failing" : "pill dead";
  return h("span", { class: cls, "data-state": f.state }, STATE_LABEL[f.state] || f.state, f.leased ? " · leased" : "");
}

function isTerminal(pipelines, pipelineId, stage) {
  const p = pipelines.find((x) => x.id === pipelineId);
  const st = p && p.definition && p.definition.states ? p.definition.states[stage] : null;
  return Boolean(st && st.terminal);
}

async function bulk(verb, ids, after) {
  if (!ids.length) return;
  const what = verb === "requeue" ? "Requeue" : "Cancel";
  if (!confirm(`${what} ${ids.length} task${ids.length === 1 ? "" : "s"}?`)) return;
  const report = { verb, done: 0, refused: [] };
  try {
    for (let i = 0; i < ids.length; i += BULK_MAX) {
      const answer = await api("POST", `/tasks/${verb}`, { ids: ids.slice(i, i + BULK_MAX) });
      report.done += answer.done;
      for (const item of answer.items) if (item.outcome === "refused") report.refused.push(item);
    }
  } catch (err) { showError(err); }
  bulkReport = report;
  selected.clear();
  await after();
}

function rowVerbs(f, cancellable, after) {
  // One task's own buttons, as on its page; Cancel only where a cancel can do something.
  const verbs = verbButtons(f, after);
  if (!cancellable) for (const b of verbs.querySelectorAll("button.cancel")) b.remove();
  return verbs;
}

async function idsOfGroup(group, pipelineId) {
  // Every task of a group, page by page (the listing filtered by the group's kind and error).
  const ids = [];
  let cursor = null;
  do {
    const params = new URLSearchParams({ kind: STATE_KIND[group.state], error: group.error ?? "", limit: "1000" });
    if (pipelineId) params.set("pipeline_id", pipelineId);
    if (cursor) params.set("cursor", cursor);
    const pageData = await get("/ops/failures?" + params);
    ids.push(...pageData.items.map((f) => f.id));
    cursor = pageData.next_cursor;
  } while (cursor);
  return ids;
}

function bulkReportNode() {
  if (!bulkReport) return null;
  const r = bulkReport;
  const did = r.verb === "requeue" ? "Requeued" : "Cancelled";
  return h("div", { id: "bulk-report", class: r.refused.length ? "report error" : "report", role: "status" },
    `${did} ${r.done} task${r.done === 1 ? "" : "s"}.`,
    r.refused.length ? ` Refused ${r.refused.length}: ` : null,
    r.refused.slice(0, 20).map((x) => h("span", { class: "refused", "data-task": x.id }, taskLink(x.id), ` ${x.error.code} `)));
}

async function failures() {
  const q = new URLSearchParams(location.search);
  const kind = q.get("kind") || "dead,cancelled";
  const pipelineId = q.get("pipeline_id") || "";
  const error = q.get("error"); // null: any error; "": those that reported none
  const groupsView = q.get("view") === "groups";
  const refresh = () => redraw(failures);
  const filter = new URLSearchParams({ kind });
  if (pipelineId) filter.set("pipeline_id", pipelineId);
  const [pipelines, retrying, listing] = await Promise.all([
    get("/pipelines"),
    get("/ops/retrying?limit=200"),
    groupsView
      ? get("/ops/failures/groups?" + filter)
      : get("/ops/failures?" + new URLSearchParams([...filter, ...(error !== null ? [["error", error]] : []),
          ["limit", q.get("limit") || "50"], ...(q.get("cursor") ? [["cursor", q.get("cursor")]] : [])])),
  ]);
  const names = Object.fromEntries(pipelines.map((p) => [p.id, p.name]));
  const here = (changes) => {
    const next = new URLSearchParams(q);
    for (const [k, v] of Object.entries(changes)) if (v === null) next.delete(k); else next.set(k, v);
    return "/ui/failures?" + next;
  };
  const form = h("form", { class: "filters", method: "get", action: "/ui/failures", id: "failure-filters" },
    h("select", { name: "kind" }, KINDS.map(([v, t]) => h("option", { value: v, selected: v === kind }, t))),
    h("select", { name: "pipeline_id" }, h("option", { value: "" }, "any pipeline"),
      pipelines.map((p) => h("option", { value: p.id, selected: p.id === pipelineId }, p.name))),
    groupsView ? h("input", { type: "hidden", name: "view", value: "groups" }) : null,
    h("button", { type: "submit" }, "Show"),
    groupsView
      ? h("a", { href: here({ view: null, cursor: null }), id: "list-view" }, "list the tasks")
      : h("a", { href: here({ view: "groups", cursor: null, error: null }), id: "groups-view" }, "group by error"));

  let body;
  if (groupsView) {
    const groups = listing.groups;
    body = groups.length
      ? h("table", { id: "failure-groups" },
          h("thead", {}, h("tr", {}, ["state", "last error", "tasks", "newest", "oldest", ""].map((t) => h("th", {}, t)))),
          h("tbody", {}, groups.map((g) => h("tr", { "data-state": g.state, "data-error": g.error ?? "" },
            h("td", {}, h("span", { class: g.state === "failing" ? "pill failing" : "pill dead" }, STATE_LABEL[g.state] || g.state)),
            h("td", { class: "error-text" }, g.error ?? h("span", { class: "muted" }, "none reported")),
            h("td", { class: "num count" }, g.count),
            h("td", {}, when(g.newest_at_ms)), h("td", {}, when(g.oldest_at_ms)),
            h("td", { class: "verbs" },
              h("a", { href: here({ view: null, kind: STATE_KIND[g.state], error: g.error ?? "", cursor: null }), class: "show-group" }, "show tasks"), " ",
              h("button", { class: "secondary requeue-group", type: "button", onclick: async () => bulk("requeue", await idsOfGroup(g, pipelineId), refresh) }, "Requeue all"), " ",
              g.state === "cancelled" ? null
                : h("button", { class: "danger cancel-group", type: "button", onclick: async () => bulk("cancel", await idsOfGroup(g, pipelineId), refresh) }, "Cancel all"))))))
      : h("p", { class: "muted", id: "no-failures" }, "Nothing of this kind has failed.");
  } else {
    const items = listing.items;
    for (const id of [...selected]) if (!items.some((f) => f.id === id)) selected.delete(id);
    const count = h("span", { id: "selected-count" }, `${selected.size} selected`);
    const tick = (id, on) => { if (on) selected.add(id); else selected.delete(id); count.textContent = `${selected.size} selected`; };
    const boxes = [];
    const rows = items.map((f) => {
      const box = h("input", { type: "checkbox", class: "pick", "data-task": f.id, checked: selected.has(f.id), onchange: (ev) => tick(f.id, ev.target.checked) });
      boxes.push(box);
      const cancellable = f.state !== "cancelled" && !isTerminal(pipelines, f.pipeline_id, f.stage);
      return h("tr", { "data-task": f.id, "data-state": f.state },
        h("td", {}, box), h("td", {}, taskLink(f.id)), h("td", {}, f.title),
        h("td", {}, names[f.pipeline_id] || short(f.pipeline_id)), h("td", {}, f.stage),
        h("td", {}, failurePill(f)),
        h("td", { class: "num failures" }, f.failures),
        h("td", { class: "error-text last-error" }, f.last_error ?? (f.cancel_reason ? "cancelled: " + f.cancel_reason : "–")),
        h("td", { class: "at", "data-at": f.at_ms }, when(f.at_ms)),
        h("td", {}, rowVerbs(f, cancellable, refresh)));
    });
    const all = h("input", { type: "checkbox", id: "select-page", title: "select every task of this page",
      onchange: (ev) => { for (const b of boxes) { b.checked = ev.target.checked; tick(b.dataset.task, b.checked); } } });
    const chosen = () => [...selected];
    body = [
      error !== null ? h("p", { class: "chip" }, "last error: ", h("code", {}, error || "none reported"), " ", h("a", { href: here({ error: null, cursor: null }) }, "× any error")) : null,
      h("div", { class: "bulk", id: "bulk-bar" }, count, " ",
        h("button", { class: "secondary", type: "button", id: "requeue-selected", onclick: () => bulk("requeue", chosen(), refresh) }, "Requeue selected"), " ",
        h("button", { class: "danger", type: "button", id: "cancel-selected", onclick: () => bulk("cancel", chosen(), refresh) }, "Cancel selected")),
      items.length
        ? h("table", { id: "failures" },
            h("thead", {}, h("tr", {}, h("th", {}, all), ["task", "title", "pipeline", "stage", "state"].map((t) => h("th", {}, t)),
              h("th", { class: "num" }, "failures"), ["last error", "last failure", ""].map((t) => h("th", {}, t)))),
            h("tbody", {}, rows))
        : h("p", { class: "muted", id: "no-failures" }, "Nothing of this kind has failed."),
      h("div", { class: "pager" },
        q.get("cursor") ? h("a", { href: here({ cursor: null }), id: "newest-page" }, "« newest") : null,
        listing.next_cursor ? h("a", { href: here({ cursor: listing.next_cursor }), id: "older-page" }, "older »") : h("span", { class: "muted" }, "oldest page")),
    ];
  }
  setMain(
    h("h1", {}, "Failures"),
    form,
    bulkReportNode(),
    body,
    h("h2", {}, `Waiting on a retry delay: ${retrying.items.length}`),
    retrying.items.length
      ? h("table", { id: "retrying" },
          h("thead", {}, h("tr", {}, ["task", "title", "stage", "attempt", "last error", "claimable again", ""].map((t) => h("th", {}, t)))),
          h("tbody", {}, retrying.items.map((r) => h("tr", { "data-task": r.task_id },
            h("td", {}, taskLink(r.task_id)), h("td", {}, r.title), h("td", {}, r.stage),
            h("td", { class: "num" }, r.attempt ?? "–"),
            h("td", { class: "error-text" }, r.error || (r.status === "stale" ? "lease expired" : "–")),
            h("td", { class: "eligible", "data-at": r.next_eligible_at_ms },
              `${when(r.next_eligible_at_ms)} (in ${ago(r.next_eligible_at_ms - retrying.generated_at_ms)})`),
            h("td", {}, verbButtons({ id: r.task_id }, refresh))))))
      : h("p", { class: "muted", id: "no-retrying" }, "No task waits on a retry delay."),
  );
}

// --- shared memory -------------------------------------------------------------------------

function highlighted(snippet) {
  // The API marks matches with [brackets].
  const out = [];
  const re = /\[([^\]]*)\]/g;
  let last = 0, m;
  while ((m = re.exec(snippet))) {
    out.push(snippet.slice(last, m.index), h("mark", {}, m[1]));
    last = m.index + m[0].length;
  }
  out.push(snippet.slice(last));
  return out;
}

function storeQuery() {
  const q = new URLSearchParams(location.search);
  return { q, ns: q.get("namespace") || "", text: q.get("q") || "", after: q.get("after") || "" };
}

async function storeRead() {
  const { ns, text, after } = storeQuery();
  const names = await get("/namespaces?limit=200" + (after ? "&cursor=" + encodeURIComponent(after) : ""));
  let hits = null, entries = null;
  if (text) {
    const params = new URLSearchParams({ q: text, limit: "50" });
    if (ns) params.set("namespace", ns);
    hits = await get("/store/search?" + params);
  }
  if (ns) entries = await get(`/store/${segment(ns)}`);
  return { names, hits, entries };
}

function storeDraw({ names, hits, entries }) {
  const { q, ns, text } = storeQuery();
  const sections = [];
  const more = new URLSearchParams(q);
  if (names.next_cursor) more.set("after", names.next_cursor);
  const nsLink = (name) => h("a", { href: `/ui/store?namespace=${encodeURIComponent(name)}` }, name);
  sections.push(h("h2", {}, "Namespaces"),
    names.items.length
      ? h("table", { id: "namespaces" },
          h("thead", {}, h("tr", {}, h("th", {}, "namespace"), h("th", { class: "num" }, "keys"), h("th", {}, "last change"))),
          h("tbody", {}, names.items.map((n) => h("tr", { "data-namespace": n.namespace, class: n.namespace === ns ? "chosen" : null },
            h("td", {}, nsLink(n.namespace)), h("td", { class: "num" }, n.keys), h("td", {}, when(n.updated_at_ms))))))
      : h("p", { class: "muted", id: "no-namespaces" }, "The store is empty."),
    names.next_cursor ? h("p", { class: "pager" }, h("a", { href: "/ui/store?" + more, id: "more-namespaces" }, "more namespaces »")) : null);
  if (hits) {
    sections.push(h("h2", {}, `Search: ${hits.length} found`),
      h("table", { id: "hits" },
        h("thead", {}, h("tr", {}, ["namespace", "key", "match"].map((t) => h("th", {}, t)))),
        h("tbody", {}, hits.map((hit) => h("tr", {},
          h("td", {}, nsLink(hit.namespace)),
          h("td", {}, h("code", {}, hit.key)), h("td", { class: "snippet" }, highlighted(hit.snippet)))))));
  }
  if (entries) {
    sections.push(h("h2", {}, `Namespace ${ns}: ${entries.length} keys`),
      h("table", { id: "keys" },
        h("thead", {}, h("tr", {}, ["key", "value", "updated"].map((t) => h("th", {}, t)))),
        h("tbody", {}, entries.map((e) => h("tr", {},
          h("td", {}, h("code", {}, e.key)), h("td", {}, h("code", {}, JSON.stringify(e.value).slice(0, 200))), h("td", {}, when(e.updated_at_ms)))))));
  }
  setMain(
    h("h1", {}, "Shared memory"),
    h("form", { class: "filters", method: "get", action: "/ui/store", id: "store-search" },
      h("input", { name: "namespace", placeholder: "namespace", value: ns }),
      h("input", { name: "q", placeholder: "search words", value: text }),
      h("button", { type: "submit" }, "Search / list")),
    ...sections,
    ns ? null : h("p", { class: "muted" }, "Choose a namespace to list its keys, or search every value."),
  );
}

// --- start ---------------------------------------------------------------------------------

async function start() {
  if (page === "overview") {
    await redraw(overview);
    live(null, throttled(() => redraw(overview)));
  } else if (page === "tasks") {
    await redraw(tasks);
    live(null, throttled(() => redraw(tasks)));
  } else if (page === "task" && parts[1]) {
    const id = decodeURIComponent(parts[1]);
    await redraw(() => taskPage(id));
    const refreshTask = throttled(() => redraw(() => taskPage(id)), 150);
    // From the first event on: the history, then whatever happens next.
    live({ task_id: id, last_event_id: 0 }, (ev) => {
      if (!events.has(ev.run_id)) events.set(ev.run_id, []);
      const list = events.get(ev.run_id);
      if (!list.some((e) => e.id === ev.id)) list.push(ev);
      refreshTask();
    });
  } else if (page === "failures") {
    await redraw(failures);
    live({ kind: "dead_letter,retry_scheduled,lease_expired,cancelled" }, throttled(() => redraw(failures)));
  } else if (page === "store") {
    await polled(storeRead, storeDraw).catch(showError);
  } else {
    setLive("off");
  }
}

start();
