// The console's page: plain ES module, no framework. Every text that came from a user, a tool or
// the model is put into the page with textContent (el() below), never parsed as HTML.

let me = null;
let live = null; // the EventSource of the session shown, if any
let refresh = null; // the sessions list's live refresh timer

const $ = (id) => document.getElementById(id);

// replaceChildren, leaving out the parts a view did not have (null, false, undefined).
const show = (node, ...children) => node.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined && c !== false));

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (k === "href") node.setAttribute("href", String(v).startsWith("#") ? v : "#");
    else node.setAttribute(k, v);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

async function api(path, options = {}) {
  const headers = { ...(options.headers || {}) };
  if (options.method && options.method !== "GET" && me) headers["X-CSRF-Token"] = me.csrf;
  if (options.body) headers["Content-Type"] = "application/json";
  const response = await fetch(path, { credentials: "same-origin", ...options, headers });
  const body = await response.json().catch(() => ({}));
  if (response.status === 401) { showSignin(); throw new Error(body.error ? body.error.message : "sign in"); }
  if (!response.ok) throw new Error(body.error ? body.error.message : `HTTP ${response.status}`);
  return body;
}

const when = (t) => (t ? new Date(t * 1000).toISOString().replace("T", " ").slice(0, 19) : "");
const short = (id) => (id && id.length > 14 ? id.slice(0, 14) + "…" : id || "");
const q = (params) => new URLSearchParams(Object.entries(params).filter(([, v]) => v !== "" && v != null)).toString();

function flags(list, onClick) {
  if (!list || !list.length) return el("span", { class: "flag ok", text: "healthy" });
  return list.map((f) => el("span", { class: "flag", "data-flag": f, title: (me && me.flags[f]) || f, text: f,
    onclick: onClick ? () => onClick(f) : undefined }));
}

function stop() {
  if (live) { live.close(); live = null; }
  if (refresh) { clearInterval(refresh); refresh = null; }
}

function showSignin() {
  stop();
  me = null;
  $("nav").hidden = true;
  $("signin").hidden = false;
  show($("view"));
}

async function start() {
  try {
    me = await api("/api/me");
  } catch { return; }
  $("signin").hidden = true;
  $("nav").hidden = false;
  $("who").textContent = me.admin ? "admin: every tenant" : `tenant ${me.tenant}`;
  route();
}

$("signin").addEventListener("submit", async (event) => {
  event.preventDefault();
  $("signin-error").textContent = "";
  try {
    await api("/api/login", { method: "POST", body: JSON.stringify({ key: $("key").value }) });
    $("key").value = "";
    await start();
  } catch (error) { $("signin-error").textContent = error.message; }
});

$("signout").addEventListener("click", async () => {
  await api("/api/logout", { method: "POST" }).catch(() => {});
  showSignin();
});

window.addEventListener("hashchange", () => me && route());

function route() {
  stop();
  const [path, query] = location.hash.slice(1).split("?");
  const params = new URLSearchParams(query || "");
  const parts = (path || "/sessions").split("/").filter(Boolean).map(decodeURIComponent);
  const view = $("view");
  const render = { sessions: () => sessionsView(view, params), session: () => sessionView(view, parts[1], params),
    trajectory: () => trajectoryView(view, parts[1], params), compare: () => compareView(view, parts[1], parts[2]),
    loop: () => loopView(view) }[parts[0]] || (() => sessionsView(view, params));
  render().catch((error) => show(view, el("p", { class: "error", role: "alert", text: error.message })));
}

// -- sessions --------------------------------------------------------------------------------------

