// Small SVG charts, no library: a time-series line chart (several series, axes with labels,
// a title) and a stacked bar chart. Every chart's <figure class="chart"> carries the number
// of points (or bar segments) it draws in data-points, and a text summary for screen readers.
// Colours come from the stylesheet (.series-N), never from inline styles (the CSP forbids them).

import { h, s } from "./dom.js";

const W = 520;
const H = 230;
const M = { top: 30, right: 14, bottom: 40, left: 54 };
const SERIES_COLOURS = 8;

/** About `count` round tick values covering [lo, hi], at least `minStep` apart (1: whole numbers only). */
export function niceTicks(lo, hi, count = 4, minStep = 0) {
  if (!(hi > lo)) hi = lo + 1;
  const raw = (hi - lo) / count;
  const power = 10 ** Math.floor(Math.log10(raw));
  const step = Math.max(minStep, [1, 2, 2.5, 5, 10].map((m) => m * power).find((m) => m >= raw) || raw);
  const first = Math.floor(lo / step) * step;
  const ticks = [];
  for (let v = first; v <= hi + step * 1e-9; v += step) ticks.push(Number(v.toFixed(10)));
  return { ticks, lo: Math.min(first, lo), hi: Math.max(ticks[ticks.length - 1], hi) };
}

function formatTick(v) {
  if (Math.abs(v) >= 1000) return `${Number((v / 1000).toFixed(1))}k`;
  return String(Number(v.toFixed(2)));
}

function clock(ms) {
  const d = new Date(ms);
  return d.toLocaleTimeString(undefined, { hour: "2-digit", minute: "2-digit", second: "2-digit", hour12: false });
}

function legend(names) {
  if (names.length < 2) return null;
  return h("ul", { class: "legend" }, names.map((name, i) =>
    h("li", {}, h("span", { class: `swatch series-${i % SERIES_COLOURS}`, "aria-hidden": "true" }), name)));
}

/**
 * A line chart of time series that can be redrawn with new data:
 *   const chart = new LineChart({title: "Utilization", unit: "%", yMax: 100});
 *   chart.update([{name: "GPU 0", points: [[Date.ms, value], ...]}]);
 * `minStep` keeps the y axis' ticks at least that far apart (1 for counts: no "0.25 replicas").
 */
