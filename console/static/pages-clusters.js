// Renter pages for clusters (several hosts rented as one, over /api/v1/clusters): the list with the
// "Rent a cluster" dialog (#/clusters), and one cluster with its nodes, events and Stop (#/clusters/<id>).

import { api, query } from "./api.js";
import { badge, facts, field, h, link, replace, table, timeEl, uid } from "./dom.js";
import { compare, formatUnits, multiply, parseDecimal, usdRate } from "./money.js";
import { networkSummary } from "./clusternet.js";
import { clusterConnectPanel } from "./connect.js";
import { busy, confirmAndRent, errorBox, heading, loadInto, loading, modal, refreshed, stopWithConfirmation } from "./ui.js";
import { describeRun, portsFact, runsShort, workloadChooser } from "./workloads.js";

const ACTIVE = new Set(["pending", "starting", "running", "degraded", "stopping"]);
const MAX_NODES = 64;
// A pair's path in words (master.services.lifecycle.cluster_paths; "direct" from agents' measurements before the paths).
const PATH_WORDS = { fabric: "fabric (unencrypted)", kernel: "kernel WireGuard", "wireguard-go": "wireguard-go", relay: "through the relays", direct: "direct" };
const MAX_GPUS_PER_NODE = 64;
const GROUPS_LIMIT = 500; // GET /offers/clusters: every group (a few per model and region)

/** The exact sum of decimal strings ("0.40", "0.45" → "0.85"), or null when any is not a decimal. */
export function addDecimals(values) {
  const parsed = values.map(parseDecimal);
  if (parsed.some((p) => !p)) return null;
  const scale = Math.max(2, ...parsed.map((p) => p.scale));
  const units = parsed.reduce((sum, p) => sum + p.units * 10n ** BigInt(scale - p.scale), 0n);
  return formatUnits(units, scale);
}

/** What the whole cluster costs an hour: each node's price per GPU-hour × its GPUs, or null when none is priced. */
export function clusterPerHour(cluster) {
  const priced = (cluster.members || []).filter((m) => m.price_per_gpu_hour);
  if (!priced.length) return null;
  return addDecimals(priced.map((m) => multiply(m.price_per_gpu_hour, (m.gpu_uuids || []).length || cluster.gpus_per_node)));
}

export function nodeName(rank) {
  return `node-${rank}`;
}

/** The nodes' GPU models (several when mixed), else the words asked for. */
function modelOf(cluster) {
  const models = [...new Set((cluster.members || []).map((m) => m.gpu_model).filter(Boolean))].sort();
  return models.join(", ") || cluster.gpu_model || "any model";
}

function sizeOf(cluster) {
  const gpus = cluster.node_count * cluster.gpus_per_node;
  return `${cluster.node_count} nodes × ${cluster.gpus_per_node} GPU${cluster.gpus_per_node === 1 ? "" : "s"} (${gpus} GPUs)`;
}

/**
 * What the cluster would cost an hour on the hosts free now, from GET /offers/clusters' answer: {low, high, hosts} (the
 * cheapest and the dearest set of `nodes` distinct hosts among the groups placement could take them from), or
 * {hosts} alone (the most nodes possible now) when no group has room. Placement keeps a cluster in one region whenever
 * a region has room, so the groups across regions count only when no group is in one region.
 */
export function estimate(answer) {
  const items = answer.items || [];
  const inRegion = items.filter((i) => i.region !== null);
  const possible = inRegion.length ? inRegion : items;
  let low = null;
  let high = null;
  for (const item of possible) {
    if (low === null || compare(item.price_per_hour, low) < 0) low = item.price_per_hour;
    if (high === null || compare(high, item.price_per_hour_max) < 0) high = item.price_per_hour_max;
  }
  return { low, high, hosts: low === null ? answer.max_nodes || 0 : Math.max(...possible.map((i) => i.hosts_available)) };
}

// ---- Clusters ----------------------------------------------------------------------

