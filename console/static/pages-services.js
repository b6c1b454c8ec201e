// Renter pages for elastic services (replicas of one container behind one endpoint, over /api/v1/services): the list
// with the "New service" dialog (#/services), and one service (#/services/<id>) with its charts over time (from
// /services/{id}/stats), cost so far, replicas, events, replica bounds, token rotation and Delete.
//
// The service token is in the answer of POST /services and POST /services/{id}/token only: the page shows it
// once, with a Copy button and a warning, and keeps it nowhere.

import { api, uuid4 } from "./api.js";
import { LineChart } from "./charts.js";
import { badge, facts, field, h, link, replace, table, timeEl, uid } from "./dom.js";
import { usd, usdRate } from "./money.js";
import { busy, confirmedAction, copyButton, copyable, errorBox, heading, loadInto, loading, modal, refreshed, stopWithConfirmation, withError } from "./ui.js";
import { describeRun, workloadChooser } from "./workloads.js";

const LIST_LIMIT = 100;
const MAX_REPLICAS = 1000; // the API's bound on either figure (a platform setting may lower max_replicas)
const MAX_GPUS = 64;
const NAME_RE = /^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$/;
const REFRESH_MS = 5000;
const ENDED = new Set(["stopped", "failed", "preempted"]);
const WINDOWS = [[15, "Last 15 minutes"], [60, "Last hour"], [360, "Last 6 hours"], [1440, "Last day"]];

/** Ready replicas of those wanted, as the list shows them: "1 / 2". */
function readyOfDesired(service) {
  const replicas = service.replicas || {};
  return `${replicas.ready ?? 0} / ${service.desired_replicas}`;
}

function replicasLine(service) {
  const r = service.replicas || {};
  return `${r.ready ?? 0} ready of ${r.live ?? 0} live (${r.starting ?? 0} starting, ${r.queued ?? 0} queued); `
    + `${service.desired_replicas} wanted, between ${service.min_replicas} and ${service.max_replicas}`;
}

/** Why the service's replicas do not start, and what happens next (``failure``: the start failures in a row). */
function failureLine(service) {
  const f = service.failure;
  const next = !f.retried ? "not retried until you fix the cause and try again"
    : service.next_attempt_at ? h("span", {}, "the next replica ", timeEl(service.next_attempt_at)) : "a replica is starting";
  return h("span", { id: "service-failure" }, h("code", {}, f.code), ` (the ${f.owner}'s): ${f.message}; `,
    `${f.consecutive} replica${f.consecutive === 1 ? "" : "s"} in a row since `, timeEl(f.since), "; ", next, ".");
}

function ruleLine(scaling) {
  const s = scaling || {};
  const cooldowns = s.scale_up_cooldown_s === undefined ? ""
    : `; waits ${s.scale_up_cooldown_s} s between scale-ups, ${s.scale_down_cooldown_s} s between scale-downs`;
  if (s.metric === "gpu_util") {
    return `GPU utilization: more replicas above ${s.threshold_pct} %, fewer below ${s.scale_down_below_pct} %, averaged over ${s.period_s} s${cooldowns}`;
  }
  return `Requests in flight: ${s.target ?? 4} per replica${cooldowns}`;
}

function gpusLine(service) {
  const tolerance = service.price_tolerance == null ? "" : `, the cheapest within ${Math.round(Number(service.price_tolerance) * 10000) / 100} %`;
  const gpus = `${service.gpu_count} × ${service.gpu_model || "any model"} per replica${tolerance}`;
  return service.kind === "interruptible" ? `${gpus}, interruptible, bid ${usdRate(service.bid_per_gpu_hour)} per GPU-hour` : `${gpus}, on demand`;
}