async function sessionsView(view, params) {
  const facets = await api("/api/facets");
  const field = (name, options) => {
    const select = el("select", { name }, el("option", { value: "", text: "any" }),
      options.map((o) => el("option", { value: o, text: o })));
    select.value = params.get(name) || "";
    return el("label", {}, name, select);
  };
  const text = el("input", { name: "q", placeholder: "session id contains", value: params.get("q") || "" });
  const since = el("input", { name: "since", type: "datetime-local" });
  if (params.get("since")) since.value = new Date(Number(params.get("since")) * 1000).toISOString().slice(0, 16);
  const form = el("form", { class: "filters", id: "filters" },
    field("agent", facets.agent), field("model", facets.model), field("adapter", facets.adapter),
    field("status", ["open", "closed"]), field("flag", Object.keys(me.flags)),
    el("label", {}, "active since", since), el("label", {}, "search", text),
    me.admin ? el("label", {}, "tenant", el("input", { name: "tenant", placeholder: "tenant id", value: params.get("tenant") || "" })) : null,
    el("button", { type: "submit", text: "Filter" }));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const data = Object.fromEntries(new FormData(form));
    data.since = data.since ? String(Date.parse(data.since + "Z") / 1000) : "";
    location.hash = "#/sessions?" + q(data);
  });
  const counter = el("p", { class: "dim", id: "count" });
  const body = el("tbody", { id: "sessions" });
  const more = el("button", { type: "button", text: "Load more", hidden: true });
  const table = el("table", {}, el("thead", {}, el("tr", {}, ["session", me.admin ? "tenant" : null, "agent",
    "model", "turns", "status", "health", "last activity"].filter(Boolean).map((h) => el("th", { text: h })))), body);
  show(view, el("h1", { text: "Sessions" }), form, counter, table, more);
  const filter = Object.fromEntries(params);
  let next = null;
  const load = async (append) => {
    const page = await api("/api/sessions?" + q({ ...filter, ...(append && next ? next : {}) }));
    next = page.next;
    more.hidden = !next;
    counter.textContent = `${page.count} sessions${page.caught_up ? "" : " (still reading the streams…)"}` +
      ` · page in ${page.query_ms} ms`;
    const rows = page.sessions.map((s) => el("tr", { "data-session": s.session_id },
      el("td", {}, el("a", { class: "mono", href: `#/session/${encodeURIComponent(s.session_id)}?tenant=${encodeURIComponent(s.tenant)}`, text: s.session_id })),
      me.admin ? el("td", { class: "mono", text: short(s.tenant) }) : null,
      el("td", { text: s.agent || "" }), el("td", { text: s.model || "" }),
      el("td", {}, String(s.turns), s.live ? el("span", { class: "badge live", text: `${s.live} live` }) : null),
      el("td", { text: s.closed ? `closed (${s.closed})` : "open" }),
      el("td", {}, flags(s.health, (f) => { location.hash = "#/sessions?" + q({ ...filter, flag: f }); })),
      el("td", { class: "dim", text: when(s.last_at) })));
    if (append) body.append(...rows); else body.replaceChildren(...rows);
  };
  more.addEventListener("click", () => load(true));
  await load(false);
  refresh = setInterval(() => { if (!next || body.children.length <= 50) load(false).catch(() => {}); }, 3000);
}

// -- a session -------------------------------------------------------------------------------------

function cause(turn, parent, siblings) {
  if (turn.continues_turn_id) return `new root: the agent compacted its history; continues ${short(turn.continues_turn_id)}`;
  if (turn.fallback_reason) return `new root: ${turn.fallback_reason}`;
  if (turn.predecessor_turn_id) return "new root, continuing a recorded turn";
  if (!turn.parent_turn_id && parent === undefined && turn.index > 0)
    return "new root: the history matched no recorded turn (edited, or another agent)";
  if (siblings > 1) return "fork: another continuation of the same turn (a retry, or n > 1)";
  return null;
}

// A person's rating (a number and a note) of a turn or of the whole session, sent as feedback through
// the gateway (stream_stack/console/_ratings.py); a trajectory already emitted gets a revision.
function rating(sessionId, turnId, label) {
  const score = el("input", { type: "number", step: "any", class: "score", "aria-label": "score", placeholder: "score" });
  const note = el("input", { type: "text", class: "note", "aria-label": "note", placeholder: "note (optional)" });
  const said = el("span", { class: "dim", role: "status" });
  const form = el("form", { class: "rating", "data-rate": turnId || "session" }, el("span", { class: "dim", text: label }),
    score, note, el("button", { type: "submit", text: "Rate" }), said);
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    said.textContent = "";
    const value = Number(score.value);
    if (score.value === "" || !Number.isFinite(value)) { said.textContent = "a score is a number"; return; }
    try {
      await api(`/api/sessions/${encodeURIComponent(sessionId)}/feedback`, { method: "POST",
        body: JSON.stringify({ score: value, note: note.value || null, turn_id: turnId }) });
      said.textContent = `rated ${value}`;
      said.dataset.rated = String(value);
    } catch (error) { said.textContent = error.message; }
  });
  return form;
}

