// Admin pages: the fleet overview from GET /api/v1/metrics (the JSON of the Prometheus
// figures), what needs a look (rentals failed in the last day by whose failure, hosts of low
// reliability: from GET /rentals and /hosts), the relays and their load, open alerts, ingestion lag.

import { demandSection, marketplaceSection } from "./charts-money.js";
import { api } from "./api.js";
import { stackedBarChart } from "./charts.js";
import { badge, facts, h, link, num, replace, table, timeEl, wrapAt } from "./dom.js";
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

// What needs an operator's look, from the lists an admin sees (all rentals, all hosts), beside the alert rules' view.
const FAILED_WINDOW_MS = 24 * 3600 * 1000;
const RELIABILITY_MIN = 0.9; // master/services/market/tiers.py: below it a host's offers score less
const PAGE = 500;
const MAX_PAGES = 4; // the newest 2000 rentals: a failure of the last day among older ones is not counted (said so)
const ATTENTION_EVERY_MS = 60_000;

// Page n of each list read here, each call written out so that the suite checks its parameters (test_api_query).
const LIST_PAGE = {
  "/rentals": (n) => api("GET", `/rentals?limit=${PAGE}&offset=${n * PAGE}`),
  "/hosts": (n) => api("GET", `/hosts?limit=${PAGE}&offset=${n * PAGE}`),
};

/** Every item of a paged list, up to MAX_PAGES pages; `enough(items)` stops early. {items, complete}. */
async function pages(path, enough = () => false) {
  const items = [];
  for (let n = 0; n < MAX_PAGES; n += 1) {
    const body = await LIST_PAGE[path](n);
    items.push(...body.items);
    if (items.length >= body.total || body.items.length < PAGE || enough(body.items)) return { items, complete: true };
  }
  return { items, complete: false };
}

/** Failed rentals of the last 24 hours (by when they ended) and hosts below the reliability the market prefers. */
export async function attention(now = Date.now()) {
  const since = now - FAILED_WINDOW_MS;
  const ended = (r) => new Date(r.stopped_at || r.created_at).getTime();
  // Newest first by creation: a page made wholly before the window can still hold a rental that failed in it
  // (a long one), so reading stops only a week back.
  const [rentals, hosts] = await Promise.all([
    pages("/rentals", (items) => items.every((r) => new Date(r.created_at).getTime() < now - 7 * FAILED_WINDOW_MS)),
    pages("/hosts"),
  ]);
  const failed = rentals.items.filter((r) => r.state === "failed" && ended(r) >= since).sort((a, b) => ended(b) - ended(a));
  const byOwner = {};
  for (const r of failed) byOwner[r.failure_owner || "unknown"] = (byOwner[r.failure_owner || "unknown"] || 0) + 1;
  const weak = hosts.items.filter((host) => host.reliability_score !== null && host.reliability_score !== undefined
    && host.reliability_score < RELIABILITY_MIN).sort((a, b) => a.reliability_score - b.reliability_score);
  return { failed, byOwner, weak, complete: rentals.complete && hosts.complete };
}

function failedText({ failed, byOwner, complete }) {
  if (!failed.length) return complete ? "none" : "none among the newest 2000 rentals";
  const owners = Object.entries(byOwner).sort((a, b) => b[1] - a[1]).map(([owner, n]) => `${n} ${owner}'s`).join(", ");
  return `${failed.length} (${owners})${complete ? "" : " among the newest 2000 rentals"}`;
}

function attentionTables({ failed, weak }) {
  const shown = failed.slice(0, 50);
  return [
    failed.length ? table({ caption: `Failed in the last 24 hours (${failed.length}${failed.length > shown.length ? `, the newest ${shown.length}` : ""})`,
      columns: ["Rental", "Whose", "Code", "Why", "Host", "Ended"], className: "failed-rentals",
      rows: shown.map((r) => [link(`#/rentals/${encodeURIComponent(r.id)}`, r.id, { class: "rental-link" }), r.failure_owner || "—",
        r.failure_code ? h("code", {}, r.failure_code) : "—", r.failure_reason || "—",
        r.host_id ? link(`#/hosts/${encodeURIComponent(r.host_id)}`, h("span", { class: "id" }, r.host_id)) : "—", timeEl(r.stopped_at)]) }) : null,
    weak.length ? table({ caption: `Hosts below ${RELIABILITY_MIN} reliability (${weak.length})`, columns: ["Host", "Reliability", "State", "Region"],
      className: "weak-hosts",
      rows: weak.map((host) => [link(`#/hosts/${encodeURIComponent(host.id)}`, host.name || host.id),
        `${num(host.reliability_score, 2)}${host.reliability_seeded ? " (seeded history)" : ""}`, badge(host.state), host.region || "—"]) }) : null,
  ];
}

