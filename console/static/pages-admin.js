// Admin pages: the fleet overview from GET /api/v1/metrics (the JSON of the Prometheus
// figures), the relays and their load, open alerts, ingestion lag.

import { demandSection, marketplaceSection } from "./charts-money.js";
import { api } from "./api.js";
import { stackedBarChart } from "./charts.js";
import { badge, facts, h, num, replace, table, timeEl } from "./dom.js";
import { heading, loadInto } from "./ui.js";

const TIER_ORDER = ["flagship", "datacenter", "prosumer", "consumer", "entry"];

function ordered(values, order) {
  return [...values].sort((a, b) => {
    const ia = order.indexOf(a);
    const ib = order.indexOf(b);
    return (ia < 0 ? 99 : ia) - (ib < 0 ? 99 : ib) || String(a).localeCompare(String(b));
  });
}

/** GPUs per category and stack from the metrics' fleet.gpus rows ({tier, region, state, gpus}). */
function pivot(rows, categoryKey, stackKey, stackOrder = []) {
  const label = (v) => (v === null || v === undefined || v === "" ? "none" : String(v));
  const categories = ordered(new Set(rows.map((r) => label(r[categoryKey]))), categoryKey === "tier" ? TIER_ORDER : []);
  const stacks = ordered(new Set(rows.map((r) => label(r[stackKey]))), stackOrder);
  return {
    categories,
    series: stacks.map((stack) => ({
      name: stack,
      values: categories.map((cat) => rows.filter((r) => label(r[categoryKey]) === cat && label(r[stackKey]) === stack).reduce((n, r) => n + r.gpus, 0)),
    })),
  };
}

export function fleetPage(page, ctx) {
  const overview = h("div", {});
  const relays = h("div", {});
  const alerts = h("div", {});
  replace(page, heading("Fleet", "GPUs by tier and region, relays, alerts and ingestion."), overview, marketplaceSection(ctx), demandSection(ctx),
    h("section", { "aria-labelledby": "relays-title" }, h("h2", { id: "relays-title" }, "Relays"), relays),
    h("section", { "aria-labelledby": "alerts-title" }, h("h2", { id: "alerts-title" }, "Open alerts"), alerts));

  const showOverview = loadInto(ctx, overview, async () => {
    const m = await api("GET", "/metrics");
    const gpuRows = (m.fleet && m.fleet.gpus) || [];
    const byRegion = pivot(gpuRows, "region", "tier", TIER_ORDER);
    const byTier = pivot(gpuRows, "tier", "state", ["allocated", "available", "unavailable"]);
    const ingestion = m.ingestion || {};
    const backlog = ingestion.backlog;
    const lag = ingestion.lag_seconds;
    return h("div", {},
      h("section", { class: "card", "aria-labelledby": "fleet-title" }, h("h2", { id: "fleet-title" }, "Fleet"),
        facts([
          ["Hosts", Object.entries(m.fleet.hosts_by_state || {}).filter(([, n]) => n).map(([s, n]) => `${n} ${s}`).join(", ") || "none"],
          ["GPUs", Object.entries(m.fleet.gpus_by_state || {}).map(([s, n]) => `${n} ${s}`).join(", ")],
          ["Rentals", Object.entries(m.rentals || {}).filter(([, n]) => n).map(([s, n]) => `${n} ${s}`).join(", ") || "none"],
          ["Alerts firing", Object.entries(m.alerts_firing || {}).filter(([, n]) => n).map(([s, n]) => `${n} ${s}`).join(", ") || "none"],
          ["Ingestion lag", h("span", { id: "ingestion-lag", class: lag !== null && lag > 30 ? "warn" : "" }, lag === null || lag === undefined ? "unknown" : `${num(lag, 2)} s`)],
          ["Bus backlog", backlog ? `${backlog.undelivered} undelivered, ${backlog.pending} pending` : "unknown (the bus did not answer)"],
          ["Samples stored", ingestion.samples ? `${ingestion.samples.stored} (${ingestion.samples.duplicate} duplicate, ${ingestion.samples.rejected} rejected)` : "—"],
          ["As of", timeEl(m.generated_at)],
        ])),
      h("div", { class: "chart-grid" },
        stackedBarChart({ title: "GPUs by region and tier", categories: byRegion.categories, series: byRegion.series, yLabel: "GPUs", xLabel: "region" }),
        stackedBarChart({ title: "GPUs by tier and state", categories: byTier.categories, series: byTier.series, yLabel: "GPUs", xLabel: "tier" })));
  });

  const showRelays = loadInto(ctx, relays, async () => {
    const body = await api("GET", "/relays");
    return table({ caption: `Relays (${body.total})`, columns: ["Relay", "Region", "URL", "Connections", "Load", "Status", "Reported"],
      className: "relays",
      rows: body.items.map((r) => {
        const load = r.capacity ? r.connections / r.capacity : 0;
        return [r.relay_id, r.region, h("code", {}, r.url), `${r.connections} of ${r.capacity}`,
          h("span", { class: "meter-cell" }, h("meter", { min: 0, max: 1, value: load, low: 0.7, high: 0.9, optimum: 0, "aria-label": `${r.relay_id} load` }), ` ${num(load * 100, 1)} %`),
          badge(r.status), `${num(r.age_s, 1)} s ago`];
      }),
      empty: "No relay reports: agents cannot connect." });
  });

  const showAlerts = loadInto(ctx, alerts, async () => {
    const body = await api("GET", "/alerts?state=firing&limit=100");
    return table({ caption: `Firing alerts (${body.total})`, columns: ["Severity", "Rule", "Summary", "Host", "Raised", "Seen", "Times"],
      className: "alerts",
      rows: body.items.map((a) => [badge(a.severity, "severity"), a.rule, a.summary, a.host_id ? h("code", {}, a.host_id) : a.relay_id ?? "—",
        timeEl(a.raised_at), timeEl(a.last_seen_at), String(a.occurrences)]),
      empty: "No alerts are firing." });
  });

  const timer = setInterval(() => {
    showOverview(true);
    showRelays(true);
    showAlerts(true);
  }, 10000);
  ctx.onLeave(() => clearInterval(timer));
}