async function sessionView(view, sessionId, params) {
  const tenant = params.get("tenant") || "";
  const s = await api(`/api/sessions/${encodeURIComponent(sessionId)}?` + q({ tenant }));
  const turns = s.turns_page;
  turns.forEach((t, i) => { t.index = i; });
  const byId = new Map(turns.map((t) => [t.turn_id, t]));
  const children = new Map();
  for (const t of turns) {
    const key = t.parent_turn_id && byId.has(t.parent_turn_id) ? t.parent_turn_id : null;
    if (!children.has(key)) children.set(key, []);
    children.get(key).push(t);
  }
  const node = (t, siblings) => {
    const why = cause(t, t.parent_turn_id ? byId.get(t.parent_turn_id) : undefined, siblings);
    const kids = children.get(t.turn_id) || [];
    return el("li", {}, el("div", { class: "node", "data-turn": t.turn_id },
      el("span", { class: "mono", text: short(t.turn_id) }), " ",
      el("span", { class: t.state === "live" ? "badge live" : "badge", text: t.state === "completed" ? t.end_reason : t.state === "aborted" ? `aborted: ${t.end_reason}` : "live" }),
      el("span", { class: "badge", text: `${t.prompt_tokens} prompt · ${t.output_tokens ?? "…"} sampled` }),
      t.policy_version != null ? el("span", { class: "badge", text: `v${t.policy_version}` }) : null,
      t.cached_prompt_tokens ? el("span", { class: "badge", title: "prompt tokens the engine served from its prefix cache", text: `${t.cached_prompt_tokens} cached` }) : null,
      t.adapter ? el("span", { class: "badge", text: `adapter ${t.adapter}` }) : null,
      t.tool_calls.length ? el("span", { class: "badge", text: `tool call: ${t.tool_calls.join(", ")}` }) : null,
      why ? el("span", { class: "badge cause", "data-cause": why, text: why }) : null,
      t.signals.map((name) => el("span", { class: `badge signal s-${name}`, "data-signal": name, text: name })),
      t.asked ? el("div", { class: "asked", text: t.asked }) : null,
      t.preview ? el("div", { class: "preview", text: t.preview }) : null,
      me.can_rate && t.state !== "live" ? rating(sessionId, t.turn_id, "Rate this turn") : null),
      kids.length ? el("ul", {}, kids.map((k) => node(k, kids.length))) : null);
  };
  const roots = children.get(null) || [];
  const tree = el("div", { class: "tree", id: "tree" }, el("ul", {}, roots.map((t) => node(t, 1))));
  const picked = new Set();
  const compare = el("button", { type: "button", text: "Compare the two chosen", disabled: true, onclick: () => {
    const [a, b] = [...picked];
    location.hash = `#/compare/${encodeURIComponent(a)}/${encodeURIComponent(b)}`;
  } });
  const trajectories = el("table", { id: "trajectories" }, el("thead", {}, el("tr", {},
    ["", "trajectory", "turns", "tokens", "sampled", "reward", "versions", "health", "batch"].map((h) => el("th", { text: h })))),
    el("tbody", {}, s.trajectories.map((t) => el("tr", { "data-trajectory": t.trajectory_id },
      el("td", {}, el("input", { type: "checkbox", onchange: (e) => {
        if (e.target.checked) picked.add(t.trajectory_id); else picked.delete(t.trajectory_id);
        compare.disabled = picked.size !== 2;
      } })),
      el("td", {}, el("a", { class: "mono", href: `#/trajectory/${encodeURIComponent(t.trajectory_id)}`, text: short(t.trajectory_id) })),
      el("td", { text: t.turn_ids.length }), el("td", { text: t.tokens }), el("td", { text: t.sampled }),
      el("td", { text: t.reward ?? "none" }), el("td", { text: t.min_version === t.max_version ? `v${t.min_version}` : `v${t.min_version}–v${t.max_version}` }),
      el("td", {}, flags(t.health)), el("td", { class: "mono", text: t.batch_id ? short(t.batch_id) : t.dropped ? `dropped: ${t.dropped.replace("_", " ")}` : "not yet in a batch" })))));
  const liveBox = el("div", { class: "live-box", id: "live" });
  const rateSession = me.can_rate ? rating(sessionId, null, "Rate the session (every trajectory of it)") : null;
  const receipt = el("pre", { class: "receipt", id: "receipt", hidden: true });
  const forget = me.admin ? el("button", { type: "button", class: "danger", id: "forget", text: "Forget this session", onclick: async () => {
    if (!confirm(`Erase session ${sessionId} from every store, for good?`)) return;
    forget.disabled = true;
    forget.textContent = "Forgetting…";
    try {
      const done = await api(`/api/sessions/${encodeURIComponent(sessionId)}/forget?` + q({ tenant: s.tenant }), { method: "POST" });
      receipt.textContent = JSON.stringify(done.receipt, null, 2);
      receipt.hidden = false;
      forget.textContent = "Forgotten";
    } catch (error) { receipt.textContent = error.message; receipt.hidden = false; forget.disabled = false; }
  } }) : null;
  show(view, 
    el("h1", {}, "Session ", el("span", { class: "mono", text: s.session_id })),
    el("dl", { class: "kv" }, el("dt", { text: "tenant" }), el("dd", { class: "mono", text: s.tenant }),
      el("dt", { text: "agent" }), el("dd", { text: s.agent || "unknown" }), el("dt", { text: "model" }), el("dd", { text: s.model || "" }),
      el("dt", { text: "status" }), el("dd", { text: s.closed ? `closed (${s.closed})` : "open" }),
      el("dt", { text: "health" }), el("dd", {}, flags(s.health, (f) => { location.hash = "#/sessions?" + q({ flag: f }); }))),
    el("h2", { text: `Turns (${s.turns}${s.live ? `, ${s.live} live` : ""})` }), tree,
    turns.length >= 500 ? el("p", {}, el("a", { href: `#/session/${encodeURIComponent(sessionId)}?` + q({ tenant, offset: s.turns_offset + 500 }), text: "Next 500 turns" })) : null,
    el("h2", { text: "Live" }), liveBox,
    el("h2", { text: "Trajectories" }), trajectories, compare, rateSession,
    forget ? el("h2", { text: "Data rights" }) : null, forget, receipt);
  live = new EventSource(`/api/sessions/${encodeURIComponent(sessionId)}/live?` + q({ tenant: s.tenant }));
  live.addEventListener("ready", () => { liveBox.dataset.ready = "1"; });
  const streaming = new Map();
  live.addEventListener("delta", (event) => {
    const d = JSON.parse(event.data);
    let line = streaming.get(d.turn_id);
    if (!line) {
      line = el("div", { "data-live-turn": d.turn_id }, el("span", { class: "badge live", text: short(d.turn_id) }));
      streaming.set(d.turn_id, line);
      liveBox.append(line);
    }
    d.texts.forEach((text, i) => line.append(el("span", { class: "tok k-sampled", title: `id ${d.ids[i]} · offset ${d.offset + i} · logprob ${d.logprobs[i].toFixed(3)}`, text })));
  });
  live.addEventListener("event", (event) => {
    const e = JSON.parse(event.data);
    if (e.kind === "turn.completed" || e.kind === "turn.aborted") liveBox.append(el("div", { class: "dim", text: `${e.kind} ${short(e.turn_id)}` }));
  });
}

