// The status page's script: polls GET /v1/ring and GET /v1/status and redraws.
// No framework, no build step. Elements carry data-* attributes with the raw values
// they show, so a test can hold the page against the JSON.
"use strict";

const POLL_MS = 2000;
const KEY_ITEM = "shard-api-key";
const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
const short = (peer) => (peer && peer.length > 14 ? peer.slice(0, 6) + "…" + peer.slice(-6) : String(peer ?? ""));
const ms = (s, digits = 1) => (s === null || s === undefined ? "–" : (s * 1e3).toFixed(digits));
const num = (x, digits = 2) => (x === null || x === undefined ? "–" : Number(x).toFixed(digits));
const mbit = (bytesPerS) => (bytesPerS ? (bytesPerS * 8 / 1e6).toFixed(0) : "–");
const $ = (id) => document.getElementById(id);

async function getJSON(path) {
  const key = sessionStorage.getItem(KEY_ITEM);
  const r = await fetch(path, {headers: key ? {Authorization: "Bearer " + key} : {}, cache: "no-store"});
  if (r.status === 401) throw Object.assign(new Error("unauthorized"), {unauthorized: true});
  if (!r.ok && r.status !== 503) throw new Error(path + ": HTTP " + r.status);
  return r.json();
}

// -- the ring as a diagram: the coordinator, then each stage, the hops between them and the
// tail's return to the coordinator underneath.
function drawRing(info) {
  const members = info.members || [];
  const plan = (info.topology || {}).plan || {};
  const nodes = (info.topology || {}).nodes || {};
  const hops = plan.hops || [];
  if (!members.length) { $("diagram").innerHTML = '<span class="mute">no ring formed yet</span>'; return; }
  const W = 190, H = 84, GAP = 180, X0 = 20, Y0 = 34;
  const n = members.length + 1;  // the coordinator is box 0
  const width = X0 * 2 + n * W + (n - 1) * GAP, height = Y0 + H + 96;
  const x = (i) => X0 + i * (W + GAP);
  let svg = `<svg viewBox="0 0 ${width} ${height}" xmlns="http://www.w3.org/2000/svg" role="img" aria-label="ring">
    <defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse">
    <path d="M0,0 L10,5 L0,10 z" fill="#2f6fdf"/></marker></defs>`;
  svg += `<g class="coord" data-role="coordinator"><rect class="box" x="${x(0)}" y="${Y0}" width="${W}" height="${H}" rx="8"/>
    <text x="${x(0) + 12}" y="${Y0 + 24}" font-weight="600">coordinator</text>
    <text x="${x(0) + 12}" y="${Y0 + 44}">sends token ids</text>
    <text x="${x(0) + 12}" y="${Y0 + 62}">LM head, drafters, receipts</text></g>`;
  members.forEach((m, i) => {
    const bx = x(i + 1), node = nodes[m.peer_id] || {};
    const faulty = node.faulty ? ` <tspan fill="#c23b3b">faulty</tspan>` : "";
    svg += `<g class="stage" data-peer="${esc(m.peer_id)}" data-layers="${m.layers[0]}-${m.layers[1]}" data-index="${i}">
      <rect class="box" x="${bx}" y="${Y0}" width="${W}" height="${H}" rx="8"/>
      <text x="${bx + 12}" y="${Y0 + 22}" font-weight="600">stage ${i} · layers ${m.layers[0]}–${m.layers[1]}${faulty}</text>
      <text x="${bx + 12}" y="${Y0 + 41}" class="mono">${esc(short(m.peer_id))}</text>
      <text x="${bx + 12}" y="${Y0 + 59}" class="small">${esc(m.device || "?")} · ${num(m.decode_ms_per_layer, 2)} ms/layer</text>
      <text x="${bx + 12}" y="${Y0 + 75}" class="small">${esc(m.role || "")}</text></g>`;
  });
  hops.forEach((h, i) => {
    const last = i === hops.length - 1;
    const src = nodes[h.src] || {};
    // Above the arrow, the links as probed; below it, what frames took (medians over this
    // ring's recent frames, decode and prefill apart), then the path the sender's connection
    // crosses (absent until /v1/ring reports one) and the plan's send time.
    const label = `${ms(h.latency_s)} ms${h.latency_estimated ? " (est.)" : ""} · ${mbit(src.upload_bytes_per_s)} Mbit/s`;
    const t = (h.measured || {}).transfer_s || {};
    // Stamps are each machine's wall clock: a hop whose figure is below zero has ends whose
    // clocks disagree by more than the hop takes (hop_times.py); say so rather than hide it.
    const skewed = (t.decode ?? 0) < 0 || (t.prefill ?? 0) < 0 ? " · clocks differ" : "";
    const measured = h.measured ? `took ${ms(t.decode, 2)} ms (prefill ${ms(t.prefill, 1)})${skewed}` : "not measured yet";
    const planned = (h.path ? String(h.path).replace("_", " ") + " · " : "") + `send ${ms(h.round_send_s, 2)} ms/round`;
    const cls = "edge" + (h.latency_estimated ? " est" : "") + (h.path === "relayed" ? " relayed" : "");
    let path, lx, ly;
    if (!last) {
      const x1 = x(i) + W, x2 = x(i + 1), y = Y0 + H / 2;
      path = `M${x1},${y} L${x2 - 2},${y}`; lx = (x1 + x2) / 2; ly = y - 8;
    } else {  // the tail back to the coordinator, below the boxes
      const x1 = x(hops.length - 1) + W / 2, x2 = x(0) + W / 2, yb = Y0 + H, yl = yb + 46;
      path = `M${x1},${yb} C${x1},${yl} ${x2},${yl} ${x2},${yb + 2}`; lx = (x1 + x2) / 2; ly = yl + 4;
    }
    svg += `<g class="hop" data-src="${esc(h.src)}" data-dst="${esc(h.dst)}" data-latency-ms="${ms(h.latency_s, 3)}"
      data-path="${esc(h.path ?? "")}" data-transfer-decode-ms="${t.decode == null ? "" : ms(t.decode, 3)}"
      data-transfer-prefill-ms="${t.prefill == null ? "" : ms(t.prefill, 3)}">
      <path class="${cls}" d="${path}"/>
      <text class="hoplabel" x="${lx}" y="${ly}" text-anchor="middle">${esc(label)}</text>
      <text class="hoplabel measured" x="${lx}" y="${ly + (last ? 14 : 24)}" text-anchor="middle">${esc(measured)}</text>
      <text class="hoplabel small" x="${lx}" y="${ly + (last ? 28 : 38)}" text-anchor="middle">${esc(planned)}</text></g>`;
  });
  $("diagram").innerHTML = svg + "</svg>";
}

