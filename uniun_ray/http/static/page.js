// uniun-ray live page: polls /v1/status and /v1/events once a second and draws the device,
// the queues and the decisions. Plain JavaScript and SVG; no dependency, no build step.
"use strict";

const WINDOW_S = 300;           // the timeline's span: the last 5 minutes
const KEEP_S = 900;             // events kept in memory (runs that began before the window)
const POLL_MS = 1000;
const KINDS = ["chat", "nataraj", "gana", "extract"];
const COLOR = { chat: "#e5484d", nataraj: "#3e9bff", gana: "#30a46c", extract: "#f5a524" };
// a swap's kind (issue 37), as the event log's swap_end says it
const SWAP_KINDS = { cold: "cold load", warm: "warm copy", switch: "switch" };
const NOTABLE = new Set(["revoke", "reclaim", "swap_end", "foreground", "drop", "device", "node"]);

let key = sessionStorage.getItem("uniun-key");
if (location.hash.startsWith("#key=")) {          // the fragment never reaches the server
  key = decodeURIComponent(location.hash.slice(5));
  sessionStorage.setItem("uniun-key", key);
  history.replaceState(null, "", location.pathname);
}

let status = null, statusAt = 0, events = [], lastT = 0, live = null;

const $ = (id) => document.getElementById(id);
const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
const kindBadge = (k) => `<span class="kind k-${esc(k)}">${esc(k)}</span>`;
const jobLink = (id) => `<span class="job" data-job="${esc(id)}">${esc(id)}</span>`;
const secs = (s) => (s == null ? "–" : s < 60 ? `${s.toFixed(1)} s` : `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`);
const clock = (t) => new Date(t * 1000).toLocaleTimeString([], { hour12: false });

// the scheduler's clock, advanced between polls
function now() { return status ? status.now + (performance.now() - statusAt) / 1000 : Date.now() / 1000; }

class HTTPError extends Error {}

async function api(path) {
  const headers = key ? { Authorization: "Bearer " + key } : {};
  let response;
  try {
    response = await fetch(path, { headers, cache: "no-store" });
  } catch (err) {
    throw new HTTPError("the uniun-ray HTTP server does not answer");
  }
  const body = await response.json().catch(() => ({}));
  if (response.status === 401) { $("keyform").classList.remove("hidden"); }
  if (!response.ok) throw new HTTPError((body.error && body.error.message) || `HTTP ${response.status}`);
  return body;
}

function setLive(ok, why) {
  live = ok;
  $("conn").className = "conn " + (ok ? "live" : "down");
  $("conn").textContent = ok ? "live · updated every second" : "unreachable";
  $("banner").classList.toggle("hidden", ok);
  if (!ok) $("banner").textContent = `Scheduler unreachable: ${why}. Retrying every second; this page recovers by itself when it returns.`;
}

async function poll() {
  try {
    const [snap, fresh] = await Promise.all([api("/v1/status"), api(`/v1/events?since=${lastT}`)]);
    status = snap; statusAt = performance.now();
    for (const e of fresh.events) if (e.t > lastT) events.push(e);
    if (events.length) lastT = events[events.length - 1].t;
    const cutoff = status.now - KEEP_S;
    if (events.length && events[0].t < cutoff) events = events.filter((e) => e.t >= cutoff);
    setLive(true);
  } catch (err) {
    setLive(false, err.message);
  }
  render();
}

// -- the event log as runs, swaps and revokes -------------------------------------------
function pastOf(t) {
  const open = {}, runs = [], swaps = [], marks = [];
  let swap = null;
  for (const e of events) {
    const device = e.device;
    if (e.ev === "dispatch") {
      open[e.job] = { job: e.job, kind: e.kind, producer: e.producer, model: e.model, tier: e.tier, start: e.t, device,
                      slot: e.slot || 0 };
    } else if (e.ev === "finish" && open[e.job]) {
      const run = open[e.job]; run.end = e.t; run.outcome = e.outcome; runs.push(run); delete open[e.job];
    } else if (e.ev === "swap_start") {
      swap = { start: e.t, model: e.model, from: e.from, device };
    } else if (e.ev === "swap_end") {
      swaps.push(swap ? { ...swap, end: e.t, kind: e.swap_kind } : { start: e.t - (e.seconds || 0), end: e.t, model: e.model, device, kind: e.swap_kind });
      swap = null;
    } else if (e.ev === "revoke" || e.ev === "reclaim") {
      marks.push(e);
    }
  }
  for (const run of Object.values(open)) runs.push({ ...run, end: t, open: true });
  if (swap) swaps.push({ ...swap, end: t, open: true });
  return { runs, swaps, marks };
}

