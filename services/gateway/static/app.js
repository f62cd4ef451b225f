// Blitzmesh dashboard: one EventSource on /dashboard/stream ("cluster" snapshots, manager "event"s).
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

function onEvent(ev) {
  if (ev.action === "transfer_plan") { state.chains = parseChains(ev.reason); renderChains(); }
  if (ev.action === "zigzag_pair" && ev.instance_id) { state.zigzag.set(ev.instance_id, ev.status); renderZigzag(); }
  if (ev.action === "zigzag_stopped") { state.zigzag.delete(ev.instance_id); renderZigzag(); }
  if (!TIMELINE.has(ev.action)) return;
  const li = el("li");
  li.dataset.action = ev.action;
  li.dataset.instanceId = ev.instance_id || "";
  li.dataset.shownMs = String(Date.now());
  li.dataset.receivedS = String(ev.received_s);
  li.append(el("span", "when", clock(ev.received_s)));
  li.append(el("span", "what", ev.action + (ev.instance_id ? " " + ev.instance_id : "")));
  li.append(el("span", "why", [ev.target, ev.status, ev.reason].filter(Boolean).join(" · ")));
  const ol = $("timeline");
  ol.prepend(li);
  while (ol.children.length > MAX_TIMELINE) ol.lastChild.remove();
}

function connect() {
  const key = new URLSearchParams(location.search).get("key");
  const src = new EventSource("/dashboard/stream" + (key ? "?key=" + encodeURIComponent(key) : ""));
  src.addEventListener("open", () => { $("connection").textContent = "live"; $("connection").className = "pill live"; });
  src.addEventListener("error", () => { $("connection").textContent = "reconnecting…"; $("connection").className = "pill down"; });
  src.addEventListener("cluster", (m) => onCluster(JSON.parse(m.data)));
  src.addEventListener("event", (m) => onEvent(JSON.parse(m.data)));
  src.addEventListener("problem", (m) => console.warn(JSON.parse(m.data).message));
}

connect();