function drawNodes(info) {
  const topo = info.topology || {}, roles = topo.roles || {}, nodes = topo.nodes || {};
  const members = Object.fromEntries((info.members || []).map((m) => [m.peer_id, m]));
  const order = Object.fromEntries((info.members || []).map((m, i) => [m.peer_id, i]));
  const place = (peer) => order[peer] ?? Infinity;  // stages in ring order, then the other nodes
  const sorted = Object.entries(nodes).sort(([a], [b]) => place(a) - place(b) || (a < b ? -1 : 1));
  const replica = {};  // peer -> [ring id, stage] for stages of the rings after the first (replica rings)
  (info.rings || []).slice(1).forEach((r) => r.stages.forEach((s) => { replica[s.peer_id] = [r.ring_id, s]; }));
  const rows = sorted.map(([peer, n]) => {
    const role = roles[peer] || {}, m = members[peer], rep = replica[peer];
    const layers = m ? `${m.layers[0]}–${m.layers[1]}` : rep ? `${rep[1].layers[0]}–${rep[1].layers[1]}`
      : n.held ? `holds ${n.held[0]}–${n.held[1]}` : "–";
    const state = n.faulty ? `<span class="pill bad" title="${esc(n.faulty)}">faulty</span>`
      : m ? '<span class="pill ok">in ring</span>' : rep ? `<span class="pill ok">in ring ${rep[0]}</span>`
      : '<span class="pill">off ring</span>';
    return `<tr class="node" data-peer="${esc(peer)}" data-role="${esc(role.role || (m && m.role) || "")}">
      <td class="mono" title="${esc(peer)}">${esc(short(peer))}</td><td>${esc(role.role || (m && m.role) || "–")}</td>
      <td>${layers}</td><td>${esc(role.reason || "")}</td><td>${esc((m && m.device) || "–")}</td>
      <td>${n.decode_s_per_layer == null ? "–" : num(n.decode_s_per_layer * 1e3, 3)}</td><td>${mbit(n.upload_bytes_per_s)} / ${mbit(n.download_bytes_per_s)}</td>
      <td>${ms(n.one_way_to_coordinator_s, 2)}</td><td>${state}</td></tr>`;
  });
  $("nodes").tBodies[0].innerHTML = rows.join("") || '<tr><td colspan="9" class="mute">no node registered</td></tr>';
  const measured = topo.measured || {};
  $("measured").tBodies[0].innerHTML = ["prefill", "decode"].filter((k) => measured[k]).map((k) => {
    const m = measured[k];
    return `<tr><td>${k}</td><td>${m.rounds}</td><td>${ms(m.measured_traversal_s)} / ${ms(m.predicted_traversal_s)}</td>
      <td>${(m.measured_stage_compute_s || []).map((s) => ms(s, 2)).join(" · ")}</td>
      <td>${m.measured_transport_s === undefined ? "–" : ms(m.measured_transport_s)}</td></tr>`;
  }).join("") || '<tr><td colspan="5" class="mute">no rounds measured yet</td></tr>';
}