export class LineChart {
  constructor({ title, unit = "", yLabel, xLabel = "time", yMin = 0, yMax = null, digits = 1, minStep = 0 }) {
    this.minStep = minStep;
    this.title = title;
    this.unit = unit;
    this.yLabel = yLabel || (unit ? `${title} (${unit})` : title);
    this.xLabel = xLabel;
    this.yMin = yMin;
    this.yMax = yMax;
    this.digits = digits;
    this.summary = h("p", { class: "visually-hidden" });
    this.legendSlot = h("div", {});
    this.svg = s("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", class: "chart-svg", preserveAspectRatio: "xMidYMid meet" });
    this.el = h("figure", { class: "chart chart-line", "data-points": "0", "data-title": title }, this.svg, this.legendSlot, this.summary);
    this.update([]);
  }

  update(series) {
    const points = series.reduce((n, one) => n + one.points.filter(([, v]) => v !== null && v !== undefined).length, 0);
    const xs = series.flatMap((one) => one.points.map(([t]) => t));
    const ys = series.flatMap((one) => one.points.map(([, v]) => v)).filter((v) => v !== null && v !== undefined);
    let x0 = Math.min(...xs);
    let x1 = Math.max(...xs);
    if (!Number.isFinite(x0)) {
      x1 = Date.now();
      x0 = x1 - 60_000;
    } else if (x1 - x0 < 10_000) {
      x0 = x1 - 10_000;
    }
    const dataMax = ys.length ? Math.max(...ys) : 0;
    const dataMin = ys.length ? Math.min(...ys) : 0;
    const top = Math.max(this.yMax ?? 0, dataMax * 1.1, this.yMin + 1);
    const bottom = Math.min(this.yMin, dataMin);
    const { ticks, lo, hi } = niceTicks(bottom, top, 4, this.minStep);
    const pw = W - M.left - M.right;
    const ph = H - M.top - M.bottom;
    const sx = (t) => M.left + ((t - x0) / (x1 - x0)) * pw;
    const sy = (v) => M.top + ph - ((v - lo) / (hi - lo)) * ph;

    const parts = [
      s("title", {}, this.title),
      s("text", { x: W / 2, y: 18, class: "chart-title", "text-anchor": "middle" }, this.title),
      s("text", { x: 14, y: M.top + ph / 2, class: "axis-label", "text-anchor": "middle", transform: `rotate(-90 14 ${M.top + ph / 2})` }, this.yLabel),
      s("text", { x: M.left + pw / 2, y: H - 4, class: "axis-label", "text-anchor": "middle" }, this.xLabel),
    ];
    for (const tick of ticks) {
      const y = sy(tick);
      parts.push(s("line", { x1: M.left, x2: M.left + pw, y1: y, y2: y, class: "gridline" }));
      parts.push(s("text", { x: M.left - 6, y: y + 4, class: "tick", "text-anchor": "end" }, formatTick(tick)));
    }
    for (let i = 0; i <= 3; i += 1) {
      const t = x0 + ((x1 - x0) * i) / 3;
      const x = sx(t);
      parts.push(s("line", { x1: x, x2: x, y1: M.top + ph, y2: M.top + ph + 4, class: "axis" }));
      parts.push(s("text", { x, y: M.top + ph + 16, class: "tick", "text-anchor": i === 0 ? "start" : i === 3 ? "end" : "middle" }, clock(t)));
    }
    parts.push(s("line", { x1: M.left, x2: M.left, y1: M.top, y2: M.top + ph, class: "axis" }));
    parts.push(s("line", { x1: M.left, x2: M.left + pw, y1: M.top + ph, y2: M.top + ph, class: "axis" }));

    series.forEach((one, i) => {
      let d = "";
      let pen = false;
      const dots = [];
      for (const [t, v] of one.points) {
        if (v === null || v === undefined) {
          pen = false;
          continue;
        }
        d += `${pen ? "L" : "M"}${sx(t).toFixed(1)},${sy(v).toFixed(1)}`;
        pen = true;
        dots.push([t, v]);
      }
      const cls = `series-${i % SERIES_COLOURS}`;
      if (d) parts.push(s("path", { d, class: `line ${cls}` }));
      if (dots.length === 1) parts.push(s("circle", { cx: sx(dots[0][0]), cy: sy(dots[0][1]), r: 3, class: `dot ${cls}` }));
    });
    if (points === 0) {
      parts.push(s("text", { x: M.left + pw / 2, y: M.top + ph / 2, class: "chart-empty", "text-anchor": "middle" }, "Waiting for data…"));
    }
    this.svg.replaceChildren(...parts);
    this.el.dataset.points = String(points);
    // The time (ms) of the first and last point drawn, e.g. to check a rental's chart starts within the rental.
    const drawnTimes = series.flatMap((one) => one.points.filter(([, v]) => v !== null && v !== undefined).map(([t]) => t));
    this.el.dataset.first = drawnTimes.length ? String(Math.min(...drawnTimes)) : "";
    this.el.dataset.last = drawnTimes.length ? String(Math.max(...drawnTimes)) : "";
    this.legendSlot.replaceChildren(...[legend(series.map((one) => one.name))].filter(Boolean));
    const latest = series
      .map((one) => {
        const last = [...one.points].reverse().find(([, v]) => v !== null && v !== undefined);
        return last ? `${one.name} ${Number(last[1].toFixed(this.digits))}${this.unit ? ` ${this.unit}` : ""}` : null;
      })
      .filter(Boolean);
    const summary = latest.length ? `${this.title}, latest: ${latest.join(", ")}.` : `${this.title}: no data yet.`;
    this.svg.setAttribute("aria-label", summary);
    this.summary.textContent = summary;
  }
}