function devices() {
  const leaseOf = (running) => (running && status.leases ? status.leases[running.id] : null);
  // a cluster of several nodes: each device says on which (its node's address)
  const nodes = (status && Array.isArray(status.nodes) && status.nodes.length > 1) ? status.nodes : [];
  const addressOf = (id) => (nodes.find((n) => n.node === id) || {}).address;
  if (status && Array.isArray(status.devices) && status.devices.length) {   // the pool (SPEC §5)
    return status.devices.map((d) => ({ name: d.device ?? d.name ?? "device", loaded_model: d.loaded_model,
                                        running: d.running, lease: leaseOf(d.running), node: addressOf(d.node),
                                        slots: d.slots || 1, slotsAuto: d.slots_auto,
                                        jobs: (d.jobs || (d.running ? [d.running] : [])).map((j) => ({ job: j, lease: leaseOf(j) })) }));
  }
  const running = status && status.running;
  return [{ name: "device", loaded_model: status && status.loaded_model, running, lease: leaseOf(running) }];
}

// -- drawing ----------------------------------------------------------------------------
function timeline(device, first, past, t, width, slots = 1) {
  // one lane per slot (SPEC §6): the jobs that decode together run in parallel lanes
  const h = 64, top = 12, bar = 30, lane = bar / slots, x = (v) => ((v - (t - WINDOW_S)) / WINDOW_S) * width;
  const parts = [];
  for (let m = 0; m <= 5; m++) {
    const xx = width - (m * 60 / WINDOW_S) * width;
    parts.push(`<line x1="${xx}" x2="${xx}" y1="${top}" y2="${top + bar}" stroke="#2a2f3a"/>`);
    parts.push(`<text class="axis" x="${Math.min(width - 2, Math.max(0, xx))}" y="${h - 4}" text-anchor="${m === 0 ? "end" : m === 5 ? "start" : "middle"}">${m ? `−${m} min` : "now"}</text>`);
  }
  // events name their device in a pool; a log without device names belongs to the first one
  const mine = (item) => (item.device ? item.device === device : device === first);
  for (const r of past.runs.filter(mine)) {
    if (r.end < t - WINDOW_S) continue;
    const a = Math.max(0, x(r.start)), b = Math.max(a + 1.5, x(r.end));
    const y = top + Math.min(r.slot || 0, slots - 1) * lane;
    parts.push(`<rect class="run k-${esc(r.kind)}${r.open ? " open" : ""}" data-job="${esc(r.job)}" x="${a}" y="${y}" width="${b - a}" height="${lane}" fill="${COLOR[r.kind] || "#888"}"><title>${esc(r.kind)} ${esc(r.job)} (${esc(r.producer)}) T${r.tier ?? "?"} on ${esc(r.model)}: ${secs(r.end - r.start)}${r.outcome ? ", " + esc(r.outcome) : ""}</title></rect>`);
  }
  for (const s of past.swaps.filter(mine)) {
    if (s.end < t - WINDOW_S) continue;
    const a = Math.max(0, x(s.start)), b = Math.max(a + 2, x(s.end));
    parts.push(`<rect class="swap" x="${a}" y="${top}" width="${b - a}" height="${bar}" fill="url(#hatch)"><title>${esc(SWAP_KINDS[s.kind] || "swap")} to ${esc(s.model)}${s.from ? " from " + esc(s.from) : ""}: ${secs(s.end - s.start)}</title></rect>`);
  }
  for (const m of past.marks.filter(mine)) {
    if (m.t < t - WINDOW_S) continue;
    const xx = x(m.t);
    parts.push(`<g class="revoke-mark" data-job="${esc(m.job)}"><line x1="${xx}" x2="${xx}" y1="2" y2="${top + bar + 2}" stroke="#ff4d4f" stroke-width="2"/><path d="M${xx - 4},2 L${xx + 4},2 L${xx},8 Z" fill="#ff4d4f"/><title>${esc(m.ev)} ${esc(m.job)}: ${esc(m.reason)}</title></g>`);
  }
  return `<svg class="timeline" data-device="${esc(device)}" viewBox="0 0 ${width} ${h}" width="${width}" height="${h}">
    <defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)"><rect width="6" height="6" fill="#3a3f4a"/><line x1="0" y1="0" x2="0" y2="6" stroke="#8b93a1" stroke-width="2"/></pattern></defs>
    <rect x="0" y="${top}" width="${width}" height="${bar}" fill="#1d2129"/>${parts.join("")}</svg>`;
}