function spark(series, field) {
  const pts = series.map((b) => b[field]);
  const vals = pts.filter((v) => v !== null && v !== undefined);
  if (!vals.length) return "<svg></svg>";
  const max = Math.max(...vals) || 1, w = 100, h = 28;
  const d = pts.map((v, i) => `${(i / Math.max(1, pts.length - 1)) * w},${h - ((v ?? 0) / max) * (h - 2) - 1}`).join(" ");
  return `<svg viewBox="0 0 ${w} ${h}" preserveAspectRatio="none"><polyline points="${d}" fill="none" stroke="#2f6fdf" stroke-width="1.5" vector-effect="non-scaling-stroke"/></svg>`;
}

function drawStatus(st) {
  const w = st.window, jobs = st.jobs, minutes = Math.round(w.window_s / 60);
  const card = (id, value, label, raw, sparkField) =>
    `<div class="card" id="${id}" data-value="${raw ?? ""}"><div class="v">${value}</div><div class="k">${label}</div>${sparkField ? spark(w.series, sparkField) : ""}</div>`;
  $("cards").innerHTML = [
    card("tokens-per-s", num(w.tokens_per_s, 1), `tokens/s, last ${minutes} min`, w.tokens_per_s, "tokens_per_s"),
    card("ttft", ms(w.ttft_s.median, 0) + " ms", `TTFT median (p90 ${ms(w.ttft_s.p90, 0)} ms)`, w.ttft_s.median, "ttft_s"),
    card("tokens-per-traversal", num(w.tokens_per_traversal), "tokens per traversal", w.tokens_per_traversal, "tokens_per_traversal"),
    card("requests", w.requests, `requests (${w.failed} failed)`, w.requests, "requests"),
    card("running", jobs.running, `running · ${jobs.waiting} waiting for a first token`, jobs.running),
    card("tokens", w.tokens, `tokens generated (${w.prompt_tokens} prompt)`, w.tokens),
  ].join("");
  $("drafters").tBodies[0].innerHTML = Object.entries(w.drafters).map(([f, d]) =>
    `<tr class="drafter" data-drafter="${esc(f)}"><td>${esc(f)}</td><td>${d.traversals}</td><td>${d.tokens}</td><td>${num(d.tokens_per_traversal)}</td><td>${ms(d.traversal_s)}</td></tr>`
  ).join("") || '<tr><td colspan="5" class="mute">no traversals in the window</td></tr>';
  drawTrust(st.trust || {}, jobs);
  $("errorlist").innerHTML = st.errors.length ? "<ul>" + st.errors.map((e) =>
    `<li class="error"><span class="mute">${new Date(e.at * 1000).toLocaleTimeString()}</span> ${esc(e.where)}` +
    `${e.status ? ` <span class="pill bad">${e.status}</span>` : ""} ${esc(e.message)}</li>`).join("") + "</ul>"
    : '<span class="mute">none</span>';
}