/**
 * A stacked bar chart: one bar per category, one stacked segment per series.
 *   stackedBarChart({title: "GPUs by region and tier", categories: ["eu-west", ...],
 *                    series: [{name: "flagship", values: [4, 0, ...]}, ...], yLabel: "GPUs"})
 */
export function stackedBarChart({ title, categories, series, yLabel = "", xLabel = "" }) {
  const totals = categories.map((_, c) => series.reduce((sum, one) => sum + (one.values[c] || 0), 0));
  // Room above the tallest bar for its total: a fifth of the axis, so the number never reaches the title (12 px up to
  // 31 SVG units high on a phone's narrow figure, see --k in app.css).
  const { ticks, lo, hi } = niceTicks(0, Math.max(1, ...totals) * 1.2, 4, 1);
  const pw = W - M.left - M.right;
  const ph = H - M.top - M.bottom;
  const sy = (v) => M.top + ph - ((v - lo) / (hi - lo)) * ph;
  const band = pw / Math.max(1, categories.length);
  const barWidth = Math.min(64, band * 0.6);
  const parts = [
    s("title", {}, title),
    s("text", { x: W / 2, y: 18, class: "chart-title", "text-anchor": "middle" }, title),
    s("text", { x: 14, y: M.top + ph / 2, class: "axis-label", "text-anchor": "middle", transform: `rotate(-90 14 ${M.top + ph / 2})` }, yLabel),
    s("text", { x: M.left + pw / 2, y: H - 4, class: "axis-label", "text-anchor": "middle" }, xLabel),
  ];
  for (const tick of ticks) {
    const y = sy(tick);
    parts.push(s("line", { x1: M.left, x2: M.left + pw, y1: y, y2: y, class: "gridline" }));
    parts.push(s("text", { x: M.left - 6, y: y + 4, class: "tick", "text-anchor": "end" }, formatTick(tick)));
  }
  let drawn = 0;
  categories.forEach((category, c) => {
    const x = M.left + band * c + (band - barWidth) / 2;
    let base = 0;
    series.forEach((one, i) => {
      const value = one.values[c] || 0;
      if (value <= 0) return;
      const y = sy(base + value);
      const height = sy(base) - y;
      parts.push(s("rect", { x: x.toFixed(1), y: y.toFixed(1), width: barWidth.toFixed(1), height: height.toFixed(1), class: `bar series-${i % SERIES_COLOURS}` },
        s("title", {}, `${category}, ${one.name}: ${value}`)));
      base += value;
      drawn += 1;
    });
    parts.push(s("text", { x: x + barWidth / 2, y: M.top + ph + 16, class: "tick", "text-anchor": "middle" }, category));
    if (totals[c] > 0) parts.push(s("text", { x: x + barWidth / 2, y: sy(totals[c]) - 4, class: "tick", "text-anchor": "middle" }, String(totals[c])));
  });
  parts.push(s("line", { x1: M.left, x2: M.left, y1: M.top, y2: M.top + ph, class: "axis" }));
  parts.push(s("line", { x1: M.left, x2: M.left + pw, y1: M.top + ph, y2: M.top + ph, class: "axis" }));
  if (drawn === 0) parts.push(s("text", { x: M.left + pw / 2, y: M.top + ph / 2, class: "chart-empty", "text-anchor": "middle" }, "No data"));
  const summary = `${title}: ${categories.map((cat, c) => `${cat} ${totals[c]} (${series.filter((one) => one.values[c]).map((one) => `${one.name} ${one.values[c]}`).join(", ")})`).join("; ")}.`;
  const svg = s("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", class: "chart-svg", "aria-label": summary }, parts);
  return h("figure", { class: "chart chart-bars", "data-points": String(drawn), "data-title": title }, svg,
    legend(series.map((one) => one.name)) || (series.length === 1 ? h("ul", { class: "legend" }, h("li", {}, h("span", { class: "swatch series-0", "aria-hidden": "true" }), series[0].name)) : null),
    h("p", { class: "visually-hidden" }, summary));
}