// -- tokens ----------------------------------------------------------------------------------------

function tokenSpans(page, select) {
  const out = [];
  let version = null;
  for (const t of page.tokens) {
    if (t.version !== null && t.version !== version) {
      out.push(el("span", { class: "vmark", title: "policy version", text: `v${t.version}` }));
      version = t.version;
    }
    const tip = [`id ${t.id}`, `position ${t.i}`, t.kind, t.logprob !== null ? `logprob ${t.logprob.toFixed(4)}` : null,
      t.version !== null ? `version v${t.version}` : null].filter(Boolean).join(" · ");
    const span = el("span", { class: `tok k-${t.kind}${t.special ? " special" : ""}`, "data-i": t.i, "data-kind": t.kind, title: tip, text: t.text });
    if (t.logprob !== null) span.style.setProperty("--p", (0.12 + 0.6 * Math.exp(t.logprob)).toFixed(3));
    if (select) span.addEventListener("click", (event) => select(t.i, event.shiftKey));
    out.push(span);
  }
  return out;
}

function legend() {
  return el("p", { class: "legend" }, "kinds: ", me.kinds.map((k) => el("span", { class: `k-${k}`, text: k })),
    el("span", { class: "dim", text: "· sampled tokens are shaded by probability" }));
}

async function trajectoryView(view, trajectoryId, params) {
  const size = 2000;
  let offset = Number(params.get("offset") || 0);
  const page = await api(`/api/trajectories/${encodeURIComponent(trajectoryId)}/tokens?` + q({ offset, limit: size }));
  const t = page.trajectory;
  let anchor = null;
  const picked = el("span", { class: "mono", id: "range" });
  const copy = el("button", { type: "button", text: "Copy positions", disabled: true });
  const select = (i, extend) => {
    const [a, b] = extend && anchor !== null ? [Math.min(anchor, i), Math.max(anchor, i) + 1] : [i, i + 1];
    if (!extend) anchor = i;
    for (const node of view.querySelectorAll(".tok.sel")) node.classList.remove("sel");
    for (const node of view.querySelectorAll(".tok[data-i]")) if (+node.dataset.i >= a && +node.dataset.i < b) node.classList.add("sel");
    picked.textContent = `token_ids[${a}:${b}]  loss_mask[${a}:${b}]  logprobs[${a}:${b}]`;
    copy.disabled = false;
    copy.onclick = () => navigator.clipboard && navigator.clipboard.writeText(`${a}:${b}`);
  };
  const box = el("div", { class: "tokens", id: "tokens" }, tokenSpans(page, select));
  const pager = el("p", {}, offset > 0 ? el("a", { href: `#/trajectory/${encodeURIComponent(trajectoryId)}?offset=${Math.max(0, offset - size)}`, text: "← previous" }) : null, " ",
    el("span", { class: "dim", text: `positions ${offset}–${Math.min(page.length, offset + size)} of ${page.length}` }), " ",
    offset + size < page.length ? el("a", { id: "next-page", href: `#/trajectory/${encodeURIComponent(trajectoryId)}?offset=${offset + size}`, text: "next →" }) : null);
  show(view, 
    el("h1", {}, "Trajectory ", el("span", { class: "mono", text: t.trajectory_id })),
    el("dl", { class: "kv" },
      el("dt", { text: "session" }), el("dd", {}, el("a", { class: "mono", href: `#/session/${encodeURIComponent(t.session_id)}?tenant=${encodeURIComponent(t.tenant)}`, text: t.session_id })),
      el("dt", { text: "health" }), el("dd", {}, flags(t.health), t.abort_reason ? ` (aborted: ${t.abort_reason})` : ""),
      el("dt", { text: "model · adapter" }), el("dd", { text: `${t.model} · ${t.adapter || "base"}` }),
      el("dt", { text: "tokens" }), el("dd", { text: `${t.tokens} (prompt ${t.prompt_length}, sampled ${t.sampled})` }),
      el("dt", { text: "policy versions" }), el("dd", { text: t.min_version === t.max_version ? `v${t.min_version}` : `v${t.min_version}–v${t.max_version}` }),
      el("dt", { text: "reward" }), el("dd", { text: t.reward === null ? "none" : `${t.reward} (${t.reward_source})` }),
      el("dt", { text: "scores" }), el("dd", { id: "scores" }, scoreList(t.scores || [])),
      el("dt", { text: "routes · images" }), el("dd", { text: `${t.routes ? "routes recorded" : "no routes"} · ${t.images.length} images` }),
      el("dt", { text: "batch" }), el("dd", { class: "mono", text: t.batch_id || "not in a batch yet" })),
    t.decoded ? legend() : el("p", { class: "dim", text: "No tokenizer for this model: ids are shown as numbers." }),
    pager, el("p", {}, picked, " ", copy), box);
}