/** The token, shown once, with the endpoint and how a client calls it (the create dialog and "Rotate token"). */
function tokenPanel(service, token) {
  const titleId = uid("token-title");
  const endpoint = service.endpoint_url;
  return h("section", { class: "token-panel", "aria-labelledby": titleId },
    h("h3", { id: titleId }, "The service token"),
    h("p", { class: "warn-note", id: "token-warning" }, h("strong", {}, "Copy it now: it is shown only this once. "),
      "The console keeps no copy and the master keeps only its hash; “Rotate token” on the service's page makes a new one."),
    copyable(token, { id: "service-token", label: "the service token", anywhere: true }),
    h("p", { class: "connect-label" }, "Clients send it as a bearer key to the endpoint:"),
    copyable(endpoint, { id: "token-endpoint", label: "the endpoint URL", anywhere: true }),
    h("p", { class: "connect-label" }, "For example:"),
    copyable(`curl -H "Authorization: Bearer ${token}" ${endpoint}v1/models`, { id: "token-curl", label: "the curl command", anywhere: true }),
    h("p", { class: "connect-label" }, "An OpenAI client takes base_url:"),
    copyable(`${endpoint}v1`, { id: "token-base-url", label: "the OpenAI base URL", anywhere: true }));
}

/** The endpoint's path in a table cell, with a button that copies the whole URL. */
function endpointCell(service) {
  const path = h("code", { class: "endpoint-path", title: service.endpoint_url }, service.endpoint_path || service.endpoint_url);
  const { button, status } = copyButton(service.endpoint_url, path, { label: `the endpoint URL of ${service.name}` });
  return h("span", { class: "endpoint-cell" }, path, " ", button, status);
}

// ---- Services ----------------------------------------------------------------------

export function servicesPage(page, ctx) {
  const slot = h("div", {});
  const refresh = h("button", { type: "button", class: "secondary" }, "Refresh");
  const deleted = field({ label: "Show deleted services", name: "deleted", type: "checkbox" });
  const dialog = serviceDialog(ctx, () => load(true));
  const create = ctx.role === "renter" ? h("button", { type: "button", id: "create-service" }, "New service") : null;
  if (create) create.addEventListener("click", () => dialog.open());
  replace(page, heading("Services", "A model server as a service: replicas of one container behind one endpoint, added and removed with the load."),
    h("div", { class: "actions" }, create, refresh), deleted.row, slot, dialog.el);
  const load = loadInto(ctx, slot, async () => {
    const body = await api("GET", `/services?limit=${LIST_LIMIT}${deleted.input.checked ? "&deleted=true" : ""}`);
    const rows = body.items.map((s) => [
      h("span", {}, link(`#/services/${encodeURIComponent(s.id)}`, s.name, { class: "service-link" }), h("code", { class: "hint block" }, s.id)),
      badge(s.state),
      h("span", { class: "service-ready", title: replicasLine(s) }, readyOfDesired(s)),
      endpointCell(s),
      usd(s.cost_so_far),
    ]);
    return table({ caption: `Services (${body.total})`, columns: ["Service", "State", "Ready / wanted", "Endpoint", "Cost so far"],
      rows, empty: "No services yet. Make one: a model server that scales with its load, behind one endpoint.", className: "services" });
  });
  refresh.addEventListener("click", () => load());
  deleted.input.addEventListener("change", () => load());
  const timer = setInterval(() => {
    if (!dialog.el.open) load(true);
  }, REFRESH_MS);
  ctx.onLeave(() => clearInterval(timer));
}