function renderDevices(t) {
  const past = pastOf(t);
  const width = Math.max(300, $("devices").clientWidth - 28);
  const all = devices();
  $("devices").innerHTML = all.map((d) => {
    const holders = d.slots > 1
      ? `<span class="slots">${d.jobs.length} of ${d.slots} slots busy${d.slotsAuto ? " (auto)" : ""}</span>` +
        d.jobs.map(({ job, lease }) => holder(job, lease, `slot ${job.slot} · `)).join("")
      : d.running ? holder(d.running, d.lease, "") : `<span class="holder idle">idle: no job holds the device</span>`;
    const node = d.node ? `<span class="node">on node <b>${esc(d.node)}</b></span>` : "";
    return `<div class="device" data-device="${esc(d.name)}"><div class="device-head"><b>${esc(d.name)}</b>${node}
      <span>model <b>${esc(d.loaded_model || "none loaded")}</b></span>${holders}</div>${timeline(d.name, all[0].name, past, t, width, d.slots || 1)}</div>`;
  }).join("");
}

function holder(r, lease, prefix) {
  const held = lease && lease.held_s != null ? lease.held_s : r.held_s;
  return `<span class="holder" data-job="${esc(r.id)}">${prefix}${kindBadge(r.kind)} ${jobLink(r.id)} · producer <b>${esc(r.producer)}</b> · <span class="tier">${esc(r.tier)}</span> · held ${secs(held)}${r.revoked ? " · <b>revoked, stopping</b>" : ""}</span>`;
}

function renderQueues(t) {
  const tiers = (status && status.tiers) || {};
  $("queued").textContent = status ? `${status.queued} queued` : "";
  const rows = [];
  for (const tier of ["T0", "T1", "T2", "T3", "T4"]) {
    const jobs = tiers[tier] || [];
    if (!jobs.length) { rows.push(`<tr><td class="tier">${tier}</td><td colspan="5" class="muted">—</td></tr>`); continue; }
    jobs.forEach((j, i) => {
      const deadline = j.deadline == null ? "" : j.deadline > t ? `due in ${secs(j.deadline - t)}` : `due ${secs(t - j.deadline)} ago`;
      rows.push(`<tr><td class="tier">${i ? "" : tier}</td><td>${jobLink(j.id)}</td><td>${kindBadge(j.kind)}</td><td>${esc(j.producer)}</td><td>waits ${secs(t - j.submitted)}</td><td>${esc(deadline)}${j.subject ? " · " + esc(j.subject) : ""}</td></tr>`);
    });
  }
  $("queues").innerHTML = `<table><tr><th>tier</th><th>job</th><th>kind</th><th>producer</th><th>wait</th><th>deadline · subject</th></tr>${rows.join("")}</table>`;
}

function renderPolicy() {
  if (!status) return;
  const fg = status.foreground || {};
  $("foreground").innerHTML = fg.kind ? `${kindBadge(fg.kind)}${fg.subject ? ` subject <b>${esc(fg.subject)}</b>` : " (all of its jobs)"}` : `<span class="muted">none</span>`;
  const t2 = status.t2 || { share: 0, limit: 0.6 };
  $("t2").innerHTML = `<div class="gauge" title="T2's share of the device's held time in the window"><div class="fill${t2.over_budget ? " over" : ""}" style="width:${Math.min(100, t2.share * 100)}%"></div><div class="limit" style="left:${t2.limit * 100}%"></div></div>
    <div>${(t2.share * 100).toFixed(0)} % of ${(t2.limit * 100).toFixed(0)} %${t2.over_budget ? " · <b>over budget: T2 yields to waiting work</b>" : ""}</div>`;
  const v = status.vruntime || { kinds: {}, producers: {} };
  const max = Math.max(1e-9, ...Object.values(v.kinds || {}), ...Object.values(v.producers || {}).flatMap((p) => Object.values(p)));
  const rows = [];
  for (const [kind, value] of Object.entries(v.kinds || {})) {
    rows.push(`<tr><td>${kindBadge(kind)}</td><td style="width:50%"><div class="bar" style="width:${(value / max) * 100}%;background:${COLOR[kind] || "#888"}"></div></td><td>${value.toFixed(2)} s</td></tr>`);
    for (const [producer, pv] of Object.entries((v.producers || {})[kind] || {})) {
      rows.push(`<tr><td class="muted">&nbsp;&nbsp;${esc(producer)}</td><td><div class="bar" style="opacity:.6;width:${(pv / max) * 100}%;background:${COLOR[kind] || "#888"}"></div></td><td>${pv.toFixed(2)} s</td></tr>`);
    }
  }
  $("pool").innerHTML = rows.length ? `<table>${rows.join("")}</table>` : `<span class="muted">no T4 flow yet</span>`;
}