// The reward worker's verdicts: one line per scorer (score, timeout or error), a judge's answer beside it.
function scoreList(scores) {
  if (!scores.length) return "none recorded";
  return el("ul", { class: "scores" }, ...scores.map((s) => el("li", { "data-scorer": s.scorer },
    el("span", { class: "mono", text: `${s.scorer} (${s.kind}): ` }),
    s.status === "scored" ? `${s.score}` : `${s.status}${s.error ? ": " + s.error : ""}`,
    s.attempts > 1 ? ` after ${s.attempts} tries` : "",
    s.answer ? el("div", { class: "dim", text: s.answer }) : null)));
}

async function compareView(view, a, b) {
  const c = await api("/api/compare?" + q({ a, b }));
  const from = Math.max(0, c.shared_tokens - 40);
  const [pa, pb] = await Promise.all([a, b].map((id) => api(`/api/trajectories/${encodeURIComponent(id)}/tokens?` + q({ offset: from, limit: 600 }))));
  show(view, el("h1", { text: "Two chains compared" }),
    el("dl", { class: "kv", id: "compare" },
      el("dt", { text: "shared turns" }), el("dd", { text: c.shared_turns }),
      el("dt", { text: "shared tokens" }), el("dd", { text: `${c.shared_tokens} (of ${c.length_a} and ${c.length_b})` }),
      el("dt", { text: "sampled tokens in both loss masks" }), el("dd", { id: "twice", text: c.shared_sampled_in_both_losses }),
      el("dt", { text: "batches" }), el("dd", { class: "mono", text: c.batches.map((x) => x || "none yet").join(" · ") })),
    el("p", { class: "dim", text: c.shared_sampled_in_both_losses
      ? "These chains were assembled with --shared-turns every: a sampled token they share is trained once per chain that holds it."
      : "Train-once (the assembler's default): a sampled turn the chains share is in the loss of the first chain only, shown as untrained in the other." }),
    legend(),
    el("div", { class: "side" }, [pa, pb].map((p, k) => el("div", {}, el("h2", {}, el("a", { class: "mono", href: `#/trajectory/${encodeURIComponent([a, b][k])}`, text: short([a, b][k]) }), ` from position ${from}`),
      el("div", { class: "tokens" }, tokenSpans(p, null))))));
}