/** The "New service" form in a modal dialog; once made, the token is shown there, once. */
function serviceDialog(ctx, onMade) {
  const titleId = uid("service-title");
  const { el, close } = modal("rent-dialog service-dialog", titleId);
  el.addEventListener("close", () => onMade());

  function open() {
    const errors = errorBox();
    const name = withError(field({ label: "Name", name: "name", placeholder: "e.g. chat-7b", autocomplete: "off", spellcheck: "false",
      autocapitalize: "none", hint: "Lower-case letters, digits and inner hyphens, up to 63." }));
    const run = workloadChooser({}, { containersOnly: true, preferred: "vllm" });
    const port = withError(field({ label: "Port", name: "port", type: "number", min: 1, max: 65535, step: 1, inputmode: "numeric",
      hint: "The port it serves its API on. With a template, empty: the template's own port." }));
    const health = withError(field({ label: "Health check path", name: "health_path", value: "/health", autocomplete: "off", spellcheck: "false",
      hint: "GET on it answers 2xx once a replica is ready for requests." }));
    const gpus = withError(field({ label: "GPUs per replica", name: "gpu_count", type: "number", min: 1, max: MAX_GPUS, step: 1, value: 1, inputmode: "numeric" }));
    const model = field({ label: "GPU model (optional)", name: "gpu_model", placeholder: "e.g. A100", autocomplete: "off",
      hint: "Every word must be in the model name. Empty: any model." });
    const tolerance = withError(field({ label: "Price tolerance, % (optional)", name: "price_tolerance", inputmode: "decimal", autocomplete: "off",
      placeholder: "e.g. 5", hint: "Replicas go to the cheapest GPUs that fit; the placer may pick ones up to this much dearer. Empty: the marketplace's default (5 % without a model)." }));
    const low = withError(field({ label: "Fewest replicas", name: "min_replicas", type: "number", min: 0, max: MAX_REPLICAS, step: 1, value: 1,
      inputmode: "numeric", hint: "0 lets it sleep: the first request then waits for a replica." }));
    const high = withError(field({ label: "Most replicas", name: "max_replicas", type: "number", min: 1, max: MAX_REPLICAS, step: 1, value: 2, inputmode: "numeric" }));
    const target = withError(field({ label: "Requests in flight per replica", name: "target", type: "number", min: 0.1, max: 10000, step: "any",
      value: 4, inputmode: "decimal", hint: "Above this, another replica is added; well below it, one is taken away." }));
    const submit = h("button", { type: "submit", id: "make-service" }, "Create service");
    const cancel = h("button", { type: "button", class: "secondary" }, "Cancel");
    cancel.addEventListener("click", close);
    const form = h("form", { class: "rent-form service-form", novalidate: true, method: "dialog" },
      name.row, run.el, h("div", { class: "fieldset-pair" }, port.row, health.row),
      h("fieldset", {}, h("legend", {}, "Each replica"), h("div", { class: "fieldset-pair" }, gpus.row, model.row), tolerance.row),
      h("fieldset", {}, h("legend", {}, "Scaling"), h("div", { class: "fieldset-pair" }, low.row, high.row), target.row),
      h("p", { class: "hint" }, "Each replica is a rental, billed per second while it runs; it waits in the queue while no host is free."),
      h("div", { class: "actions" }, submit, cancel));
    const body = h("div", { class: "dialog-body" }, h("h2", { id: titleId }, "New service"), errors.el, form);
    replace(el, body);
    let sent = null; // {key, json}: the same request sent again (after a lost answer) keeps its Idempotency-Key

    const fail = (f, message) => Object.assign(new Error(message), { field: f });
    const whole = (f, lo, hi, what) => {
      const n = Number(f.input.value);
      if (f.input.value.trim() === "" || !Number.isInteger(n) || n < lo || n > hi) throw fail(f, `Enter ${what}: a whole number from ${lo} to ${hi}.`);
      return n;
    };
    const readRequest = () => {
      const request = { name: name.input.value.trim() };
      if (!NAME_RE.test(request.name)) throw fail(name, "Enter a name of lower-case letters, digits and inner hyphens, e.g. chat-7b.");
      Object.assign(request, run.read());
      if (port.input.value.trim() !== "" || request.workload) {
        request.port = whole(port, 1, 65535, "the port it serves");
      } else {
        const ports = (run.templateOf(request.template) || {}).ports || [];
        if (ports.length !== 1) throw fail(port, `Template ${request.template} serves ${ports.length ? `ports ${ports.join(", ")}` : "no port"}: enter the one the service answers on.`);
        request.port = ports[0];
      }
      if (request.workload) {
        const ports = request.workload.ports || [];
        if (!ports.includes(request.port)) request.workload.ports = [...ports, request.port]; // the port it serves is one it declares
      }
      const path = health.input.value.trim();
      if (!path.startsWith("/")) throw fail(health, "Enter a path that starts with /, e.g. /health.");
      request.health_path = path;
      request.gpu_count = whole(gpus, 1, MAX_GPUS, "the GPUs per replica");
      const words = model.input.value.trim();
      if (words) request.gpu_model = words;
      const percent = tolerance.input.value.trim().replace(/\s*%$/, "");
      if (percent !== "") {
        // Percent with up to two decimals, 0 to 1000, sent as the API's fraction ("5" → "0.05"): exact, no float.
        const m = /^(\d{1,4})(?:\.(\d{1,2}))?$/.exec(percent);
        const hundredths = m ? Number(m[1]) * 100 + Number((m[2] || "").padEnd(2, "0")) : NaN;
        if (!m || hundredths > 100000) throw fail(tolerance, "Enter the price tolerance in percent: 0 to 1000, at most two decimals, e.g. 5.");
        request.price_tolerance = (hundredths / 10000).toFixed(4).replace(/0+$/, "").replace(/\.$/, "");
      }
      request.min_replicas = whole(low, 0, MAX_REPLICAS, "the fewest replicas");
      request.max_replicas = whole(high, 1, MAX_REPLICAS, "the most replicas");
      if (request.min_replicas > request.max_replicas) throw fail(high, "The most replicas must be at least the fewest.");
      const inflight = Number(target.input.value);
      if (target.input.value.trim() === "" || !(inflight >= 0.1 && inflight <= 10000)) throw fail(target, "Enter the requests in flight per replica: 0.1 to 10000.");
      request.scaling = { metric: "inflight", target: inflight };
      return request;
    };

    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      await run.ready;
      errors.clear();
      run.clear();
      for (const f of [name, port, health, gpus, tolerance, low, high, target]) f.clear();
      let request;
      try {
        request = readRequest();
      } catch (error) {
        if (error.target && run.showAt(error.target, error.message)) return;
        if (error.field) {
          error.field.show(error.message);
          error.field.input.focus();
          return;
        }
        errors.show(error.message);
        return;
      }
      const json = JSON.stringify(request);
      if (!sent || sent.json !== json) sent = { key: uuid4(), json };
      await busy(submit, async () => {
        let service;
        try {
          service = await api("POST", "/services", { body: request, headers: { "Idempotency-Key": sent.key } });
        } catch (error) {
          if (error.status === 401) return;
          if (run.showApiError(error)) return; // shown next to the field it names
          const at = { invalid_service_name: name, port_not_served: port, invalid_health_path: health, invalid_replica_bounds: high }[error.code];
          if (at) {
            at.show(error.message);
            at.input.focus();
          } else {
            errors.show(error);
          }
          return;
        }
        ctx.notify(`Service ${service.name} created.`);
        showMade(service);
      }, "Creating…");
    });

    function showMade(service) {
      const go = h("button", { type: "button", id: "open-service" }, "I have copied it: open the service");
      go.addEventListener("click", () => {
        close();
        location.hash = `#/services/${encodeURIComponent(service.id)}`;
      });
      const done = h("button", { type: "button", class: "secondary" }, "Close");
      done.addEventListener("click", close);
      const panel = service.token
        ? tokenPanel(service, service.token)
        : h("p", { class: "warn-note" }, "This request made the service before, and its token was shown then. “Rotate token” on its page makes a new one.");
      replace(body, h("h2", { id: titleId }, `Service ${service.name} created`),
        facts([["Service", h("code", { id: "made-service-id" }, service.id)], ["Replicas", replicasLine(service)], ["What runs", describeRun(service)]]),
        panel, h("div", { class: "actions" }, go, done));
      (body.querySelector(".token-panel button") || go).focus();
    }

    if (!el.open) el.showModal();
    name.input.focus();
  }

  return { el, open };
}

