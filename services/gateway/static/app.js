// Blitzmesh dashboard: the manager's recent past from /dashboard/history, then one EventSource on
// /dashboard/stream ("cluster" snapshots, manager "event"s and history "sample"s).
"use strict";

const TIMELINE = new Set(["autoscaling_decision", "autoscaling_bound", "scale_from_zero", "scale_out", "scale_in",
  "transfer_plan", "live_scaling", "zigzag_pair", "zigzag_stopped", "load_result", "drain_result", "rebalance",
  "zigzag_take_back", "instance_lost", "policy"]);
const MAX_TIMELINE = 200;
const SPARK_POINTS = 120;
// When each instance was first seen loading or serving (ms, this clock): the cards carry it.
const firstActive = new Map();
const state = { instances: new Map(), chains: [], zigzag: new Map(), series: { rate: [], ttft: [], tbt: [] } };

const $ = (id) => document.getElementById(id);
function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}
const ms = (s) => (s === null || s === undefined || !(s > 0) ? "-" : (s * 1000).toFixed(0) + " ms");
function clock(t) {
  const d = new Date(t > 1e9 ? t * 1000 : Date.now());
  return d.toTimeString().slice(0, 8);
}

function renderInstances(list) {
  const box = $("instances");
  box.replaceChildren();
  if (!list.length) { box.append(el("p", "empty", "no instances")); return; }
  // A loading instance's L is what the manager knows of it, which may lag the model's; its
  // serving peers know the model's.
  const modelLayers = new Map();
  for (const i of list) if (i.model) modelLayers.set(i.model, Math.max(modelLayers.get(i.model) || 0, i.num_layers));
  for (const raw of list) {
    const i = raw.model ? { ...raw, num_layers: modelLayers.get(raw.model) } : raw;
    const card = el("div", "card state-" + i.state);
    card.dataset.instanceId = i.instance_id;
    card.dataset.state = i.state;
    if ((i.state === "loading" || i.state === "serving") && !firstActive.has(i.instance_id)) {
      firstActive.set(i.instance_id, Date.now());
    }
    if (firstActive.has(i.instance_id)) card.dataset.activeSinceMs = String(firstActive.get(i.instance_id));
    card.append(el("div", "id", i.instance_id));
    card.append(el("div", "state", i.state + " · " + i.role));
    card.append(el("div", "meta", (i.model || "no model") + (i.host ? " @ " + i.host : "")));
    if (i.num_layers) {
      const bar = el("div", "bar");
      const fill = el("div", "fill");
      fill.style.width = (100 * i.layers_loaded / i.num_layers).toFixed(0) + "%";
      if (i.state !== "loading") fill.style.background = "var(--serving)";
      bar.append(fill);
      card.append(bar);
      card.append(el("div", "meta layers", "layers " + i.layers_loaded + "/" + i.num_layers));
    }
    card.append(el("div", "meta", "running " + i.running + " · waiting " + i.waiting +
      (i.zigzag_running ? " · zigzag " + i.zigzag_running : "")));
    card.append(el("div", "meta", "TTFT p50 " + ms(i.ttft_p50_s) + " · TBT p50 " + ms(i.tbt_p50_s)));
    box.append(card);
  }
}

function spark(id, values) {
  const c = $(id), g = c.getContext("2d");
  g.clearRect(0, 0, c.width, c.height);
  const vals = values.filter((v) => v !== null);
  if (vals.length < 2) return;
  const max = Math.max(...vals) || 1;
  g.strokeStyle = "#4aa3ff";
  g.beginPath();
  values.forEach((v, k) => {
    const x = (k / Math.max(values.length - 1, 1)) * c.width, y = c.height - ((v || 0) / max) * (c.height - 2) - 1;
    k ? g.lineTo(x, y) : g.moveTo(x, y);
  });
  g.stroke();
}

function push(name, v) {
  const s = state.series[name];
  s.push(v);
  if (s.length > SPARK_POINTS) s.shift();
}

