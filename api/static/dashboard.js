// The CMX dashboard: polls the admin API's JSON and draws, per node and tier, an occupancy bar,
// the hit ratio and bandwidth, with charts of the last minutes. No framework, no build step.
"use strict";

const TIERS = { hbm: ["HBM", "G1"], dram: ["DRAM", "G2"], nvme: ["NVMe", "G3"] };
const POLL_MS = 3000;
const HISTORY_MS = 10000;
const WINDOW_S = 600;
let token = sessionStorage.getItem("cmx-token") || "";

// -- formatting ------------------------------------------------------------------------------

function bytes(n) {
  if (n === null || n === undefined) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return (i === 0 ? n.toFixed(0) : n.toFixed(n < 10 ? 2 : 1)) + " " + units[i];
}
const rate = (n) => (n === null || n === undefined ? "—" : bytes(n) + "/s");
const pct = (x) => (x === null || x === undefined ? "—"
  : (100 * x).toFixed(x > 0 && x < 0.1 ? 1 : 0) + "%");
const short = (id) => id.slice(0, 12);

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k.startsWith("data-") || k.startsWith("aria-") || k === "role" || k === "title") {
      e.setAttribute(k, v);
    } else e[k] = v;
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

// -- fetching --------------------------------------------------------------------------------

async function getJson(path) {
  const headers = token ? { Authorization: "Bearer " + token } : {};
  const r = await fetch(path, { headers, cache: "no-store" });
  if (r.status === 401) {
    document.getElementById("token-box").hidden = false;
    throw new Error("token needed");
  }
  if (!r.ok) {
    let detail = r.statusText;
    try { detail = (await r.json()).detail || detail; } catch (e) { /* not JSON */ }
    throw new Error(r.status + " " + detail);
  }
  return r.json();
}

function setStatus(ok, text) {
  const s = document.getElementById("status");
  s.className = "status " + (ok ? "ok" : "error");
  s.textContent = text;
}

// -- charts ----------------------------------------------------------------------------------

const SVG = "http://www.w3.org/2000/svg";

function chart(title, legend, lines, maxValue) {
  const w = 240, h = 38;
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  svg.setAttribute("preserveAspectRatio", "none");
  const now = Date.now() / 1000;
  const top = maxValue || Math.max(1, ...lines.flatMap((l) => l.points.map((p) => p[1])));
  for (const line of lines) {
    const xy = line.points
      .filter((p) => p[1] !== null && p[1] !== undefined)
      .map(([t, v]) => [(w * (1 - (now - t) / WINDOW_S)).toFixed(1),
                        (h - 2 - (h - 4) * Math.min(v / top, 1)).toFixed(1)]);
    if (xy.length >= 2) {
      const poly = document.createElementNS(SVG, "polyline");
      poly.setAttribute("points", xy.map((p) => p.join(",")).join(" "));
      poly.setAttribute("class", line.cls);
      svg.append(poly);
    }
    if (xy.length) {  // the latest value as a dot, so a lone sample shows too
      const dot = document.createElementNS(SVG, "circle");
      const [x, y] = xy[xy.length - 1];
      dot.setAttribute("cx", x);
      dot.setAttribute("cy", y);
      dot.setAttribute("r", "2");
      dot.setAttribute("class", line.cls + " dot");
      svg.append(dot);
    }
  }
  return el("div", { class: "chart" }, el("div", { class: "chart-title" },
    el("span", {}, title), legend), svg);
}

function bandwidthChart(points) {
  const peak = Math.max(0, ...points.flatMap((p) => [p.in_bytes_per_s || 0,
    p.out_bytes_per_s || 0]));
  const legend = el("span", {}, el("span", { class: "key-in" }, "in "),
    el("span", { class: "key-out" }, "out"));
  return chart(`bandwidth · peak ${rate(peak)}`, legend, [
    { cls: "line-in", points: points.map((p) => [p.t, p.in_bytes_per_s]) },
    { cls: "line-out", points: points.map((p) => [p.t, p.out_bytes_per_s]) },
  ]);
}

function hitChart(points) {
  const known = points.filter((p) => p.hit_ratio !== null);
  const last = known.length ? known[known.length - 1].hit_ratio : null;
  return chart(`hit ratio · last ${pct(last)}`, el("span", {}, `last ${WINDOW_S / 60} min`),
    [{ cls: "line-hit", points: points.map((p) => [p.t, p.hit_ratio]) }], 1);
}

// -- drawing ---------------------------------------------------------------------------------

let seriesByTier = {};  // "node/tier" -> history points

function tierRow(node, t) {
  const [name, g] = TIERS[t.tier] || [t.tier, ""];
  const label = el("div", { class: "tier-label" },
    el("div", { class: "tier-name" }, name + " ", el("span", { class: "g" }, g)));
  if (t.emulated) label.append(el("span", { class: "badge emulated", title:
    "no GPU: HBM emulated on host memory" }, "emulated"));
  if (!t.available) label.append(el("span", { class: "badge down" }, "not answering"));

  const fill = el("div", { class: "tier-fill" });
  const share = t.available ? t.occupancy : 0;
  fill.style.width = (100 * Math.min(share, 1)).toFixed(1) + "%";
  if (share >= 0.9) fill.classList.add("full");
  else if (share >= 0.7) fill.classList.add("warn");
  const bar = el("div", {
    class: "tier-bar", "data-tier": t.tier, "data-node": node.node, role: "progressbar",
    "aria-valuemin": "0", "aria-valuemax": "100",
    "aria-valuenow": (100 * share).toFixed(0),
    "aria-label": `${name} occupancy`,
  }, fill, el("span", { class: "tier-pct" }, t.available ? pct(share)
    : (t.error || "not answering")));

  const bw = t.bandwidth || {};
  const figs = el("div", { class: "tier-figs" },
    el("b", {}, bytes(t.used_bytes)), ` of ${bytes(t.capacity_bytes)} · `,
    el("b", {}, String(t.blocks)), " blocks · hit ratio ", el("b", {}, pct(t.hit_ratio)),
    ` (${t.hits} / ${t.hits + t.misses}) · in `, el("b", {}, rate(bw.in_bytes_per_s)),
    " · out ", el("b", {}, rate(bw.out_bytes_per_s)),
    t.pinned ? ` · ${t.pinned} pinned` : "");
  const points = seriesByTier[node.node + "/" + t.tier] || [];
  const charts = el("div", { class: "charts" }, bandwidthChart(points), hitChart(points));
  const row = el("div", { class: "tier" + (t.available ? "" : " unavailable"),
    "data-tier": t.tier }, label, bar, figs, charts);
  return row;
}

