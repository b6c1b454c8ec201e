// The console's charts of money and use over days, each a section a page adds with one call:
//   spendSection(ctx)        renter: spend per day and per rental   (GET /account/spend)
//   earningsSection(ctx)     provider: earnings per day, per host    (GET /provider/earnings)
//   occupancySection(ctx)    provider: each GPU's occupancy, 7 days  (GET /provider/occupancy)
//   marketplaceSection(ctx)  admin: GMV, occupancy, hosts online     (GET /admin/marketplace)
// Amounts arrive as exact decimal strings; they are plotted as numbers and always shown through
// money.js's usd(). Days are UTC days.

import { api } from "./api.js";
import { LineChart } from "./charts.js";
import { dayChart } from "./charts-time.js";
import { h, link, table, timeEl } from "./dom.js";
import { usd } from "./money.js";
import { loadInto } from "./ui.js";

const MAX_LINES = 8; // series drawn at most in one chart; the rest are summed or listed

const money = (v) => usd(Number(v).toFixed(6));

/** The y axis' dollar labels, with as many decimals as it takes to tell them apart ($0.005 and $0.01, not $0.01 twice). */
function moneyTicks(values) {
  for (let digits = 2; digits < 6; digits += 1) {
    const labels = values.map((v) => `${v < 0 ? "−" : ""}$${Math.abs(v).toFixed(digits)}`);
    if (new Set(labels).size === labels.length) return labels;
  }
  return values.map((v) => `${v < 0 ? "−" : ""}$${Math.abs(v).toFixed(6)}`);
}
const percent = (v) => `${Number(v.toFixed(1))} %`;
const count = (v) => String(Number(v.toFixed(2)));

function section(id, title, intro, body) {
  return h("section", { class: "charts-section", "aria-labelledby": id }, h("h2", { id }, title), intro ? h("p", { class: "hint" }, intro) : null, body);
}

function loaded(ctx, load) {
  const slot = h("div", {});
  loadInto(ctx, slot, load);
  return slot;
}

export function spendSection(ctx, { days = 30 } = {}) {
  return section("spend-title", "Spend", `What your rentals were charged per UTC day over the last ${days} days, and per rental.`,
    loaded(ctx, async () => {
      const body = await api("GET", `/account/spend?days=${days}`);
      const chart = dayChart({ title: "Spend per day", days: body.days.map((d) => d.day), format: money, ticks: moneyTicks,
        series: [{ name: "Spend", values: body.days.map((d) => Number(d.amount)), bars: true }] });
      const rows = body.rentals.map((r) => [
        r.rental_id ? link(`#/rentals/${encodeURIComponent(r.rental_id)}`, r.rental_id) : "—",
        r.gpu_model ? `${r.gpu_count ?? 1}× ${r.gpu_model}${r.gpu_milli && r.gpu_milli < 1000 ? ` (${r.gpu_milli / 10} %)` : ""}` : "—",
        timeEl(r.started_at),
        usd(r.amount),
      ]);
      return h("div", { class: "chart-grid-wide" }, chart,
        table({ caption: `Spend per rental, ${days} days: ${usd(body.total)}`, columns: ["Rental", "GPUs", "Started", "Spent"], rows,
          empty: "Nothing charged in this time.", className: "spend-per-rental" }));
    }));
}

export function earningsSection(ctx, { days = 30 } = {}) {
  return section("earnings-chart-title", "Earnings over time", `What your hosts earned per UTC day over the last ${days} days.`,
    loaded(ctx, async () => {
      const body = await api("GET", `/provider/earnings?days=${days}`);
      const labels = body.days.map((d) => d.day);
      const hosts = body.hosts.slice(0, MAX_LINES - 1);
      const chart = dayChart({ title: "Earnings per day", days: labels, format: money, ticks: moneyTicks,
        series: [
          { name: "All hosts", values: body.days.map((d) => Number(d.amount)), bars: true },
          ...hosts.map((host) => ({ name: host.name || host.host_id || "no host", values: host.days.map((d) => Number(d.amount)) })),
        ] });
      return h("div", { class: "chart-grid-wide" }, chart,
        table({ caption: `Earned per host, ${days} days: ${usd(body.total)}`, columns: ["Host", "Earned"], className: "earned-per-host",
          rows: body.hosts.map((host) => [host.host_id ? link(`#/hosts/${encodeURIComponent(host.host_id)}`, host.name || host.host_id) : "—", usd(host.amount)]),
          empty: "Nothing earned in this time." }));
    }));
}

