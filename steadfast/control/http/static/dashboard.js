// The Steadfast dashboard: polls GET /admin/dashboard once a second for what is new since the last
// answer, keeps the chart points and the timeline, and draws them (canvas, no library).
"use strict";

const KEPT_POINTS = 900; // fifteen minutes at one a second, as the router keeps
const KEPT_EVENTS = 500;
const state = { since: 0, points: [], events: [], key: sessionStorage.getItem("steadfast-admin-key") || "", soakAt: null };

const $ = (id) => document.getElementById(id);

function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  row.appendChild(td);
  return td;
}

function clock(at) {
  return new Date(at * 1000).toLocaleTimeString([], { hour12: false });
}

async function poll() {
  const headers = state.key ? { Authorization: "Bearer " + state.key } : {};
  let answer;
  try {
    answer = await fetch("/admin/dashboard?since=" + state.since, { headers, cache: "no-store" });
  } catch (err) {
    $("updated").textContent = "router unreachable: " + err;
    return;
  }
  if (answer.status === 401 || answer.status === 403) {
    $("key-form").hidden = false;
    const body = await answer.json().catch(() => ({}));
    $("updated").textContent = (body.error && body.error.message) || "not allowed";
    return;
  }
  if (!answer.ok) {
    $("updated").textContent = "router answered " + answer.status;
    return;
  }
  $("key-form").hidden = true;
  const s = await answer.json();
  state.since = s.now;
  state.points = state.points.concat(s.series).slice(-KEPT_POINTS);
  state.events = state.events.concat(s.events).slice(-KEPT_EVENTS);
  render(s);
}

function render(s) {
  $("model").textContent = s.model;
  const lv = s.level;
  const badge = $("level");
  badge.textContent = "L" + lv.level;
  badge.className = "level l" + lv.level;
  badge.dataset.level = String(lv.level);
  $("level-text").textContent = lv.action + " (" + lv.mode + ", " + lv.since_s + " s)" + (lv.reason ? ": " + lv.reason : "");
  $("level-hardware").textContent = lv.hardware || "";
  $("updated").textContent = "updated " + clock(s.now);
  renderSlo(s.slo);
  renderCharts(s.slo.normal.target_ms);
  renderWorkers(s.workers);
  renderMoves(s.moves);
  renderEvents();
}

function renderSlo(slo) {
  const box = $("slo");
  box.replaceChildren();
  for (const [priority, v] of Object.entries(slo)) {
    if (!v.target_ms.ttft) continue;
    const card = document.createElement("div");
    card.className = "card";
    const title = document.createElement("b");
    title.textContent = priority + " priority";
    card.appendChild(title);
    for (const what of ["ttft", "tpot"]) {
      for (const q of ["p50", "p99"]) {
        const seen = v.observed_ms[what + "_" + q];
        const want = v.target_ms[what][q];
        const line = document.createElement("div");
        line.textContent = what.toUpperCase() + " " + q + ": " + seen.toFixed(0) + " / " + want + " ms";
        if (seen > want) line.className = "over";
        card.appendChild(line);
      }
    }
    box.appendChild(card);
  }
}

function draw(canvas, lines, opts = {}) {
  const ratio = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  canvas.width = w * ratio;
  canvas.height = h * ratio;
  const g = canvas.getContext("2d");
  g.scale(ratio, ratio);
  g.clearRect(0, 0, w, h);
  const pts = state.points;
  if (pts.length < 2) return;
  const t0 = pts[0].at, t1 = pts[pts.length - 1].at;
  let top = opts.max || 0;
  for (const l of lines) for (const p of pts) top = Math.max(top, l.value(p));
  top = top > 0 ? top * 1.1 : 1;
  const left = 40, bottom = h - 14;
  const x = (t) => left + ((t - t0) / Math.max(1e-9, t1 - t0)) * (w - left - 4);
  const y = (v) => bottom - (v / top) * (bottom - 4);
  g.font = "10px system-ui";
  g.fillStyle = "#6e6e73";
  g.fillText(top.toFixed(top < 10 ? 1 : 0), 2, 10);
  g.fillText("0", 2, bottom);
  g.fillText(clock(t0), left, h - 2);
  g.fillText(clock(t1), w - 50, h - 2);
  g.strokeStyle = "#d2d2d7";
  g.beginPath();
  g.moveTo(left, bottom);
  g.lineTo(w, bottom);
  g.stroke();
  for (const l of lines) {
    g.strokeStyle = l.color;
    g.setLineDash(l.dashed ? [4, 4] : []);
    g.lineWidth = 1.5;
    g.beginPath();
    pts.forEach((p, i) => {
      const px = x(p.at), py = y(l.value(p));
      if (i === 0) g.moveTo(px, py);
      else if (opts.step) { g.lineTo(px, y(l.value(pts[i - 1]))); g.lineTo(px, py); }
      else g.lineTo(px, py);
    });
    g.stroke();
  }
  g.setLineDash([]);
}

function renderCharts(target) {
  const ttft = target.ttft || {}, tpot = target.tpot || {};
  draw($("c-ttft"), [
    { value: (p) => p.ttft_p50_ms, color: "#0a84ff" },
    { value: (p) => p.ttft_p99_ms, color: "#c4281c" },
    { value: () => ttft.p99 || 0, color: "#6e6e73", dashed: true },
  ]);
  draw($("c-tpot"), [
    { value: (p) => p.tpot_p50_ms, color: "#0a84ff" },
    { value: (p) => p.tpot_p99_ms, color: "#c4281c" },
    { value: () => tpot.p99 || 0, color: "#6e6e73", dashed: true },
  ]);
  draw($("c-tokens"), [{ value: (p) => p.tokens_per_s, color: "#1f8a3b" }]);
  draw($("c-kv"), [{ value: (p) => p.kv_mb_per_s, color: "#8e44ad" }]);
  draw($("c-level"), [{ value: (p) => p.level, color: "#b26a00" }], { max: 5, step: true });
  draw($("c-load"), [
    { value: (p) => p.running, color: "#1f8a3b" },
    { value: (p) => p.queued, color: "#c4281c" },
  ]);
}