// ---- One service -------------------------------------------------------------------

/**
 * The charts of GET /services/{id}/stats: replicas (live, ready), requests/s, latency p50/p99, errors and retries,
 * each from the step in which the service was made (`since`, ms) on: nothing is drawn for before it existed.
 */
function serviceCharts() {
  const charts = {
    replicas: new LineChart({ title: "Replicas", yLabel: "replicas", digits: 0, minStep: 1 }),
    requests: new LineChart({ title: "Requests per second", yLabel: "requests/s", digits: 2, minStep: 0.5 }),
    latency: new LineChart({ title: "Latency", unit: "ms", digits: 0, minStep: 1 }),
    errors: new LineChart({ title: "Errors and retries", yLabel: "per point", digits: 0, minStep: 1 }),
  };
  const update = (stats, since) => {
    const points = stats.points.filter((p) => Date.parse(p.at) + stats.step_s * 1000 > since);
    const series = (name, key) => ({ name, points: points.map((p) => [Date.parse(p.at), p[key]]) });
    charts.replicas.update([series("Live", "replicas"), series("Ready", "ready")]);
    charts.requests.update([series("Requests/s", "requests_per_s")]);
    charts.latency.update([series("p50", "p50_ms"), series("p99", "p99_ms")]);
    charts.errors.update([series("Errors", "errors"), series("Retries", "retries")]);
  };
  return { el: h("div", { class: "chart-grid service-charts" }, Object.values(charts).map((c) => c.el)), update };
}