function describe(e) {
  switch (e.ev) {
    case "revoke": return `<span class="what">revoke</span> ${kindBadge(e.kind)} ${jobLink(e.job)}: ${esc(e.reason || "")}`;
    case "reclaim": return `<span class="what">reclaim</span> ${kindBadge(e.kind)} ${jobLink(e.job)}: ${esc(e.reason || "")}`;
    case "swap_end": return e.abandoned ? `<span class="what">swap</span> to <b>${esc(e.model)}</b> given up for a chat, for ${jobLink(e.job)}`
      : `<span class="what">${esc(SWAP_KINDS[e.swap_kind] || "swap")}</span> to <b>${esc(e.model)}</b> in ${secs(e.seconds)} for ${jobLink(e.job)}`;
    case "foreground": return `<span class="what">foreground</span> → ${e.kind ? kindBadge(e.kind) : "none"}${e.subject ? " subject " + esc(e.subject) : ""}`;
    case "drop": return `<span class="what">dropped</span> ${kindBadge(e.kind)} ${jobLink(e.job)}: ${esc(e.reason || "")}`;
    case "device": return `<span class="what">device</span> <b>${esc(e.device)}</b> ${esc(e.change)}${e.reason ? ": " + esc(e.reason) : ""}`;
    case "node": return `<span class="what">node</span> <b>${esc(e.address)}</b> ${esc(e.change)}${e.reason ? ": " + esc(e.reason) : ""}`;
    default: return esc(e.ev);
  }
}

function renderDecisions() {
  const notable = events.filter((e) => NOTABLE.has(e.ev)).slice(-40).reverse();
  $("decisions").innerHTML = notable.length
    ? notable.map((e) => `<li class="${esc(e.ev === "swap_end" ? "swap" : e.ev)}"${e.job ? ` data-job="${esc(e.job)}"` : ""}><span class="muted">${clock(e.t)}</span> ${describe(e)}</li>`).join("")
    : `<li class="muted">no revoke, swap, foreground or pool change in the last ${KEEP_S / 60} minutes</li>`;
}

function render() {
  const t = now();
  $("clock").textContent = status ? `scheduler time ${clock(t)}` : "";
  renderDevices(t);
  if (status) { renderQueues(t); renderPolicy(); }
  renderDecisions();
}

// -- a job's story -----------------------------------------------------------------------
document.addEventListener("click", async (event) => {
  const target = event.target.closest(".job, rect.run, li[data-job]");
  if (!target) return;
  const job = target.dataset.job;
  $("story-title").textContent = job;
  $("story-text").textContent = "…";
  $("story").classList.remove("hidden");
  try {
    $("story-text").textContent = (await api(`/v1/explain/${encodeURIComponent(job)}`)).lines.join("\n");
  } catch (err) {
    $("story-text").textContent = err.message;
  }
});
$("story-close").addEventListener("click", () => $("story").classList.add("hidden"));
$("keyform").addEventListener("submit", (event) => {
  event.preventDefault();
  key = $("key").value.trim();
  sessionStorage.setItem("uniun-key", key);
  $("keyform").classList.add("hidden");
  poll();
});
$("legend").innerHTML = KINDS.map((k) => kindBadge(k)).join(" ") + ` <span class="muted">▨ swap · <span style="color:#ff4d4f">▼</span> revoke</span>`;

// one poll at a time, once a second; the timeline slides between polls
let polling = false;
setInterval(async () => { if (polling) return; polling = true; try { await poll(); } finally { polling = false; } }, POLL_MS);
setInterval(() => { if (live) renderDevices(now()); }, 250);
poll();