function renderWorkers(workers) {
  const body = $("workers").tBodies[0];
  body.replaceChildren();
  for (const w of workers) {
    const row = body.insertRow();
    row.className = "standing-" + w.standing;
    row.dataset.worker = String(w.id);
    cell(row, String(w.id));
    cell(row, w.role);
    cell(row, w.draining ? w.state + " (draining)" : w.state);
    cell(row, w.liveness);
    const kv = cell(row, "");
    const bar = document.createElement("span");
    bar.className = "bar";
    const fill = document.createElement("i");
    fill.style.width = Math.round(100 * w.kv_use) + "%";
    if (w.kv_use >= 0.9) fill.className = "high";
    bar.appendChild(fill);
    kv.appendChild(bar);
    kv.append(" " + Math.round(100 * w.kv_use) + " %");
    cell(row, String(w.running));
    cell(row, String(w.queued));
    cell(row, w.score.toFixed(2));
    cell(row, w.standing);
  }
}

function renderMoves(m) {
  const box = $("moves");
  box.replaceChildren();
  const figures = [
    ["migrations running", m.migrations_running],
    ["migrations committed", m.migrations_committed],
    ["migrations failed", m.migrations_failed],
    ["takeovers running", m.takeovers_running],
    ["takeovers done", m.takeovers_done],
  ];
  for (const [name, n] of figures) {
    const card = document.createElement("div");
    card.className = "card";
    const title = document.createElement("b");
    title.textContent = name;
    card.appendChild(title);
    card.append(String(n));
    box.appendChild(card);
  }
  const body = $("moving").tBodies[0];
  body.replaceChildren();
  for (const r of m.running) {
    const row = body.insertRow();
    cell(row, r.request);
    cell(row, String(r.from));
    cell(row, String(r.to));
    cell(row, r.reason);
  }
}

function renderEvents() {
  const body = $("events").tBodies[0];
  body.replaceChildren();
  for (const e of state.events.slice().reverse()) {
    const row = body.insertRow();
    row.className = "ev-" + e.kind;
    row.dataset.kind = e.kind;
    cell(row, clock(e.at));
    cell(row, e.kind);
    cell(row, e.worker === null ? "" : String(e.worker));
    cell(row, e.what);
    cell(row, e.reason);
  }
}

// The last soak's report (server.soak_report), asked once a minute: it changes only when a soak ends.
async function pollSoak() {
  const headers = state.key ? { Authorization: "Bearer " + state.key } : {};
  let answer;
  try {
    answer = await fetch("/admin/soak", { headers, cache: "no-store" });
  } catch (err) {
    return;
  }
  if (!answer.ok) {
    $("soak").hidden = true;
    return;
  }
  const r = await answer.json();
  if (r.written_at === state.soakAt) return;
  state.soakAt = r.written_at;
  renderSoak(r);
  if (r.timeline) {
    const png = await fetch("/admin/soak.png", { headers, cache: "no-store" });
    if (png.ok) {
      // CSP allows data: images only (no blob:): the PNG is read into a data URL.
      const reader = new FileReader();
      reader.onload = () => {
        $("soak-timeline").src = reader.result;
        $("soak-timeline").hidden = false;
      };
      reader.readAsDataURL(await png.blob());
    }
  }
}

function renderSoak(r) {
  $("soak").hidden = false;
  const verdict = $("soak-verdict");
  verdict.replaceChildren();
  const t = r.tokens;
  const lines = [
    [r.passed ? "passed" : "FAILED", "seed " + r.seed + ", " + r.duration_s + " s, " + clock(r.written_at)],
    ["requests", r.requests + ": " + r.exact + " exact, " + r.refused + " refused, " + r.failed + " failed"],
    ["tokens", t.lost + " lost, " + t.repeated + " repeated, " + t.changed + " changed"],
    ["faults", r.faults + " struck, " + r.faults_proven + " proven"],
    ["checks", r.problems.history_problems + " history, " + r.problems.node_problems + " node, " + r.problems.leaks + " leak problems"],
  ];
  for (const [title, text] of lines) {
    const card = document.createElement("div");
    card.className = "card" + (title === "FAILED" ? " over" : "");
    const b = document.createElement("b");
    b.textContent = title;
    card.appendChild(b);
    const d = document.createElement("div");
    d.textContent = text;
    card.appendChild(d);
    verdict.appendChild(card);
  }
  verdict.dataset.passed = String(r.passed);
  const body = $("soak-kinds").tBodies[0];
  body.replaceChildren();
  for (const k of r.kinds) {
    const row = body.insertRow();
    row.dataset.kind = k.kind;
    for (const key of ["kind", "struck", "proven", "streams", "p50_ms", "p99_ms", "max_ms"]) {
      cell(row, k[key] === null || k[key] === undefined ? "" : String(k[key]));
    }
  }
  const failures = $("soak-failures");
  failures.replaceChildren();
  for (const f of r.failures) {
    const li = document.createElement("li");
    li.textContent = "request " + f.request + ": " + f.error + " (" + f.tokens + ")";
    failures.appendChild(li);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    state.key = $("key").value;
    sessionStorage.setItem("steadfast-admin-key", state.key);
    poll();
    pollSoak();
  });
  poll();
  setInterval(poll, 1000);
  pollSoak();
  setInterval(pollSoak, 60000);
});