function drawTrust(trust, jobs) {
  const receipts = trust.receipts || {}, audits = trust.audits, faulty = trust.faulty || {};
  const rejected = Object.entries(jobs.receipt_failures || {});
  let html = `<p id="receipts" data-enabled="${!!receipts.enabled}">Receipts: ` + (receipts.enabled
    ? `<span class="pill ok">checked on every round</span> · ${jobs.ended - rejected.reduce((a, [, n]) => a + n, 0)} of ${jobs.ended} jobs verified`
      + (rejected.length ? ` · <span class="pill bad">rejected: ${rejected.map(([c, n]) => `${esc(c)} ×${n}`).join(", ")}</span>` : "")
    : '<span class="pill warn">off</span>') + "</p>";
  if (audits) {
    html += `<p id="audits" data-audits="${audits.audits}" data-evidence="${audits.evidence}">Audits (rate ${audits.rate}):
      ${audits.audits} done, ${audits.frames_compared} frames compared, ${audits.skipped_stale + audits.skipped_gone} skipped ·
      evidence: <span class="pill ${audits.evidence ? "bad" : "ok"}">${audits.evidence}</span></p>`;
    if (audits.recent_evidence.length) {
      html += "<table><tr><th>peer</th><th>job</th><th>round</th><th>layers</th><th>outliers</th></tr>" +
        audits.recent_evidence.map((e) => `<tr><td class="mono">${esc(short(e.peer_id))}</td><td class="mono">${esc(e.job_id)}</td>
        <td>${e.round}</td><td>${e.layers[0]}–${e.layers[1]}</td><td>${e.outliers}/${e.elements}</td></tr>`).join("") + "</table>";
    }
  } else {
    html += '<p id="audits" data-audits="">Audits: <span class="pill warn">off</span> (they need receipts)</p>';
  }
  const bad = Object.entries(faulty);
  if (bad.length) html += "<p>Excluded from rings:</p><ul>" + bad.map(([p, why]) => `<li><code>${esc(short(p))}</code> ${esc(why)}</li>`).join("") + "</ul>";
  $("trustbody").innerHTML = html;
  $("trustbody").classList.remove("mute");
}

async function refresh() {
  try {
    const [info, st] = await Promise.all([getJSON("/v1/ring"), getJSON("/v1/status")]);
    $("keyform").style.display = "none";
    $("model").textContent = info.model || "";
    const rings = info.rings || [];
    $("epoch").textContent = info.epoch ? `ring epoch ${info.epoch}${rings.length > 1 ? ` · ${rings.length} rings (jobs ${rings.map((r) => r.jobs).join(" / ")})` : ""} · ${info.registered_nodes} nodes registered · wire ${info.wire_dtype || "?"}` : "";
    $("ready").textContent = info.ready ? "ready" : "no ring";
    $("ready").className = "pill " + (info.ready ? "ok" : "bad");
    $("ready").dataset.ready = String(!!info.ready);
    drawRing(info);
    drawNodes(info);
    drawStatus(st);
    document.body.dataset.rendered = String(Date.now());
  } catch (err) {
    if (err.unauthorized) { $("keyform").style.display = "block"; $("ready").textContent = "key needed"; }
    else { $("ready").textContent = "gateway unreachable"; $("ready").className = "pill bad"; }
  }
}

$("keyform").querySelector("form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem(KEY_ITEM, $("key").value.trim());
  refresh();
});
refresh();
setInterval(refresh, POLL_MS);
