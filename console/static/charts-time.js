// Charts of values per UTC day, drawn with uPlot (MIT; console/static/vendor/uplot/, fetched from the
// npm registry by console/vendor/update.sh and served by the master itself, never from a CDN).
//
//   dayChart({title: "Spend per day", days: ["2026-11-01", ...], format: (v) => "$1.00",
//             series: [{name: "Spend", values: [0.5, 0, ...], bars: true}, {name: "Fees", values: [...]}],
//             ticks: (values) => labels})   // the y axis' labels, all at once (default: format each)
//
// returns a <figure class="chart chart-uplot"> which, like the SVG charts of charts.js, carries the
// number of points it draws in data-points and a text summary for screen readers. The plot takes
// the figure's width (it is redrawn when that changes, so it fits a phone's 390 px) and its text
// is at least 12 px. Colours are the stylesheet's series colours (--s0 … --s7).

import uPlot from "./vendor/uplot/uPlot.esm.js";
import { h } from "./dom.js";

const STYLESHEETS = ["/static/vendor/uplot/uPlot.min.css", "/static/charts-time.css"];
const FALLBACK_COLOURS = ["#0b5cad", "#d1495b", "#2a9d8f", "#e9a03b", "#6f42c1", "#5a8f29", "#c45a1c", "#4b6a88"];
const FONT = "12px system-ui, -apple-system, 'Segoe UI', sans-serif";
const HEIGHT = 220;
const HALF_DAY_S = 43200;

function addStylesheets() {
  for (const href of STYLESHEETS) {
    if (!document.querySelector(`link[href="${href}"]`)) document.head.append(h("link", { rel: "stylesheet", href }));
  }
}

function cssVar(name, fallback) {
  const value = getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  return value || fallback;
}

const colour = (i) => cssVar(`--s${i % 8}`, FALLBACK_COLOURS[i % 8]);

/** "2026-11-01" → the day's noon UTC in seconds (where its point or bar sits). */
export function dayTime(day) {
  return Date.parse(`${day}T00:00:00Z`) / 1000 + HALF_DAY_S;
}

/** A day (seconds, UTC) as "1 Nov": the days are UTC days, so they are labelled in UTC. */
export function dayLabel(seconds) {
  return new Date(seconds * 1000).toLocaleDateString(undefined, { day: "numeric", month: "short", timeZone: "UTC" });
}

function drawn(values) {
  return values.filter((v) => v !== null && v !== undefined && Number.isFinite(v)).length;
}

/** A chart of values per UTC day (see the top of this file). */
export function dayChart({ title, days, series, format = (v) => String(v), ticks = null, yMax = null }) {
  addStylesheets();
  const points = series.reduce((n, one) => n + drawn(one.values), 0);
  const summary = series.length && days.length
    ? `${title}, ${dayLabel(dayTime(days[0]))} to ${dayLabel(dayTime(days[days.length - 1]))} (UTC): ` +
      series.map((one) => `${one.name} ${days.map((day, i) => `${dayLabel(dayTime(day))} ${one.values[i] === null ? "none" : format(one.values[i])}`).join(", ")}`).join("; ") + "."
    : `${title}: no data.`;
  const plot = h("div", { class: "chart-plot" });
  const el = h("figure", { class: "chart chart-uplot", "data-points": String(points), "data-title": title, role: "group", "aria-label": title },
    h("figcaption", { class: "chart-caption" }, title), plot, h("p", { class: "visually-hidden" }, summary));
  const ink = cssVar("--fg", "#222");
  const grid = cssVar("--line", "#ddd");
  const data = [days.map(dayTime), ...series.map((one) => one.values.map((v) => (v === null || v === undefined ? null : v)))];
  const options = (width) => ({
    width,
    height: HEIGHT,
    scales: {
      x: { time: true, range: (u, lo, hi) => [lo - HALF_DAY_S, hi + HALF_DAY_S] },
      y: { range: (u, lo, hi) => [Math.min(0, lo), yMax ?? (hi > 0 ? hi * 1.1 : 1)] },
    },
    axes: [
      { font: FONT, stroke: ink, grid: { stroke: grid, width: 1 }, ticks: { stroke: grid }, space: 56, values: (u, splits) => splits.map(dayLabel) },
      { font: FONT, stroke: ink, grid: { stroke: grid, width: 1 }, ticks: { stroke: grid }, size: 72, values: (u, splits) => (ticks ? ticks(splits) : splits.map(format)) },
    ],
    series: [
      { label: "Day (UTC)", value: (u, v) => (v === null || v === undefined ? "—" : dayLabel(v)) },
      ...series.map((one, i) => ({
        label: one.name,
        stroke: colour(i),
        width: 2,
        fill: one.bars ? colour(i) : undefined,
        paths: one.bars ? uPlot.paths.bars({ size: [0.6, 48] }) : undefined,
        points: { show: !one.bars, size: 6 },
        value: (u, v) => (v === null || v === undefined ? "—" : format(v)),
      })),
    ],
    cursor: { drag: { x: false, y: false } },
    legend: { show: true, live: true },
  });
  let chart = null;
  const observer = new ResizeObserver(() => {
    const width = Math.floor(plot.clientWidth);
    if (width <= 0) return;
    if (!chart) chart = new uPlot(options(width), data, plot);
    else if (Math.abs(chart.width - width) > 1) chart.setSize({ width, height: HEIGHT });
  });
  observer.observe(plot);
  return el;
}