function onCluster(data) {
  $("policy").textContent = "policy " + (data.policy || "-") + (data.advisory ? " (advisory)" : "");
  renderInstances(data.instances);
  $("rate").textContent = data.request_rate.toFixed(2);
  $("ttft").textContent = ms(data.ttft_mean_s);
  $("tbt").textContent = ms(data.tbt_mean_s);
  push("rate", data.request_rate); push("ttft", data.ttft_mean_s); push("tbt", data.tbt_mean_s);
  spark("rate-spark", state.series.rate); spark("ttft-spark", state.series.ttft); spark("tbt-spark", state.series.tbt);
  // A pair ends when its loading instance has all its layers (or is gone).
  const loading = new Set(data.instances.filter((i) => i.state === "loading").map((i) => i.instance_id));
  let changed = false;
  for (const id of [...state.zigzag.keys()]) if (!loading.has(id)) { state.zigzag.delete(id); changed = true; }
  if (changed) renderZigzag();
  renderEsp(data.esp_groups || []);
}

// One line per group: its members in slice order with the prompt positions each holds, the
// last (the master) marked, and the spares it may scale up to.
function renderEsp(groups) {
  const ul = $("esp");
  ul.replaceChildren();
  if (!groups.length) { ul.append(el("li", "empty", "none: a prompt no single instance can hold forms one")); return; }
  for (const g of groups) {
    const li = el("li", "pair");
    li.dataset.groupId = g.group_id;
    g.members.forEach((m, k) => {
      if (k) li.append(el("span", "arrow", "→"));
      const slice = " [" + g.bounds[k] + "," + g.bounds[k + 1] + ")";
      li.append(el("span", "node", m + slice + (k === g.members.length - 1 ? " master" : "")));
    });
    const held = (g.holders || []).map((h, k) => h + " (" + ((g.holder_kv_tokens || [])[k] ?? "?") + " KV tokens)");
    const state = g.live ? " · live on " + (held.join(", ") || "-") : " · ended";
    li.append(el("span", "empty", "  " + g.request_id + (g.spares.length ? " · spares " + g.spares.join(", ") : "") + state));
    ul.append(li);
  }
}

// "chains: src->a->b (12 groups); host-cache-0->c (5 groups)"
function parseChains(reason) {
  return reason.replace(/^chains:\s*/, "").split(";").map((s) => s.trim()).filter(Boolean).map((s) => {
    const m = s.match(/^(.*?)\s*\((\d+) groups\)$/);
    return { nodes: (m ? m[1] : s).split("->"), groups: m ? Number(m[2]) : null };
  });
}

function renderChains() {
  const ul = $("chains");
  ul.replaceChildren();
  if (!state.chains.length) { ul.append(el("li", "empty", "none yet: a scale-out plans them")); return; }
  for (const chain of state.chains) {
    const li = el("li", "chain");
    chain.nodes.forEach((n, k) => {
      if (k) li.append(el("span", "arrow", "→"));
      li.append(el("span", "node", n));
    });
    if (chain.groups !== null) li.append(el("span", "empty", "  " + chain.groups + " groups"));
    ul.append(li);
  }
}

function renderZigzag() {
  const ul = $("zigzag");
  ul.replaceChildren();
  if (!state.zigzag.size) { ul.append(el("li", "empty", "none: a loading instance pairs with a serving one")); return; }
  for (const [loadingId, partner] of state.zigzag) {
    const li = el("li", "pair");
    li.dataset.instanceId = loadingId;
    li.append(el("span", "node", loadingId), el("span", "arrow", "⇄"), el("span", "node", partner));
    li.append(el("span", "empty", "  first layers on " + loadingId + ", the rest on " + partner));
    ul.append(li);
  }
}

// ---- history: charts of the manager's samples, scaling decisions marked on their time axis ----

