// The shoal dashboard: the jobs list; per job its status and workers (polled), loss and
// throughput charts (steps/s over the status's window: rates.js) with membership marks
// (polled, after a cursor), and the decision log and log lines (Server-Sent Events). Every
// text from the server goes in through textContent.
// Every URL is relative, so the page also works behind a reverse proxy under a path prefix.
"use strict";

const POLL_MS = 1000;
const JOBS_POLL_MS = 2000;
const MAX_LINES = 2000;
const TERMINAL = new Set(["completed", "failed", "stopped"]);

const $ = (sel) => document.querySelector(sel);

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : c === null || c === undefined ? "" : String(c));
  return e;
}

async function getJSON(path) {
  const r = await fetch(path, { headers: { Accept: "application/json" }, cache: "no-store" });
  let body = null;
  try { body = await r.json(); } catch (e) { body = null; }
  if (!r.ok) {
    const err = new Error((body && body.detail) || `${r.status} ${r.statusText}`);
    err.status = r.status;
    throw err;
  }
  return body;
}

function duration(s) {
  s = Math.round(s);
  if (s >= 3600) return `${Math.floor(s / 3600)}h${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
  if (s >= 60) return `${Math.floor(s / 60)}m${String(s % 60).padStart(2, "0")}s`;
  return `${s}s`;
}

// a number with 3 significant digits and an SI prefix, as `shoal status` writes it (950, 13.1k,
// with a unit 2.46 GFLOP)
function si(x, unit = "") {
  const gap = unit ? " " : "";
  for (const [p, scale] of [["P", 1e15], ["T", 1e12], ["G", 1e9], ["M", 1e6], ["k", 1e3]]) {
    if (Math.abs(x) >= scale) return `${Number((x / scale).toPrecision(3))}${gap}${p}${unit}`;
  }
  return `${Number(x.toPrecision(3))}${gap}${unit}`;
}

function clock(ms) {
  return new Date(ms).toLocaleTimeString([], { hour12: false });
}

// ---- health and the jobs list --------------------------------------------------------------

async function pollHealth() {
  const pill = $("#health");
  try {
    const r = await fetch("health", { cache: "no-store" });
    const h = await r.json();
    pill.textContent = h.status === "ok" ? "Redis ok" : h.redis;
    pill.className = "pill" + (h.status === "ok" ? "" : " bad");
    readOnly = h.read_only;
    $("#mode").textContent = h.read_only ? "read-only server" : "token required for changes";
  } catch (e) {
    pill.textContent = "server unreachable";
    pill.className = "pill bad";
  }
}

let selected = null;
let readOnly = true;
// the API token, asked for when a change is first made; kept in this page only (never stored)
let token = null;

async function stopJob(id) {
  const out = $("#action-result");
  if (!token) token = window.prompt("API token (SHOAL_API_TOKEN of the server; kept in this page only)");
  if (!token) return;
  if (!window.confirm(`Stop job ${id}? Its workers finish their step and exit.`)) return;
  let r;
  try {
    r = await fetch(`jobs/${encodeURIComponent(id)}/stop`, {
      method: "POST",
      headers: { Authorization: `Bearer ${token}`, "Content-Type": "application/json" },
      body: JSON.stringify({ reason: "stopped from the dashboard" }),
    });
  } catch (e) {
    out.textContent = "the server did not answer";
    return;
  }
  const body = await r.json().catch(() => ({}));
  if (r.status === 401) token = null;
  out.textContent = r.ok ? (body.requested ? "stop requested" : `already ${body.was}`) : (body.detail || `${r.status}`);
}

function progressText(j) {
  if (j.error) return "?";
  let t = `${j.step}`;
  if (j.total_steps) t += `/${j.total_steps} (${j.percent}%)`;
  return t;
}

async function pollJobs() {
  let data;
  try { data = await getJSON("jobs"); } catch (e) { return; }
  const body = $("#jobs tbody");
  body.replaceChildren();
  for (const j of data.jobs) {
    const tr = el("tr", { "data-job": j.job_id }, );
    tr.append(el("td", {}, j.job_id), el("td", {}, el("span", { class: `state ${j.state}` }, j.state)),
      el("td", {}, progressText(j)));
    if (j.job_id === selected) tr.classList.add("selected");
    tr.addEventListener("click", () => { location.hash = "job=" + encodeURIComponent(j.job_id); });
    body.append(tr);
  }
  $("#no-jobs").hidden = data.jobs.length > 0;
  if (!selected && data.jobs.length) {
    const live = data.jobs.find((j) => !TERMINAL.has(j.state)) || data.jobs[data.jobs.length - 1];
    location.hash = "job=" + encodeURIComponent(live.job_id);
  }
}

// ---- one job -------------------------------------------------------------------------------

class JobView {
  constructor(id) {
    this.id = id;
    this.enc = encodeURIComponent(id);
    this.cursor = "";
    this.t = [];
    this.step = [];
    this.loss = [];
    this.marks = [];
    // the seconds `shoal status` measures its rates over (its throughput.window_s)
    this.windowS = 30;
    this.timers = [];
    this.sources = [];
    this.stopped = false;
    this.lossChart = new LineChart($("#loss-chart"), { xLabel: "step", yLabel: "loss" });
    this.rateChart = new LineChart($("#rate-chart"), { xLabel: "time since start (s)", yLabel: "steps/s",
      colour: "#5f3dc4", yFromZero: true });
    $("#decisions").replaceChildren();
    $("#logs").replaceChildren();
    $("#marks").replaceChildren();
    $("#workers tbody").replaceChildren();
    $("#job-title").textContent = id;
    $("#action-result").textContent = "";
    $("#job").hidden = false;
    this.lossChart.setData([], []);
    this.rateChart.setData([], []);
    this.lossChart.setMarks([]);
    this.rateChart.setMarks([]);
  }

  start() {
    this.loop(() => this.pollStatus(), POLL_MS);
    this.loop(() => this.pollProgress(), POLL_MS);
    this.follow("events", "decision", (d) => this.addDecision(d), "#decisions-live");
    this.follow("logs", "log", (l) => this.addLog(l), "#logs-live");
  }

  stop() {
    this.stopped = true;
    this.timers.forEach(clearTimeout);
    this.sources.forEach((s) => s.close());
  }

  loop(fn, every) {
    const slot = this.timers.length;
    this.timers.push(null);
    const run = async () => {
      if (this.stopped) return;
      let again = every;
      try { again = (await fn()) ? 0 : every; } catch (e) { again = every * 3; }
      if (!this.stopped) this.timers[slot] = setTimeout(run, again);
    };
    run();
  }

  async pollStatus() {
    let s;
    try {
      s = await getJSON(`jobs/${this.enc}`);
    } catch (e) {
      $("#job-reason").textContent = e.message;
      return false;
    }
    const st = $("#job-state");
    st.textContent = s.state;
    st.className = `state ${s.state}`;
    $("#stop-job").hidden = readOnly || TERMINAL.has(s.state);
    const p = s.progress;
    const parts = [`step ${p.step}` + (p.total_steps ? `/${p.total_steps} (${p.percent}%)` : "")];
    if (p.epoch) parts.push(`epoch ${p.epoch}`);
    if (p.steps_per_s) parts.push(`${p.steps_per_s} steps/s`);
    if (p.samples_per_s) parts.push(`${si(p.samples_per_s)} samples/s`);
    if (p.tokens_per_s) parts.push(`${si(p.tokens_per_s)} tokens/s`);
    if (p.flops_per_s) parts.push(`${si(p.flops_per_s, "FLOP")}/s`);
    if (p.mfu !== null && p.mfu !== undefined) parts.push(`MFU ${(p.mfu * 100).toPrecision(3)} %`);
    if (s.throughput && s.throughput.window_s) this.windowS = s.throughput.window_s;
    if (p.eta_s !== null && p.eta_s !== undefined) parts.push(`ETA ${duration(p.eta_s)}`);
    if (s.no_commit) parts.push(`no commit for ${duration(s.last_commit_age_s)}`
                                + (s.stall ? ` (step ${s.stall.step} failed in ${s.stall.generations} generation(s))` : ""));
    parts.push(`generation ${s.generation}`, `world size ${s.world_size}`);
    parts.push(`coordinator ${s.leader || "none"} (epoch ${s.epoch})`);
    if (s.failures) parts.push(`${s.failures} failure(s)`);
    $("#job-progress").textContent = parts.join(" · ");
    $("#job-reason").textContent = `reason: ${s.reason}`;
    const f = $("#job-failure");
    f.hidden = !s.first_failure;
    f.textContent = s.first_failure ? `first failure: ${s.first_failure}` : "";
    const tb = (s.first_failure_traceback || "").trim();
    $("#job-traceback").hidden = !tb;
    const pre = $("#job-traceback pre");
    if (pre.textContent !== tb) pre.textContent = tb;
    const ev = $("#job-eval");
    ev.hidden = !s.eval;
    if (s.eval) {
      const metrics = Object.entries(s.eval.metrics).slice(0, 8).map(([k, v]) => `${k}=${Number(v).toPrecision(4)}`);
      ev.textContent = `last evaluation: step ${s.eval.step}: ${metrics.join(" ")}`;
    }
    const fm = $("#job-formation");
    fm.hidden = !s.formation;
    if (s.formation) {
      const next = s.formation.retry_in_ms === null ? "" : `; next try in ${(s.formation.retry_in_ms / 1000).toFixed(1)} s`;
      fm.textContent = `not forming: ${s.formation.failures} generation(s) failed in a row${next}; last error: ${s.formation.last_error}`;
    }
    const body = $("#workers tbody");
    body.replaceChildren();
    for (const w of s.workers) {
      const age = w.heartbeat_age_ms === null ? "-" : `${(w.heartbeat_age_ms / 1000).toFixed(1)} s`;
      body.append(el("tr", { "data-worker": w.worker_id },
        el("td", {}, w.worker_id), el("td", { class: w.state }, w.state),
        el("td", {}, w.rank === null ? "-" : w.rank),
        el("td", {}, w.replica_group === null || w.replica_group === undefined ? "-" : `${w.replica_group} / shard ${w.shard}`),
        el("td", {}, w.step === null ? "-" : w.step),
        el("td", {}, w.loss === null ? "-" : w.loss.toFixed(4)), el("td", {}, age),
        el("td", { class: w.straggler ? "flag" : "" }, w.straggler ? "yes" : ""),
        el("td", { class: "mono", title: w.digest || "" }, w.digest ? w.digest.slice(0, 12) : "-"),
        el("td", { title: w.placement || "" }, w.backend ? `${w.backend} / ${w.device || "-"}${w.gpu ? ` (GPU ${w.gpu})` : ""}` : "-"),
        el("td", {}, w.peak_rss_mb == null ? "-" : `${Math.round(w.peak_rss_mb)} MiB`),
        el("td", {}, w.host || "-"), el("td", {}, w.pid || "-")));
    }
    return false;
  }

  // returns true when more points wait (ask again at once)
  async pollProgress() {
    const q = this.cursor ? `?after=${encodeURIComponent(this.cursor)}` : "";
    const page = await getJSON(`jobs/${this.enc}/progress${q}`);
    if (this.stopped) return false;
    const pts = page.points;
    for (let i = 0; i < pts.step.length; i++) {
      this.t.push(pts.t_ms[i]);
      this.step.push(pts.step[i]);
      this.loss.push(pts.loss[i]);
    }
    this.cursor = page.last_id;
    this.marks = page.marks;
    this.render();
    return page.more;
  }

  render() {
    const t0 = Math.min(this.t.length ? this.t[0] : Infinity, ...this.marks.map((m) => m.ts_ms));
    const secs = this.t.map((t) => (t - t0) / 1000);
    const rates = windowRates(this.t, this.step, this.windowS);
    this.lossChart.setData(this.step, this.loss);
    this.rateChart.setData(secs, rates);
    // a mark stands at the step committed when it was decided (the report's rule)
    const stepAt = (ts) => {
      let lo = 0, hi = this.t.length;
      while (lo < hi) { const mid = (lo + hi) >> 1; if (this.t[mid] <= ts) lo = mid + 1; else hi = mid; }
      return lo > 0 ? this.step[lo - 1] : (this.step.length ? this.step[0] : 0);
    };
    this.lossChart.setMarks(this.marks.map((m) => ({ x: stepAt(m.ts_ms), kind: m.kind, label: m.label })));
    this.rateChart.setMarks(this.marks.map((m) => ({ x: (m.ts_ms - t0) / 1000, kind: m.kind, label: m.label })));
    const list = $("#marks");
    list.replaceChildren(...this.marks.map((m) =>
      el("li", { class: `mark-${m.kind}`, title: m.reason }, `${clock(m.ts_ms)} ${m.label}`)));
  }

  follow(path, kind, add, liveSel) {
    const live = $(liveSel);
    const src = new EventSource(`jobs/${this.enc}/${path}/stream`);
    this.sources.push(src);
    src.addEventListener("open", () => { live.textContent = "● live"; live.className = "live"; });
    src.addEventListener(kind, (ev) => add(JSON.parse(ev.data)));
    src.addEventListener("end", (ev) => {
      src.close();
      live.textContent = `ended (${JSON.parse(ev.data).state})`;
      live.className = "live off";
    });
    src.addEventListener("error", () => {
      if (src.readyState !== EventSource.CLOSED) { live.textContent = "reconnecting…"; live.className = "live off"; }
    });
  }

  append(box, item) {
    const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 30;
    box.append(item);
    while (box.childElementCount > MAX_LINES) box.firstElementChild.remove();
    if (atBottom) box.scrollTop = box.scrollHeight;
  }

  addDecision(d) {
    this.append($("#decisions"), el("li", { "data-kind": d.kind },
      el("span", { class: "t" }, `${clock(d.ts_ms)} g${d.generation}`),
      el("span", { class: "kind" }, `[${d.kind}]`), `${d.job_state}: ${d.reason}`));
  }

  addLog(l) {
    const when = l.ts ? clock(l.ts * 1000) : "--:--:--";
    this.append($("#logs"), el("div", { class: l.level },
      el("span", { class: "t" }, `${when} ${l.worker}`), `${l.level} ${l.msg}`));
  }
}

let view = null;

function route() {
  const m = /^#job=(.+)$/.exec(location.hash);
  const id = m ? decodeURIComponent(m[1]) : null;
  if (id === selected) return;
  selected = id;
  if (view) view.stop();
  view = null;
  document.querySelectorAll("#jobs tbody tr").forEach((tr) => tr.classList.toggle("selected", tr.dataset.job === id));
  if (id) { view = new JobView(id); view.start(); } else { $("#job").hidden = true; }
}

window.addEventListener("hashchange", route);
window.addEventListener("DOMContentLoaded", () => {
  $("#stop-job").addEventListener("click", () => { if (selected) stopJob(selected); });
});
window.addEventListener("DOMContentLoaded", () => {
  route();
  pollHealth();
  pollJobs();
  setInterval(pollHealth, 5000);
  setInterval(pollJobs, JOBS_POLL_MS);
});