// -- the training loop -----------------------------------------------------------------------------

function plot(points) {
  const NS = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(NS, "svg");
  const [w, h, pad] = [640, 180, 24];
  svg.setAttribute("width", w); svg.setAttribute("height", h); svg.setAttribute("class", "plot");
  if (!points.length) return svg;
  const xs = points.map((p) => p.ended_at), ys = points.map((p) => p.reward);
  const [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs) || 1, Math.min(...ys, 0), Math.max(...ys, 1)];
  const X = (x) => pad + ((x - x0) / (x1 - x0 || 1)) * (w - 2 * pad), Y = (y) => h - pad - ((y - y0) / (y1 - y0 || 1)) * (h - 2 * pad);
  for (const p of points) {
    const dot = document.createElementNS(NS, "circle");
    dot.setAttribute("cx", X(p.ended_at)); dot.setAttribute("cy", Y(p.reward)); dot.setAttribute("r", 3); dot.setAttribute("fill", "#2e90fa");
    svg.append(dot);
  }
  for (const [y, label] of [[y0, String(y0)], [y1, String(y1)]]) {
    const text = document.createElementNS(NS, "text");
    text.setAttribute("x", 2); text.setAttribute("y", Y(y)); text.setAttribute("font-size", 10); text.textContent = label;
    svg.append(text);
  }
  return svg;
}

async function loopView(view) {
  const loop = await api("/api/loop");
  show(view, el("h1", { text: "Training loop" }),
    el("h2", { text: "Policy versions served" }),
    loop.replicas.length ? el("table", { id: "replicas" }, el("thead", {}, el("tr", {}, ["replica", "adapter", "version", "since"].map((h) => el("th", { text: h })))),
      el("tbody", {}, loop.replicas.map((r) => el("tr", {}, el("td", { class: "mono", text: r.replica }), el("td", { text: r.adapter || "base" }), el("td", { text: `v${r.version}` }), el("td", { class: "dim", text: when(r.time) })))))
      : el("p", { class: "dim", text: "No replica has applied new weights yet: every one serves version 0." }),
    el("h2", { text: "Batches" }),
    me.admin ? el("table", { id: "batches" }, el("thead", {}, el("tr", {}, ["batch", "rows", "versions", "lag behind newest", "adapter", "made"].map((h) => el("th", { text: h })))),
      el("tbody", {}, loop.batches.map((b) => el("tr", {}, el("td", { class: "mono", text: short(b.batch_id) }), el("td", { text: b.rows }),
        el("td", { text: `v${b.min_version}–v${b.max_version}` }), el("td", { text: b.lag ?? "" }), el("td", { text: b.adapter || "base" }), el("td", { class: "dim", text: when(b.created_at) })))))
      : el("p", { class: "dim", text: "Batches mix tenants: an admin key sees them." }),
    el("h2", { text: "Reward over time" }),
    loop.rewards.length ? plot(loop.rewards) : el("p", { class: "dim", text: "No trajectory has a reward yet (feedback, a reward function, or --default-reward)." }));
}

start();