// Events marked on the charts: the decisions that change the instance count, and losses.
const MARKED = new Set(["scale_out", "scale_in", "scale_from_zero", "instance_lost"]);
const STATE_COLORS = { serving: "#3fb950", loading: "#d29922", draining: "#db6d28", idle: "#6e7681", lost: "#f85149" };
const toMs = (s) => (s === null || s === undefined ? null : s * 1000);
const history = { windowS: 900, times: [], rows: [], seen: new Set(), markers: [], seenEvents: new Set() };
const charts = {};
window.dashboard = { charts, history };  // for the browser test and a curious operator

// Each chart: its series as [label, colour, value of a sample], drawn against the samples' times.
const CHARTS = {
  "chart-rate": [["requests/s", "#4aa3ff", (s) => s.request_rate], ["tokens/s (right)", "#a371f7", (s) => s.decode_tps, "tps"]],
  "chart-ttft": [["TTFT p50", "#4aa3ff", (s) => toMs(s.ttft_p50_s)], ["TTFT p99", "#f85149", (s) => toMs(s.ttft_p99_s)]],
  "chart-tbt": [["TBT p50", "#4aa3ff", (s) => toMs(s.tbt_p50_s)], ["TBT p99", "#f85149", (s) => toMs(s.tbt_p99_s)]],
  "chart-instances": Object.entries(STATE_COLORS).map(([st, c]) => [st, c, (s) => (s.instances || {})[st] ?? 0, null, true]),
};

// The scaling markers as elements over the plot (one per event in view), so they carry the
// event's action and instance as data attributes and its reason as a tooltip.
function drawMarkers(u) {
  for (const old of u.over.querySelectorAll(".marker")) old.remove();
  const [lo, hi] = [u.scales.x.min, u.scales.x.max];
  for (const m of history.markers) {
    if (lo === null || m.at_s < lo || m.at_s > hi) continue;
    const div = el("div", "marker marker-" + m.action);
    div.style.left = u.valToPos(m.at_s, "x") + "px";
    div.dataset.action = m.action;
    div.dataset.instanceId = m.instance_id || "";
    div.dataset.atS = String(m.at_s);
    div.title = clock(m.at_s) + " " + m.action + " " + (m.instance_id || "") + ": " + m.reason;
    u.over.append(div);
  }
}

function makeChart(id) {
  const box = $(id), spec = CHARTS[id];
  const axis = { stroke: "#8a96a3", grid: { stroke: "#222a35" }, ticks: { stroke: "#222a35" } };
  const opts = {
    title: box.dataset.title,
    width: Math.max(box.clientWidth, 300),
    height: 170,
    scales: { x: { time: true } },
    series: [{}, ...spec.map(([label, stroke, , scale, stepped]) => ({
      label, stroke, width: 1.5, scale: scale || "y", spanGaps: false,
      paths: stepped ? uPlot.paths.stepped({ align: 1 }) : undefined,
    }))],
    axes: [axis, { ...axis, scale: "y" }, ...(spec.some((x) => x[3]) ? [{ ...axis, scale: "tps", side: 1, grid: { show: false } }] : [])],
    legend: { live: false },
    hooks: { draw: [drawMarkers] },
  };
  charts[id] = new uPlot(opts, [[], ...spec.map(() => [])], box);
}

function redrawCharts() {
  const horizon = (history.times.at(-1) ?? 0) - history.windowS;
  let dropped = false;
  while (history.times.length && history.times[0] < horizon) { history.times.shift(); history.rows.shift(); dropped = true; }
  if (dropped) history.seen = new Set(history.rows.map((r) => r.time_s));
  history.markers = history.markers.filter((m) => m.at_s >= horizon);
  for (const [id, spec] of Object.entries(CHARTS)) {
    charts[id].setData([history.times.slice(), ...spec.map(([, , value]) => history.rows.map(value))]);
  }
}

function onSample(sample, redraw = true) {
  if (history.seen.has(sample.time_s)) return;  // a stream's first samples overlap the history
  history.seen.add(sample.time_s);
  let k = history.times.length;
  while (k && history.times[k - 1] > sample.at_s) k--;
  history.times.splice(k, 0, sample.at_s);
  history.rows.splice(k, 0, sample);
  if (redraw) redrawCharts();
}

