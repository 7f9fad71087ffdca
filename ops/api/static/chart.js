// A small line chart on a <canvas>: one series, "nice" axis ticks, and vertical marks with
// rotated labels (joins, failures, leaves...), like the PNG report (ops/report.py) draws them.
// No dependencies. The canvas's data-points and data-marks attributes say what is drawn
// (the browser test reads them).
"use strict";

const MARK_STYLE = {
  start: { colour: "#2b8a3e", dash: [2, 3] },
  join: { colour: "#2b8a3e", dash: [6, 4] },
  failure: { colour: "#c92a2a", dash: [] },
  leave: { colour: "#e67700", dash: [6, 4] },
  pause: { colour: "#868e96", dash: [2, 3] },
  end: { colour: "#212529", dash: [8, 3, 2, 3] },
};

function niceStep(span, count) {
  const raw = span / Math.max(1, count);
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const norm = raw / mag;
  const nice = norm <= 1 ? 1 : norm <= 2 ? 2 : norm <= 5 ? 5 : 10;
  return nice * mag;
}

function ticks(lo, hi, count) {
  if (!(hi > lo)) { hi = lo + 1; }
  const step = niceStep(hi - lo, count);
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) {
    out.push(Math.abs(v) < step * 1e-9 ? 0 : v);
  }
  return out;
}

function fmt(v) {
  const a = Math.abs(v);
  if (a === 0) return "0";
  if (a >= 1e5 || a < 1e-3) return v.toExponential(1);
  if (a >= 100) return v.toFixed(0);
  if (a >= 10) return v.toFixed(1).replace(/\.0$/, "");
  return parseFloat(v.toPrecision(3)).toString();
}

class LineChart {
  constructor(canvas, opts) {
    this.canvas = canvas;
    this.opts = Object.assign({ colour: "#1864ab", xLabel: "", yLabel: "", yFromZero: false }, opts);
    this.xs = [];
    this.ys = [];
    this.marks = [];
    this.pending = false;
    if (window.ResizeObserver) new ResizeObserver(() => this.draw()).observe(canvas);
  }

  setData(xs, ys) {
    this.xs = xs;
    this.ys = ys;
    this.canvas.dataset.points = String(xs.length);
    this.schedule();
  }

  // marks: [{x, kind, label}]
  setMarks(marks) {
    this.marks = marks;
    const counts = {};
    for (const m of marks) counts[m.kind] = (counts[m.kind] || 0) + 1;
    this.canvas.dataset.marks = JSON.stringify(counts);
    this.canvas.dataset.failureMarks = String(counts.failure || 0);
    this.schedule();
  }