export function clustersPage(page, ctx) {
  const slot = h("div", {});
  const refresh = h("button", { type: "button", class: "secondary" }, "Refresh");
  const dialog = clusterDialog(ctx);
  const rent = ctx.role === "renter" ? h("button", { type: "button", id: "rent-cluster" }, "Rent a cluster") : null;
  if (rent) rent.addEventListener("click", () => dialog.open());
  replace(page, heading("Clusters", "Several hosts rented as one: every node runs the same workload, placed together or not at all, stopped as one."),
    h("div", { class: "actions" }, rent, rent ? " " : null, refresh), slot, dialog.el);
  const load = loadInto(ctx, slot, async () => {
    const body = await api("GET", "/clusters?limit=100");
    const rows = body.items.map((c) => [
      link(`#/clusters/${encodeURIComponent(c.id)}`, c.id, { class: "cluster-link" }),
      badge(c.state),
      String(c.node_count),
      String(c.node_count * c.gpus_per_node),
      modelOf(c),
      runsShort(c),
      usdRate(clusterPerHour(c)),
      timeEl(c.started_at || c.created_at),
    ]);
    return table({ caption: `Clusters (${body.total})`, columns: ["Cluster", "State", "Nodes", "GPUs", "GPU model", "Runs", "Price / hour", "Started"],
      rows, empty: "No clusters yet. Rent one: several hosts as one, for distributed training.", className: "clusters" });
  });
  refresh.addEventListener("click", () => load());
  const timer = setInterval(() => {
    if (!dialog.el.open) load(true);
  }, 5000);
  ctx.onLeave(() => clearInterval(timer));
}

/** The "Rent a cluster" form in a modal dialog: size, model, what runs; then the whole cluster's price, then confirm. */
function clusterDialog(ctx) {
  const titleId = uid("cluster-title");
  const { el, close } = modal("rent-dialog cluster-dialog", titleId);

  function open() {
    const errors = errorBox();
    const nodes = field({ label: "Nodes", name: "node_count", type: "number", min: 2, max: MAX_NODES, step: 1, value: 2, inputmode: "numeric",
      hint: `2 to ${MAX_NODES}, each on a host of its own.` });
    const gpus = field({ label: "GPUs per node", name: "gpus_per_node", type: "number", min: 1, max: MAX_GPUS_PER_NODE, step: 1, value: 1,
      inputmode: "numeric", hint: "Whole GPUs on each node." });
    const model = field({ label: "GPU model (optional)", name: "gpu_model", placeholder: "e.g. A100", autocomplete: "off",
      hint: "Every word must be in the model name. Empty: any model." });
    const mixed = field({ label: "Allow different GPU models on different nodes", name: "allow_mixed", type: "checkbox" });
    const run = workloadChooser({});
    const review = h("button", { type: "submit", id: "review-cluster" }, "Review price");
    const cancel = h("button", { type: "button", class: "secondary" }, "Cancel");
    cancel.addEventListener("click", close);
    const form = h("form", { class: "rent-form", novalidate: true, method: "dialog" },
      h("fieldset", {}, h("legend", {}, "Size"), h("div", { class: "fieldset-pair" }, nodes.row, gpus.row), model.row, mixed.row),
      run.el,
      h("p", { class: "hint" }, "Each node gets MASTER_ADDR=node-0, MASTER_PORT, WORLD_SIZE, RANK, NODE_RANK and LOCAL_WORLD_SIZE in its environment."),
      h("div", { class: "actions" }, review, cancel));
    const confirmSlot = h("div", { class: "confirm" });
    replace(el, h("div", { class: "dialog-body" }, h("h2", { id: titleId }, "Rent a cluster"), errors.el, form, confirmSlot));

    const wholeNumber = (f, lo, hi, what) => {
      const n = Number(f.input.value);
      if (!Number.isInteger(n) || n < lo || n > hi) throw Object.assign(new Error(`Enter ${what} from ${lo} to ${hi}.`), { focus: f.input });
      return n;
    };
    const readRequest = () => {
      const request = {
        node_count: wholeNumber(nodes, 2, MAX_NODES, "the number of nodes"),
        gpus_per_node: wholeNumber(gpus, 1, MAX_GPUS_PER_NODE, "the GPUs per node"),
      };
      const words = model.input.value.trim();
      if (words) request.gpu_model = words;
      if (mixed.input.checked) request.allow_mixed = true;
      return Object.assign(request, run.read());
    };

    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      await run.ready;
      errors.clear();
      run.clear();
      let request;
      try {
        request = readRequest();
      } catch (error) {
        if (error.target && run.showAt(error.target, error.message)) return;
        errors.show(error.message);
        if (error.focus) error.focus.focus();
        return;
      }
      await busy(review, async () => {
        const params = { nodes: request.node_count, gpus_per_node: request.gpus_per_node, allow_mixed: String(Boolean(request.allow_mixed)),
          gpu_model: request.gpu_model, limit: GROUPS_LIMIT };
        let answer;
        try {
          answer = await api("GET", `/offers/clusters${query(params)}`);
        } catch (error) {
          if (error.status !== 401) errors.show(error);
          return;
        }
        const price = estimate(answer);
        if (price.low === null) {
          const room = `${price.hosts} host${price.hosts === 1 ? "" : "s"}`;
          errors.show(`Only ${room} ${price.hosts === 1 ? "has" : "have"} ${request.gpus_per_node} free GPU${request.gpus_per_node === 1 ? "" : "s"}`
            + `${request.allow_mixed ? "" : " of one model"}${request.gpu_model ? ` matching “${request.gpu_model}”` : ""} now; ask for at most ${price.hosts} node${price.hosts === 1 ? "" : "s"}`
            + `${request.allow_mixed ? "" : ", allow different models"}, or try later.`);
          nodes.input.focus();
          return;
        }
        showConfirmation(request, price);
      }, "Pricing…");
    });

    function showConfirmation(request, { low, high }) {
      const same = low === high;
      const total = same ? `${usdRate(low)} per hour` : `${usdRate(low)} to ${usdRate(high)} per hour`;
      const gpuCount = request.node_count * request.gpus_per_node;
      confirmAndRent(ctx, { form, slot: confirmSlot, backTo: review, errors, close }, {
        confirmId: "confirm-cluster", path: "/clusters", request, noun: "Cluster", page: "clusters",
        summary: [h("h3", {}, "Confirm your cluster"),
          facts([["Size", sizeOf(request)], ["GPU model", request.gpu_model || "any"],
            ["Models", request.allow_mixed ? "may differ between nodes" : "the same on every node"],
            ["What runs", h("span", { id: "confirm-cluster-runs" }, `${run.describe(request)}, on every node.`)], portsFact(request, run.templateOf)]),
          h("p", { class: "price-total" }, "Price of the whole cluster: ",
            h("strong", { id: "confirm-cluster-price", dataset: { low, high } }, total),
            h("span", { class: "hint block" }, `${gpuCount} GPUs at the prices of the hosts free now`
              + `${same ? "" : " (the cheapest and the dearest set of hosts that fit; which hosts get the nodes is decided when you confirm)"}`
              + ", billed per second for each node while it runs. The cluster's page shows its exact price."))],
        onError(error) {
          if (run.showApiError(error)) return; // shown next to the field it names
          errors.show(error);
          nodes.input.focus();
        },
      });
    }

    if (!el.open) el.showModal();
    nodes.input.focus();
  }

  return { el, open };
}