function nodeCard(node) {
  const a = node.agent;
  const head = el("div", { class: "node-head" },
    el("span", { class: "node-id", title: node.node }, "node " + short(node.node)));
  if (a.available) {
    head.append(el("span", { class: "badge" + (a.dpu ? " dpu" : ""), title: "agent on " +
      (a.placed_on || "?") }, a.dpu ? "agent on DPU" : "agent on host"));
    head.append(el("span", { class: "badge", title: "transport between agents" }, a.transport));
  } else {
    head.append(el("span", { class: "badge down" }, "agent not answering"));
  }
  const q = a.queues || {};
  const queues = el("div", { class: "queues" }, `queues: load ${q.load} · prefetch ` +
    `${q.prefetch} · demote ${q.demote} · staging ${bytes(q.staging_bytes_in_use)} of ` +
    `${bytes(q.staging_bytes)}`);
  return el("section", { class: "node", "data-node": node.node }, head, queues,
    ...node.tiers.map((t) => tierRow(node, t)));
}

function figure(value, label) {
  return el("div", { class: "figure" }, el("div", { class: "value" }, value),
    el("div", { class: "label" }, label));
}

function drawSummary(view) {
  const tiers = view.nodes.flatMap((n) => n.tiers.filter((t) => t.available));
  const sum = (f) => tiers.reduce((s, t) => s + t[f], 0);
  const hits = sum("hits"), lookups = hits + sum("misses");
  const dir = view.directory.reduce((s, d) => s + d.blocks, 0);
  document.getElementById("summary").replaceChildren(
    figure(String(view.nodes.length), "nodes"),
    figure(`${bytes(sum("used_bytes"))}`, `held of ${bytes(sum("capacity_bytes"))}`),
    figure(String(dir), "blocks in the directory"),
    figure(pct(lookups ? hits / lookups : null), "hit ratio, all tiers"),
  );
}

function drawPool(pool) {
  const box = document.getElementById("pool");
  if (!pool.enabled) { box.textContent = "no pool tier in this service"; return; }
  const share = pool.capacity_bytes ? pool.used_bytes / pool.capacity_bytes : 0;
  const fill = el("div", { class: "tier-fill" });
  fill.style.width = (100 * Math.min(share, 1)).toFixed(1) + "%";
  box.replaceChildren(el("div", { class: "tier-bar", "data-tier": "pool", role: "progressbar",
    "aria-valuenow": (100 * share).toFixed(0) }, fill, el("span", { class: "tier-pct" },
    pct(share))),
  el("div", { class: "tier-figs" }, el("b", {}, bytes(pool.used_bytes)),
    ` of ${bytes(pool.capacity_bytes)} · ${pool.blocks} blocks on ${pool.nodes.length} pool ` +
    `node(s)` + (pool.replication ? `, ${pool.replication} copies each` : "")));
}

// -- loops -----------------------------------------------------------------------------------

async function refresh() {
  try {
    const view = await getJson("api/v1/tiers");
    drawSummary(view);
    document.getElementById("nodes").replaceChildren(...view.nodes.map(nodeCard));
    document.getElementById("updated").textContent = "updated " +
      new Date(view.sampled_at * 1000).toLocaleTimeString();
    setStatus(true, "live");
  } catch (e) {
    setStatus(false, String(e.message || e));
  }
}

async function refreshHistory() {
  try {
    const h = await getJson("api/v1/history?window_s=" + WINDOW_S);
    seriesByTier = {};
    for (const s of h.series) seriesByTier[s.node + "/" + s.tier] = s.points;
    drawPool(await getJson("api/v1/pool"));
  } catch (e) { /* the main loop reports errors */ }
}

function readTokenFromHash() {
  const m = /(?:^#|&)token=([^&]+)/.exec(location.hash);
  if (m) {
    token = decodeURIComponent(m[1]);
    sessionStorage.setItem("cmx-token", token);
    window.history.replaceState(null, "", location.pathname + location.search);
  }
}

function start() {
  readTokenFromHash();
  document.getElementById("window").textContent = String(WINDOW_S / 60);
  document.getElementById("token-box").addEventListener("submit", (ev) => {
    ev.preventDefault();
    token = document.getElementById("token").value.trim();
    sessionStorage.setItem("cmx-token", token);
    document.getElementById("token-box").hidden = true;
    refreshHistory().then(refresh);
  });
  refreshHistory().then(refresh);
  setInterval(refresh, POLL_MS);
  setInterval(refreshHistory, HISTORY_MS);
}

document.addEventListener("DOMContentLoaded", start);