export function fleetPage(page, ctx) {
  const overview = h("div", {});
  const relays = h("div", {});
  const alerts = h("div", {});
  replace(page, heading("Fleet", "GPUs by tier and region, what failed in the last day, hosts of low reliability, relays, alerts and ingestion."), overview, marketplaceSection(ctx), demandSection(ctx),
    h("section", { "aria-labelledby": "relays-title" }, h("h2", { id: "relays-title" }, "Relays"), relays),
    h("section", { "aria-labelledby": "alerts-title" }, h("h2", { id: "alerts-title" }, "Open alerts"), alerts));

  // The figures' links scroll to their table (an in-page jump: the hash stays the page's).
  overview.addEventListener("click", (event) => {
    const jump = event.target.closest("a[href^='#failed-rentals'], a[href^='#weak-hosts']");
    if (!jump) return;
    event.preventDefault();
    const target = overview.querySelector(`table.${jump.getAttribute("href").slice(1)}`);
    if (target) {
      target.closest(".table-wrap").scrollIntoView({ block: "start" });
      target.closest(".table-wrap").focus({ preventScroll: true });
    }
  });

  let lastAttention = null;
  let attentionAt = 0;
  const showOverview = loadInto(ctx, overview, async () => {
    // The lists behind the attention figures are read once a minute, not on every 10-second refresh.
    const fresh = Date.now() - attentionAt < ATTENTION_EVERY_MS && lastAttention;
    const [m, seen] = await Promise.all([api("GET", "/metrics"), fresh ? lastAttention : attention()]);
    if (!fresh) [lastAttention, attentionAt] = [seen, Date.now()];
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
          ["Failed, last 24 h", seen.failed.length
            ? h("a", { href: "#failed-rentals", id: "failed-24h", class: "warn", dataset: { count: seen.failed.length } }, failedText(seen))
            : h("span", { id: "failed-24h", dataset: { count: 0 } }, failedText(seen))],
          [`Reliability under ${RELIABILITY_MIN}`, seen.weak.length
            ? h("a", { href: "#weak-hosts", id: "weak-hosts-count", class: "warn", dataset: { count: seen.weak.length } },
              `${seen.weak.length} host${seen.weak.length === 1 ? "" : "s"} (lowest ${num(seen.weak[0].reliability_score, 2)})`)
            : h("span", { id: "weak-hosts-count", dataset: { count: 0 } }, "none")],
          ["Alerts firing", h("span", { id: "alerts-firing" }, Object.entries(m.alerts_firing || {}).filter(([, n]) => n).map(([s, n]) => `${n} ${s}`).join(", ")
            || "none (of the alert rules)")],
          ["Ingestion lag", h("span", { id: "ingestion-lag", class: lag !== null && lag > 30 ? "warn" : "" }, lag === null || lag === undefined ? "unknown" : `${num(lag, 2)} s`)],
          ["Bus backlog", backlog ? `${backlog.undelivered} undelivered, ${backlog.pending} pending` : "unknown (the bus did not answer)"],
          ["Samples stored", ingestion.samples ? `${ingestion.samples.stored} (${ingestion.samples.duplicate} duplicate, ${ingestion.samples.rejected} rejected)` : "—"],
          ["As of", timeEl(m.generated_at)],
        ])),
      h("div", { class: "fleet-attention" }, attentionTables(seen)),
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
        return [r.relay_id, r.region, h("code", { class: "relay-url" }, wrapAt(r.url)), `${r.connections} of ${r.capacity}`,
          h("span", { class: "meter-cell" }, h("meter", { min: 0, max: 1, value: load, low: 0.7, high: 0.9, optimum: 0, "aria-label": `${r.relay_id} load` }), ` ${num(load * 100, 1)} %`),
          badge(r.status), `${num(r.age_s, 1)} s ago`];
      }),
      empty: "No relay reports: agents cannot connect." });
  });

  const showAlerts = loadInto(ctx, alerts, async () => {
    const body = await api("GET", "/alerts?state=firing&limit=100");
    return table({ caption: `Firing alerts (${body.total})`, columns: ["Severity", "Rule", "Summary", "Host", "Raised", "Seen", "Times"],
      className: "alerts",
      rows: body.items.map((a) => [badge(a.severity, "severity"), a.rule, a.summary, a.host_id ? h("code", { class: "id" }, a.host_id) : a.relay_id ?? "—",
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