// ---- One cluster -------------------------------------------------------------------

export function clusterPage(page, ctx) {
  const [clusterId] = ctx.params;
  ctx.setTitle(`Cluster ${clusterId}`);
  const errors = errorBox();
  const summary = h("div", { class: "cluster-summary" }, loading());
  const actions = h("div", { class: "actions cluster-actions" });
  const members = h("div", {});
  const network = h("div", {});
  const events = h("div", {});
  const connect = clusterConnectPanel(clusterId, ctx.role);
  replace(page, h("p", { class: "crumbs" }, link("#/clusters", "← Clusters")), heading(`Cluster ${clusterId}`), errors.el, actions, summary, connect.el,
    h("section", { "aria-labelledby": "nodes-title" }, h("h2", { id: "nodes-title" }, "Nodes"), members),
    h("section", { "aria-labelledby": "network-title" }, h("h2", { id: "network-title" }, "Between nodes"), network),
    h("section", { "aria-labelledby": "cluster-events-title" }, h("h2", { id: "cluster-events-title" }, "Events"), events));

  const hosts = new Map(); // host id → {name, region} (a host's name and region do not change while it is rented)
  let lastState = null;
  const confirmation = { confirming: false };

  const renderActions = (cluster) => {
    if (confirmation.confirming) return;
    if (!ACTIVE.has(cluster.state) || cluster.state === "stopping") {
      actions.replaceChildren();
      return;
    }
    const stop = stopWithConfirmation(ctx, {
      slot: actions, errors, state: confirmation, id: "stop-cluster", confirmId: "confirm-stop-cluster", label: "Stop cluster",
      confirmLabel: "Yes, stop every node",
      question: `Stop this cluster? All ${cluster.node_count} nodes are stopped and their billing ends.`,
      path: `/clusters/${encodeURIComponent(clusterId)}`, what: `Cluster ${clusterId}`, refresh: () => refresh(), redraw: () => renderActions(cluster),
    });
    replace(actions, stop);
  };

  const hostOf = async (hostId) => {
    if (!hostId) return {};
    if (!hosts.has(hostId)) {
      try {
        const host = await api("GET", `/hosts/${encodeURIComponent(hostId)}`);
        hosts.set(hostId, { name: host.name, region: host.region });
      } catch (error) {
        if (error.status === 401) throw error;
        return {}; // a host gone from view: the row shows its id
      }
    }
    return hosts.get(hostId);
  };

  const refresh = async () => {
    const cluster = await refreshed(ctx, errors, async () => {
      const found = await api("GET", `/clusters/${encodeURIComponent(clusterId)}`);
      await Promise.all((found.members || []).map((m) => hostOf(m.host_id)));
      return found;
    }, () => lastState === null && summary.replaceChildren());
    if (!cluster) return;
    summary.dataset.state = cluster.state;
    replace(summary, facts([
      ["State", badge(cluster.state)],
      ["Size", sizeOf(cluster)],
      ["GPU model", modelOf(cluster)],
      ["What runs", describeRun(cluster)],
      ["Kind", cluster.kind === "interruptible" ? `interruptible, bid ${usdRate(cluster.bid_per_gpu_hour)} per GPU-hour` : "on demand"],
      ["Price per hour", h("span", { id: "cluster-price" }, usdRate(clusterPerHour(cluster)))],
      ["Private network", h("span", { id: "cluster-network" }, networkSummary(cluster.private_network))],
      ["Created", timeEl(cluster.created_at)],
      ["Started", timeEl(cluster.started_at)],
      ["Stopped", timeEl(cluster.stopped_at)],
      cluster.failure_reason ? ["Why it ended", cluster.failure_reason] : null,
    ]));
    connect.update(cluster);
    if (cluster.state !== lastState) {
      renderActions(cluster);
      lastState = cluster.state;
    }
    replace(members, table({ caption: `Nodes (${(cluster.members || []).length})`, className: "cluster-nodes",
      columns: ["Node", "Rental", "Host", "Region", "State", "GPUs"],
      empty: "No nodes placed.",
      rows: (cluster.members || []).map((m) => {
        const host = hosts.get(m.host_id) || {};
        return [
          h("span", { class: "node-name" }, nodeName(m.node_rank)),
          link(`#/rentals/${encodeURIComponent(m.rental_id)}`, m.rental_id, { class: "rental-link" }),
          host.name ? host.name : m.host_id ? h("code", {}, m.host_id) : "—",
          host.region || "—",
          badge(m.state),
          `${(m.gpu_uuids || []).length || cluster.gpus_per_node} × ${m.gpu_model || "GPU"}`,
        ];
      }) }));
    const pn = cluster.private_network || {};
    // Every pair with its path (links: fabric, kernel WireGuard, wireguard-go, the relays), and its figures once measured.
    const measured = new Map((pn.pairs || []).map((p) => [`${p.a}-${p.b}`, p]));
    const pairs = (pn.links || []).filter((l) => l.path).map((l) => ({ ...(measured.get(`${l.a}-${l.b}`) || {}), a: l.a, b: l.b, link: l.path }));
    for (const p of pn.pairs || []) if (!pairs.some((q) => q.a === p.a && q.b === p.b)) pairs.push(p);
    replace(network, table({ caption: pn.subnet ? `Measured through the private network ${pn.subnet}` : "Measured through the private network",
      className: "cluster-pairs", columns: ["Nodes", "Round trip", "Throughput", "Path", "Problem"],
      empty: pn.state === "none" ? "This cluster has no private network." : "Not measured yet: the figures come once every node has joined.",
      rows: pairs.map((p) => [
        `${nodeName(p.a)} ↔ ${nodeName(p.b)}`,
        p.rtt_ms === null || p.rtt_ms === undefined ? "—" : `${p.rtt_ms} ms`,
        p.mbit_s === null || p.mbit_s === undefined ? "—" : `${p.mbit_s} Mbit/s`,
        PATH_WORDS[p.link || p.path] || "—",
        p.error || "",
      ]) }));
    replace(events, table({ caption: "State changes", columns: ["When", "From", "To", "What happened"], className: "events", empty: "No events yet.",
      rows: (cluster.events || []).map((e) => [timeEl(e.at), e.from ?? "—", badge(e.to), e.cause ?? ""]) }));
  };
  refresh();
  const timer = setInterval(() => {
    if (lastState === null || ACTIVE.has(lastState)) refresh();
  }, 3000);
  ctx.onLeave(() => clearInterval(timer));
}