  schedule() {
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => { this.pending = false; this.draw(); });
  }

  draw() {
    const c = this.canvas, dpr = window.devicePixelRatio || 1;
    const w = c.clientWidth, h = c.clientHeight;
    if (!w || !h) return;
    if (c.width !== Math.round(w * dpr) || c.height !== Math.round(h * dpr)) {
      c.width = Math.round(w * dpr);
      c.height = Math.round(h * dpr);
    }
    const g = c.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, w, h);
    g.font = "11px system-ui, sans-serif";
    const pad = { l: 56, r: 14, t: 12, b: 34 };
    const pw = w - pad.l - pad.r, ph = h - pad.t - pad.b;

    const pts = [];
    for (let i = 0; i < this.xs.length; i++) {
      const y = this.ys[i];
      if (y !== null && y !== undefined && Number.isFinite(y)) pts.push([this.xs[i], y]);
    }
    const allX = this.xs.concat(this.marks.map((m) => m.x)).filter(Number.isFinite);
    if (!allX.length) {
      g.fillStyle = "#868e96";
      g.textAlign = "center";
      g.fillText("no committed steps yet", w / 2, h / 2);
      return;
    }
    let x0 = Math.min(...allX), x1 = Math.max(...allX);
    if (x1 === x0) { x1 = x0 + 1; }
    let y0 = pts.length ? Math.min(...pts.map((p) => p[1])) : 0;
    let y1 = pts.length ? Math.max(...pts.map((p) => p[1])) : 1;
    if (this.opts.yFromZero) y0 = Math.min(0, y0);
    if (y1 === y0) { y1 = y0 + (Math.abs(y0) || 1) * 0.1; y0 -= (y1 - y0); }
    y1 += (y1 - y0) * 0.05;  // headroom: the highest point is not drawn on the frame
    const yt = ticks(y0, y1, 5);
    y0 = Math.min(y0, yt[0]);
    y1 = Math.max(y1, yt[yt.length - 1]);
    const X = (x) => pad.l + ((x - x0) / (x1 - x0)) * pw;
    const Y = (y) => pad.t + ph - ((y - y0) / (y1 - y0)) * ph;

    // grid and axes
    g.strokeStyle = "#e9ecef";
    g.fillStyle = "#495057";
    g.lineWidth = 1;
    g.textAlign = "right";
    g.textBaseline = "middle";
    for (const v of yt) {
      const y = Math.round(Y(v)) + 0.5;
      g.beginPath(); g.moveTo(pad.l, y); g.lineTo(pad.l + pw, y); g.stroke();
      g.fillText(fmt(v), pad.l - 6, y);
    }
    g.textAlign = "center";
    g.textBaseline = "top";
    for (const v of ticks(x0, x1, Math.max(2, Math.floor(pw / 90)))) {
      const x = Math.round(X(v)) + 0.5;
      g.beginPath(); g.moveTo(x, pad.t); g.lineTo(x, pad.t + ph); g.stroke();
      g.fillText(fmt(v), x, pad.t + ph + 4);
    }
    g.strokeStyle = "#adb5bd";
    g.strokeRect(pad.l + 0.5, pad.t + 0.5, pw, ph);
    g.fillStyle = "#343a40";
    g.fillText(this.opts.xLabel, pad.l + pw / 2, pad.t + ph + 19);
    g.save();
    g.translate(12, pad.t + ph / 2);
    g.rotate(-Math.PI / 2);
    g.textBaseline = "middle";
    g.fillText(this.opts.yLabel, 0, 0);
    g.restore();

    // the series
    g.save();
    g.beginPath();
    g.rect(pad.l, pad.t, pw, ph);
    g.clip();
    g.strokeStyle = this.opts.colour;
    g.lineWidth = 1.5;
    g.beginPath();
    pts.forEach((p, i) => (i ? g.lineTo(X(p[0]), Y(p[1])) : g.moveTo(X(p[0]), Y(p[1]))));
    g.stroke();
    if (pts.length < 150) {
      g.fillStyle = this.opts.colour;
      for (const p of pts) { g.beginPath(); g.arc(X(p[0]), Y(p[1]), 2, 0, 2 * Math.PI); g.fill(); }
    }
    g.restore();

    // the marks: a vertical line each, its label rotated along it; labels of marks at about
    // the same x are set side by side (a start and the first join, a failure and its replan)
    const marks = this.marks.filter((m) => Number.isFinite(m.x)).sort((a, b) => a.x - b.x);
    let lastLabel = -Infinity;
    for (const m of marks) {
      const s = MARK_STYLE[m.kind] || MARK_STYLE.join;
      const x = Math.round(X(m.x)) + 0.5;
      // at the right edge (the end of the job) the label goes left of its line
      const lx = x + 16 > pad.l + pw ? x - 14 : Math.max(x + 3, lastLabel + 12);
      lastLabel = lx;
      g.save();
      g.strokeStyle = s.colour;
      g.setLineDash(s.dash);
      g.lineWidth = m.kind === "failure" ? 2 : 1.3;
      g.beginPath(); g.moveTo(x, pad.t); g.lineTo(x, pad.t + ph); g.stroke();
      g.setLineDash([]);
      g.fillStyle = s.colour;
      g.translate(lx, pad.t + 4);
      g.rotate(Math.PI / 2);
      g.textAlign = "left";
      g.textBaseline = "bottom";
      const tw = g.measureText(m.label).width;
      g.fillStyle = "rgba(255, 255, 255, 0.8)";
      g.fillRect(-1, -12, tw + 2, 13);
      g.fillStyle = s.colour;
      g.fillText(m.label, 0, 0);
      g.restore();
    }
  }
}

window.LineChart = LineChart;
window.MARK_STYLE = MARK_STYLE;