export function occupancySection(ctx, { days = 7 } = {}) {
  return section("occupancy-title", "GPU occupancy", `The share of each UTC day each GPU was rented, over the last ${days} days.`,
    loaded(ctx, async () => {
      const body = await api("GET", `/provider/occupancy?days=${days}`);
      const busiest = [...body.gpus].sort((a, b) => b.average - a.average).slice(0, MAX_LINES);
      const chart = dayChart({ title: "Occupancy per GPU", days: body.days, format: percent, yMax: 100,
        series: busiest.map((gpu) => ({ name: `${gpu.host_name} · GPU ${gpu.index}`, values: gpu.occupancy.map((v) => v * 100) })) });
      const rows = body.gpus.map((gpu) => [link(`#/hosts/${encodeURIComponent(gpu.host_id)}`, gpu.host_name), `GPU ${gpu.index}`, gpu.name, percent(gpu.average * 100)]);
      return h("div", { class: "chart-grid-wide" }, chart,
        table({ caption: `Average occupancy, ${days} days`, columns: ["Host", "GPU", "Model", "Occupied"], rows, empty: "No GPUs yet.", className: "occupancy" }));
    }));
}

export function marketplaceSection(ctx, { days = 30 } = {}) {
  return section("market-title", "Marketplace", `Per UTC day over the last ${days} days: what renters were charged (GMV), the platform's fees, how much of the fleet was rented and how many hosts were online.`,
    loaded(ctx, async () => {
      const body = await api("GET", `/admin/marketplace?days=${days}`);
      const labels = body.days.map((d) => d.day);
      return h("div", { class: "chart-grid-wide" },
        dayChart({ title: "GMV per day", days: labels, format: money, ticks: moneyTicks, series: [
          { name: "GMV", values: body.days.map((d) => Number(d.gmv)), bars: true },
          { name: "Platform fees", values: body.days.map((d) => Number(d.fees)) },
        ] }),
        dayChart({ title: "Fleet occupancy", days: labels, format: percent, yMax: 100,
          series: [{ name: "GPUs rented", values: body.days.map((d) => d.occupancy * 100) }] }),
        dayChart({ title: "Hosts online", days: labels, format: count,
          series: [
            { name: "Most at once", values: body.days.map((d) => d.hosts_online_max) },
            { name: "Mean over the day", values: body.days.map((d) => d.hosts_online) },
          ] }),
        h("p", { class: "hint" }, `GMV ${usd(body.total_gmv)}, fees ${usd(body.total_fees)} in ${days} days.`));
    }));
}

// Providers and admins: GPUs wanted per model and region, the last day and the next (GET /demand-forecast).
export function demandSection(ctx, { hours = 24 } = {}) {
  return section("demand-title", "Demand forecast", `GPUs wanted per GPU model and region: the last day, then the next ${hours} hours as forecast: the mean of the same hour over the last week, or a learned model where it did better on the last two days.`,
    loaded(ctx, async () => {
      const body = await api("GET", `/demand-forecast?hours=${hours}`);
      const start = Date.parse(body.from);
      const hour = 3_600_000;
      const busiest = [...body.series].sort((a, b) => b.peak_gpus - a.peak_gpus).slice(0, MAX_LINES / 2);
      const chart = new LineChart({ title: "GPUs wanted", yLabel: "GPUs", digits: 1 });
      chart.update(busiest.flatMap((one) => [
        { name: `${one.gpu_model} · ${one.region}`, points: one.last_day.map((v, i) => [start - (one.last_day.length - i) * hour, v]) },
        { name: `${one.gpu_model} · ${one.region}, forecast`, points: one.forecast.map((v, i) => [start + i * hour, v]) },
      ]));
      chart.el.classList.add("demand-chart");
      const method = (one) => one.method === "learned" ? "learned" : "same hour, last week";
      const rows = body.series.map((one) => [one.gpu_model, one.region, count(one.peak_gpus), timeEl(one.peak_at), method(one)]);
      return h("div", { class: "chart-grid-wide" }, chart.el,
        table({ caption: `Forecast peaks, next ${hours} hours`, columns: ["GPU model", "Region", "Peak GPUs", "At", "Method"], rows,
          empty: "No rentals in the last two weeks: nothing to forecast yet.", className: "demand" }));
    }));
}