// Resolves when the page has the manager's past (or knows it cannot have it).
async function loadHistory() {
  const key = new URLSearchParams(location.search).get("key");
  const status = $("history-status");
  try {
    const r = await fetch("/dashboard/history" + (key ? "?key=" + encodeURIComponent(key) : ""));
    const body = await r.json();
    if (!r.ok) throw new Error(body.error ? body.error.message : "HTTP " + r.status);
    history.windowS = body.window_s;
    for (const sample of body.samples) onSample(sample, false);
    for (const ev of body.events) onEvent(ev, ev.at_s);
    status.textContent = "last " + Math.round(body.window_s / 60) + " min, a sample every " + body.period_s + " s";
  } catch (e) {
    status.textContent = "no history: " + e.message;
    status.className = "problem";
  }
  redrawCharts();
}

function onEvent(ev, atS) {
  // The same event may come from the history and the stream: keep the first.
  const key = [ev.time_s, ev.action, ev.instance_id, ev.target, ev.status].join("|");
  if (history.seenEvents.has(key)) return;
  history.seenEvents.add(key);
  // A Set iterates in insertion order: the oldest keys go first (a page open for days).
  for (const old of history.seenEvents) { if (history.seenEvents.size <= 10000) break; history.seenEvents.delete(old); }
  const at = atS ?? ev.received_s;
  if (MARKED.has(ev.action)) {
    history.markers.push({ at_s: at, action: ev.action, instance_id: ev.instance_id, reason: ev.reason });
    if (atS === undefined) redrawCharts();
  }
  if (ev.action === "transfer_plan") { state.chains = parseChains(ev.reason); renderChains(); }
  if (ev.action === "zigzag_pair" && ev.instance_id) { state.zigzag.set(ev.instance_id, ev.status); renderZigzag(); }
  if (ev.action === "zigzag_stopped") { state.zigzag.delete(ev.instance_id); renderZigzag(); }
  if (!TIMELINE.has(ev.action)) return;
  const li = el("li");
  li.dataset.action = ev.action;
  li.dataset.instanceId = ev.instance_id || "";
  li.dataset.shownMs = String(Date.now());
  li.dataset.receivedS = String(at);
  if (atS !== undefined) li.dataset.fromHistory = "1";
  li.append(el("span", "when", clock(at)));
  li.append(el("span", "what", ev.action + (ev.instance_id ? " " + ev.instance_id : "")));
  li.append(el("span", "why", [ev.target, ev.status, ev.reason].filter(Boolean).join(" · ")));
  const ol = $("timeline");
  ol.prepend(li);
  while (ol.children.length > MAX_TIMELINE) ol.lastChild.remove();
}

function connect() {
  const key = new URLSearchParams(location.search).get("key");
  const src = new EventSource("/dashboard/stream" + (key ? "?key=" + encodeURIComponent(key) : ""));
  // The stream opens before the history is read, so nothing falls between them; what it brings
  // meanwhile waits, then goes after the history (the same event twice counts once).
  let pending = [];
  const later = (f) => (m) => { const data = JSON.parse(m.data); pending ? pending.push(() => f(data)) : f(data); };
  src.addEventListener("open", () => { $("connection").textContent = "live"; $("connection").className = "pill live"; });
  src.addEventListener("error", () => { $("connection").textContent = "reconnecting…"; $("connection").className = "pill down"; });
  src.addEventListener("cluster", (m) => onCluster(JSON.parse(m.data)));
  src.addEventListener("event", later(onEvent));
  src.addEventListener("sample", later(onSample));
  src.addEventListener("problem", (m) => console.warn(JSON.parse(m.data).message));
  loadHistory().then(() => { const run = pending; pending = null; for (const f of run) f(); });
}

for (const id of Object.keys(CHARTS)) makeChart(id);
addEventListener("resize", () => {
  for (const [id, u] of Object.entries(charts)) u.setSize({ width: Math.max($(id).clientWidth, 300), height: 170 });
});
connect();