export function servicePage(page, ctx) {
  const [serviceId] = ctx.params;
  ctx.setTitle(`Service ${serviceId}`);
  const errors = errorBox();
  const title = heading(`Service ${serviceId}`);
  const summary = h("div", { class: "service-summary" }, loading());
  const actions = h("div", { class: "actions service-actions" });
  const tokenSlot = h("div", { "aria-live": "polite" });
  const charts = serviceCharts();
  const chartWindow = field({ label: "Show", name: "minutes", type: "select", value: 60, options: WINDOWS });
  const chartNote = h("p", { class: "hint", id: "stats-note" });
  const bounds = h("div", {});
  const replicas = h("div", {});
  const events = h("div", {});
  replace(page, h("p", { class: "crumbs" }, link("#/services", "← Services")), title, errors.el, actions, summary, tokenSlot,
    h("section", { "aria-labelledby": "service-charts-title" }, h("h2", { id: "service-charts-title" }, "Over time"),
      h("div", { class: "chart-window" }, chartWindow.row), charts.el, chartNote),
    h("section", { "aria-labelledby": "bounds-title" }, h("h2", { id: "bounds-title" }, "Replica bounds"), bounds),
    h("section", { "aria-labelledby": "replicas-title" }, h("h2", { id: "replicas-title" }, "Replicas"), replicas),
    h("section", { "aria-labelledby": "service-events-title" }, h("h2", { id: "service-events-title" }, "Events"), events));

  let last = null;
  let showFailed = false; // failed replicas are counted; listed only on demand (a service that cannot start has dozens)
  const confirmation = { confirming: false };

  const renderActions = (service) => {
    if (confirmation.confirming) return;
    if (service.state === "deleted") {
      actions.replaceChildren();
      return;
    }
    const rotate = confirmedAction({
      slot: actions, errors, state: confirmation, id: "rotate-token", confirmId: "confirm-rotate-token", label: "Rotate token", buttonClass: "secondary",
      confirmLabel: "Yes, make a new token", keepLabel: "Keep the current one", busyLabel: "Rotating…",
      question: "Make a new token? The current one stops working at once: every client needs the new one.",
      redraw: () => renderActions(service),
      act: async () => {
        const answer = await api("POST", `/services/${encodeURIComponent(serviceId)}/token`);
        const hide = h("button", { type: "button", class: "secondary", id: "hide-token" }, "I have copied it: hide the token");
        hide.addEventListener("click", () => {
          tokenSlot.replaceChildren();
          actions.querySelector("button").focus();
        });
        replace(tokenSlot, h("div", { class: "card" }, tokenPanel(service, answer.token), h("div", { class: "actions" }, hide)));
        ctx.notify(`A new token for ${service.name}: the old one stopped working.`);
        confirmation.confirming = false;
        renderActions(service);
        tokenSlot.querySelector("button").focus();
        refresh(); // the events say "token replaced" now, not at the next poll
      },
    });
    const remove = stopWithConfirmation(ctx, {
      slot: actions, errors, state: confirmation, id: "delete-service", confirmId: "confirm-delete-service", label: "Delete service",
      confirmLabel: "Yes, delete it", keepLabel: "Keep it", busyLabel: "Deleting…",
      question: `Delete ${service.name}? Its ${service.replicas.live} replica${service.replicas.live === 1 ? "" : "s"} stop, their billing ends and its endpoint closes.`,
      path: `/services/${encodeURIComponent(serviceId)}`, what: `Service ${service.name}`, refresh: () => refresh(), redraw: () => renderActions(service),
    });
    if (!service.failure) {
      replace(actions, rotate, remove);
      return;
    }
    // Setting the bounds again (unchanged) ends the back-off: PUT …/replicas is the renter asking again.
    const retry = h("button", { type: "button", id: "resume-service" }, "Try again now");
    retry.addEventListener("click", () => busy(retry, async () => {
      try {
        const body = { min_replicas: service.min_replicas, max_replicas: service.max_replicas };
        const resumed = await api("PUT", `/services/${encodeURIComponent(serviceId)}/replicas`, { body });
        ctx.notify(`${resumed.name}: replicas are rented again.`);
        renderActions(resumed);
        show(resumed, false);
      } catch (error) {
        if (error.status !== 401) errors.show(error);
      }
    }, "Trying…"));
    replace(actions, retry, rotate, remove);
  };

  const renderBounds = (service) => {
    if (service.state === "deleted") {
      replace(bounds, h("p", { class: "hint" }, "A deleted service has no replicas."));
      return;
    }
    if (bounds.contains(document.activeElement)) return; // the user is typing: a refresh leaves the form alone
    const formErrors = errorBox();
    const low = withError(field({ label: "Fewest", name: "min_replicas", type: "number", min: 0, max: MAX_REPLICAS, step: 1, value: service.min_replicas, inputmode: "numeric" }));
    const high = withError(field({ label: "Most", name: "max_replicas", type: "number", min: 1, max: MAX_REPLICAS, step: 1, value: service.max_replicas, inputmode: "numeric" }));
    const save = h("button", { type: "submit", id: "scale-service" }, "Set bounds");
    const form = h("form", { class: "scale-form", novalidate: true }, h("div", { class: "fieldset-pair scale-fields" }, low.row, high.row),
      h("p", { class: "hint" }, "The autoscaler keeps the replicas between these, and moves into new bounds at once."), formErrors.el,
      h("div", { class: "actions" }, save));
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      formErrors.clear();
      low.clear();
      high.clear();
      const body = { min_replicas: Number(low.input.value), max_replicas: Number(high.input.value) };
      if (low.input.value.trim() === "" || !Number.isInteger(body.min_replicas) || body.min_replicas < 0) {
        low.show("Enter a whole number, 0 or more.");
        low.input.focus();
        return;
      }
      if (high.input.value.trim() === "" || !Number.isInteger(body.max_replicas) || body.max_replicas < Math.max(1, body.min_replicas)) {
        high.show("Enter a whole number, at least 1 and at least the fewest.");
        high.input.focus();
        return;
      }
      await busy(save, async () => {
        try {
          const scaled = await api("PUT", `/services/${encodeURIComponent(serviceId)}/replicas`, { body });
          ctx.notify(`${scaled.name} keeps ${scaled.min_replicas} to ${scaled.max_replicas} replicas; ${scaled.desired_replicas} wanted now.`);
          save.blur();
          show(scaled, true);
        } catch (error) {
          if (error.status !== 401) formErrors.show(error);
        }
      }, "Saving…");
    });
    replace(bounds, form);
  };

  const show = (service, boundsToo) => {
    last = service;
    title[0].textContent = `Service ${service.name}`;
    ctx.setTitle(`Service ${service.name}`);
    summary.dataset.state = service.state;
    replace(summary, facts([
      ["State", badge(service.state)],
      service.failure ? [service.state === "failing" ? "Failing" : "Not starting", failureLine(service)] : null,
      ["Endpoint", service.state !== "deleted" ? copyable(service.endpoint_url, { id: "service-endpoint", label: "the endpoint URL", anywhere: true })
        : h("span", {}, h("code", {}, service.endpoint_url), " (closed)")],
      ["What runs", `${describeRun(service)}, port ${service.port}; health check GET ${service.health_path}`],
      ["Replicas", h("span", { id: "service-replicas" }, replicasLine(service))],
      ["Scaling", ruleLine(service.scaling)],
      ["GPUs", gpusLine(service) + (service.requirements ? `, where ${service.requirements}` : "")],
      ["Cost so far", h("span", { id: "service-cost", dataset: { amount: service.cost_so_far ?? "" } }, usd(service.cost_so_far))],
      ["Token", h("span", {}, h("code", { id: "service-token-prefix" }, `${service.token_prefix}…`), " (clients send it as Authorization: Bearer)")],
      ["Created", timeEl(service.created_at)],
      service.deleted_at ? ["Deleted", timeEl(service.deleted_at)] : null,
    ]));
    if (boundsToo) renderBounds(service);
    const failed = service.replicas?.failed ?? 0;
    const toggle = failed === 0 ? null : h("button", { type: "button", class: "secondary", id: "toggle-failed-replicas", "aria-pressed": String(showFailed) },
      showFailed ? `Hide the ${failed} failed` : `Show ${failed} failed`);
    toggle?.addEventListener("click", () => {
      showFailed = !showFailed;
      refresh();
    });
    replace(replicas, table({ caption: `Replica rentals (${(service.replica_rentals || []).length})`, className: "service-replicas",
      columns: ["Rental", "State", "Ready", "GPU model", "Price / GPU-hour", "Created", "Why it ended"], empty: failed ? "No live replica." : "No replicas yet.",
      rows: (service.replica_rentals || []).map((r) => [
        link(`#/rentals/${encodeURIComponent(r.rental_id)}`, r.rental_id, { class: "rental-link" }),
        badge(r.state),
        r.ready ? "ready" : "not yet",
        r.gpu_model || "—",
        usdRate(r.price_per_gpu_hour),
        timeEl(r.created_at),
        r.failure_reason || "",
      ]) }), toggle ? h("div", { class: "actions" }, toggle) : null);
    replace(events, table({ caption: "Scaling and changes, newest last", className: "events service-events", columns: ["When", "What", "Replicas", "Why"],
      empty: "No events yet.",
      rows: (service.events || []).map((e) => [timeEl(e.at), badge(e.kind, "event"), String(e.replicas), e.cause ?? ""]) }));
  };

  const loadStats = async (service) => {
    const stats = await api("GET", `/services/${encodeURIComponent(serviceId)}/stats?minutes=${chartWindow.input.value}`);
    if (!ctx.alive()) return;
    charts.update(stats, Date.parse(service.created_at));
    chartNote.textContent = `${stats.totals.requests} requests, ${stats.totals.errors} errors in this time; one point every ${stats.step_s} s.`;
  };

  const refresh = async () => {
    const service = await refreshed(ctx, errors, async () => {
      const found = await (showFailed ? api("GET", `/services/${encodeURIComponent(serviceId)}?failed=true`)
        : api("GET", `/services/${encodeURIComponent(serviceId)}`));
      await loadStats(found);
      return found;
    }, () => last === null && summary.replaceChildren());
    if (!service) return;
    const changed = last === null || last.state !== service.state || last.min_replicas !== service.min_replicas || last.max_replicas !== service.max_replicas;
    if (last === null || last.state !== service.state || Boolean(last.failure) !== Boolean(service.failure)) renderActions(service);
    show(service, changed);
  };
  chartWindow.input.addEventListener("change", () => last && loadStats(last).catch((error) => error.status !== 401 && errors.show(error)));
  refresh();
  const timer = setInterval(() => {
    if (last === null || last.state !== "deleted" || (last.replica_rentals || []).some((r) => !ENDED.has(r.state))) refresh();
  }, REFRESH_MS);
  ctx.onLeave(() => clearInterval(timer));
}
