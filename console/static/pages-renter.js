// Renter pages: the marketplace (offers, renting), rentals with live GPU charts, billing.

import { spendSection } from "./charts-money.js";
import { api, query } from "./api.js";
import { connectPanel } from "./connect.js";
import { creditSection } from "./credit.js";
import { badge, facts, field, h, link, num, replace, table, timeEl, uid } from "./dom.js";
import { invoicesSection } from "./invoices.js";
import { amountProblem, multiply, usd, usdRate } from "./money.js";
import { gpuCharts } from "./telemetry.js";
import { busy, confirmAndRent, errorBox, heading, loadInto, loading, modal, stopWithConfirmation } from "./ui.js";
import { verificationFact, verifiedBadge } from "./verification.js";
import { volumeChooser } from "./volume-mounts.js";
import { isolationBadge, portsFact, runsShort, workloadChooser, workloadFacts } from "./workloads.js";

const TIERS = ["flagship", "datacenter", "prosumer", "consumer", "entry"];
const ACTIVE = new Set(["pending", "starting", "running"]);
const PAGE_SIZE = 25;
const MAX_LOG_CHARS = 256 * 1024; // the page keeps the newest output only

function gib(mib) {
  return mib === null || mib === undefined ? "—" : `${num(mib / 1024, 0)} GiB`;
}

function mbps(value) {
  return value === null || value === undefined ? "—" : `${num(value, 0)}`;
}

function shortId(id) {
  return id && id.length > 14 ? `${id.slice(0, 12)}…` : id;
}

// ---- Marketplace ------------------------------------------------------------------

const SORTS = {
  price: { label: "Price / GPU-hour", best: "asc" },
  price_per_performance: { label: "Price per performance", best: "asc" },
  score: { label: "Score", best: "desc" },
  reliability: { label: "Reliability", best: "desc" },
};

export function offersPage(page, ctx) {
  const state = { sort: "score", order: null, offset: 0, filters: {} };
  const errors = errorBox();
  const count = h("p", { class: "result-count", role: "status", "aria-live": "polite" });
  const results = h("div", { class: "offers-results" });
  const dialog = rentDialog(ctx);

  const inputs = {
    gpu_model: field({ label: "GPU model", name: "gpu_model", placeholder: "e.g. RTX 4090", hint: "Every word must be in the model name." }),
    num_gpus: field({ label: "At least GPUs", name: "num_gpus", type: "number", min: 1, max: 64, step: 1, inputmode: "numeric" }),
    min_vram_gib: field({ label: "At least VRAM (GiB)", name: "min_vram_gib", type: "number", min: 0, step: 1 }),
    max_price: field({ label: "At most USD / GPU-hour", name: "max_price", inputmode: "decimal", placeholder: "e.g. 0.50" }),
    region: field({ label: "Region", name: "region", placeholder: "e.g. eu-west" }),
    tier: field({ label: "Tier", name: "tier", type: "select", options: [["", "Any tier"], ...TIERS.map((t) => [t, t])] }),
    min_reliability: field({ label: "At least reliability (0–1)", name: "min_reliability", inputmode: "decimal", placeholder: "e.g. 0.95" }),
  };
  const isolated = field({ label: "Isolated hosts only", name: "isolated", type: "checkbox",
    hint: "Hosts whose agent runs each rental in a container or under a user of its own." });
  isolated.row.classList.add("filter-check");
  const verified = field({ label: "Verified hosts only", name: "verified", type: "checkbox",
    hint: "Hosts whose every GPU passed the platform's GPU challenge in the last 7 days." });
  verified.row.classList.add("filter-check");
  const q = field({ label: "Query", name: "q", placeholder: "gpu_name=RTX_4090 num_gpus>=2 reliability>0.98 price<=0.5",
    hint: "The query language: terms like field op value, all must hold (see docs/marketplace.md).", spellcheck: "false", autocomplete: "off" });
  const search = h("button", { type: "submit" }, "Search");
  const reset = h("button", { type: "reset", class: "secondary" }, "Reset");
  const form = h("form", { class: "filters", "aria-label": "Filter offers", novalidate: true },
    h("div", { class: "grid" }, Object.values(inputs).map((f) => f.row), isolated.row, verified.row),
    h("div", { class: "query-row" }, q.row),
    errors.el,
    h("div", { class: "actions" }, search, reset));

  const load = async () => {
    errors.clear();
    const params = { ...state.filters, sort: state.sort, order: state.order, limit: PAGE_SIZE, offset: state.offset };
    let body;
    try {
      body = await busy(search, () => api("GET", `/offers${query(params)}`), "Searching…");
    } catch (error) {
      if (!ctx.alive() || error.status === 401) return;
      errors.show(error);
      return;
    }
    if (!ctx.alive()) return;
    state.sort = body.sort;
    state.order = body.order;
    count.textContent = body.total === 0 ? "No offers match." : `${body.total} offer${body.total === 1 ? "" : "s"}${body.query ? ` matching ${body.query}` : ""}.`;
    replace(results, offersTable(body, state, (sort) => {
      if (state.sort === sort) state.order = state.order === "asc" ? "desc" : "asc";
      else {
        state.sort = sort;
        state.order = null;
      }
      state.offset = 0;
      load().then(() => {
        const again = results.querySelector(`th[data-sort="${sort}"] button`);
        if (again) again.focus();
      });
    }, ctx.role === "renter" ? (offer) => dialog.open(offer) : null), pager(body, (offset) => {
      state.offset = offset;
      load();
    }));
  };

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    state.filters = Object.fromEntries([...Object.entries(inputs), ["q", q]].map(([k, f]) => [k, f.input.value]));
    if (isolated.input.checked) state.filters.isolated = "true";
    if (verified.input.checked) state.filters.verified = "true";
    state.offset = 0;
    load();
  });
  form.addEventListener("reset", () => {
    setTimeout(() => {
      state.filters = {};
      state.offset = 0;
      load();
    });
  });

  // Layout: the filters beside the offers on a wide screen, folded above them on a phone (open where there is room),
  // so the first offer's Rent button shows without scrolling.
  const filters = h("details", { class: "card filters-box", open: matchMedia("(min-width: 721px)").matches },
    h("summary", {}, "Filters and query"), form);
  replace(page, heading("Marketplace", ctx.role === "renter" ? "GPUs you can rent now. Filter, sort by a column, and rent." : "GPUs renters can rent now."),
    h("div", { class: "market" }, filters, h("div", { class: "market-results" }, count, results)), dialog.el);
  load();
}

function offersTable(body, state, onSort, onRent) {
  const sortable = (key, label) => {
    const active = state.sort === key;
    const button = h("button", { type: "button", class: "sort" }, label,
      h("span", { class: "sort-mark", "aria-hidden": "true" }, active ? (state.order === "asc" ? " ▲" : " ▼") : " ↕"));
    button.addEventListener("click", () => onSort(key));
    return h("th", { scope: "col", "data-sort": key, "aria-sort": active ? (state.order === "asc" ? "ascending" : "descending") : "none" }, button);
  };
  const columns = [
    "Model and isolation", "Free GPUs", "VRAM", sortable("price", "Price / GPU-hour"), sortable("price_per_performance", "Price per performance"),
    sortable("score", "Score"), "Region", sortable("reliability", "Reliability"), "Speed down / up (Mbit/s)", "Tier",
  ];
  if (onRent) columns.push(h("th", { scope: "col" }, h("span", { class: "visually-hidden" }, "Actions")));
  const rows = body.items.map((offer) => {
    let rent = null;
    if (onRent) {
      rent = h("button", { type: "button", class: "small", "aria-label": `Rent ${offer.gpu_name} on host ${offer.host_id}` }, "Rent");
      rent.addEventListener("click", () => onRent(offer));
    }
    return h("tr", { dataset: { offerId: offer.id } },
      h("td", {}, h("span", { class: "model" }, offer.gpu_name), h("span", { class: "offer-isolation" }, isolationBadge(offer.isolation)),
        offer.verified ? h("span", { class: "offer-verified" }, " ", verifiedBadge(offer)) : null,
        offer.listed ? null : h("span", { class: "hint block" }, "default price")),
      h("td", { class: "num" }, String(offer.num_gpus), offer.mig && offer.mig.length
        // Short: the per-profile list (in its title and the Rent dialog) widened the column past a laptop's viewport.
        ? h("span", { class: "hint", title: `MIG instances free: ${migText(offer)}` }, ` + ${offer.mig_instances_free} MIG`) : null),
      h("td", { class: "num" }, gib(offer.vram_mib)),
      h("td", { class: "num" }, usdRate(offer.price_per_gpu_hour)),
      h("td", { class: "num" }, offer.price_per_score === null ? "—" : num(offer.price_per_score, 4)),
      h("td", { class: "num" }, num(offer.performance_score, 1)),
      h("td", {}, offer.region ?? "—"),
      h("td", { class: "num", title: offer.reliability_seeded ? "includes seeded demo history (gpumarket up), not measured" : null },
        offer.reliability === null ? "—" : num(offer.reliability, 3) + (offer.reliability_seeded ? " (seeded)" : "")),
      h("td", { class: "num" }, `${mbps(offer.download_mbps)} / ${mbps(offer.upload_mbps)}`),
      h("td", {}, offer.tier ? badge(offer.tier, "tier") : "—"),
      rent ? h("td", {}, rent) : null);
  });
  return table({ caption: "Offers", columns, rows, empty: "No offers match these filters.", className: "offers" });
}

/** An offer's free MIG instances per profile ("3g.40gb × 1, 1g.10gb × 2"): a GPU in MIG mode rents only as these. */
function migText(offer) {
  return (offer.mig || []).map((m) => `${m.profile} × ${m.free}`).join(", ");
}

/** Thousandths of a GPU a MIG profile's compute is, as billing counts it (seven slices: "3g.40gb" = 3/7). */
function migMilli(profile) {
  return Math.max(1, Math.floor((Number(profile.split("g")[0]) * 1000) / 7));
}

function pager(body, go) {
  if (body.total <= body.limit) return null;
  const prev = h("button", { type: "button", class: "secondary", disabled: body.offset === 0 }, "Previous");
  const next = h("button", { type: "button", class: "secondary", disabled: body.offset + body.limit >= body.total }, "Next");
  prev.addEventListener("click", () => go(Math.max(0, body.offset - body.limit)));
  next.addEventListener("click", () => go(body.offset + body.limit));
  return h("nav", { class: "pager", "aria-label": "Pages" }, prev,
    h("span", {}, ` ${body.offset + 1}–${Math.min(body.total, body.offset + body.limit)} of ${body.total} `), next);
}

let boundsCache = null;
async function priceBounds() {
  if (!boundsCache) boundsCache = api("GET", "/price-bounds").then((b) => Object.fromEntries(b.items.map((x) => [x.tier, x]))).catch(() => ({}));
  return boundsCache;
}

/** The rent form in a modal dialog: choose, review the price, confirm. */
function rentDialog(ctx) {
  const titleId = uid("rent-title");
  const { el, close } = modal("rent-dialog", titleId);
  let offer = null;

  function open(chosen) {
    offer = chosen;
    const errors = errorBox();
    const share = offer.smallest_unit && offer.smallest_unit.startsWith("milli:") ? Number(offer.smallest_unit.slice(6)) : null;
    const count = field({ label: "Number of GPUs", name: "gpu_count", type: "number", min: 1, max: offer.num_gpus, step: 1, value: 1,
      inputmode: "numeric", hint: `This offer has ${offer.num_gpus} free GPU${offer.num_gpus === 1 ? "" : "s"}.` });
    const milli = field({ label: "Share of one GPU (thousandths)", name: "gpu_milli", type: "number", min: share || 1, max: 999, step: 1,
      value: share ? Math.max(share, 250) : "", disabled: !share,
      hint: share ? `At least ${share} (${share / 10} % of the GPU).` : "This host rents whole GPUs only." });
    const migs = offer.mig || [];
    const unitWhole = field({ label: "Whole GPUs", name: "unit", type: "radio", value: "whole", checked: offer.num_gpus > 0, disabled: offer.num_gpus === 0 });
    const unitShare = field({ label: "A fractional share of one GPU", name: "unit", type: "radio", value: "share", disabled: !share });
    const unitMig = field({ label: "One MIG instance", name: "unit", type: "radio", value: "mig", checked: offer.num_gpus === 0 && migs.length > 0,
      disabled: migs.length === 0 });
    const migProfile = field({ label: "MIG profile", name: "mig_profile", type: "select", value: migs.length ? migs[0].profile : "",
      options: migs.map((m) => [m.profile, `${m.profile} (${m.free} free)`]),
      hint: migs.length ? "A GPU in MIG mode rents only as its instances, one per rental." : "This offer has no GPU in MIG mode." });
    const kindOnDemand = field({ label: "On demand (never preempted)", name: "kind", type: "radio", value: "on_demand", checked: true });
    const kindInterruptible = field({ label: "Interruptible, with a bid (cheaper; can be preempted)", name: "kind", type: "radio", value: "interruptible" });
    const bid = field({ label: "Bid, USD per GPU-hour", name: "bid", inputmode: "decimal", placeholder: "e.g. 0.20", disabled: true,
      hint: offer.min_bid_per_gpu_hour ? `The minimum bid is ${usdRate(offer.min_bid_per_gpu_hour)}.` : "At least the tier's minimum price." });
    const run = workloadChooser(offer);
    const volumes = volumeChooser(offer);
    if (!offer.min_bid_per_gpu_hour && offer.tier) {
      priceBounds().then((bounds) => {
        const tier = bounds[offer.tier];
        if (tier) bid.row.querySelector(".hint").textContent = `The minimum bid is ${usdRate(tier.min)} (the ${offer.tier} tier's lowest price).`;
      });
    }
    const sync = () => {
      count.input.disabled = !unitWhole.input.checked;
      milli.input.disabled = !unitShare.input.checked;
      migProfile.input.disabled = !unitMig.input.checked;
      bid.input.disabled = !kindInterruptible.input.checked;
    };
    for (const f of [unitWhole, unitShare, unitMig, kindOnDemand, kindInterruptible]) f.input.addEventListener("change", sync);

    const review = h("button", { type: "submit" }, "Review price");
    const cancel = h("button", { type: "button", class: "secondary" }, "Cancel");
    cancel.addEventListener("click", close);
    const form = h("form", { class: "rent-form", novalidate: true, method: "dialog" },
      facts([["Host", h("code", {}, offer.host_id)], ["Region", offer.region], ["Price", `${usdRate(offer.price_per_gpu_hour)} per GPU-hour`],
        ["Free GPUs", String(offer.num_gpus)], ...(migs.length ? [["Free MIG instances", migText(offer)]] : []),
        ["Tier", offer.tier], ["Isolation", isolationBadge(offer.isolation)], ["Verified", verificationFact(offer)]]),
      h("div", { class: "fieldset-pair" },
        h("fieldset", {}, h("legend", {}, "How much"), unitWhole.row, count.row, unitShare.row, milli.row,
          ...(migs.length ? [unitMig.row, migProfile.row] : [])),
        h("fieldset", {}, h("legend", {}, "Pricing"), kindOnDemand.row, kindInterruptible.row, bid.row)),
      run.el,
      volumes.el,
      h("div", { class: "actions" }, review, cancel));
    const confirmSlot = h("div", { class: "confirm" });
    const body = h("div", { class: "dialog-body" }, h("h2", { id: titleId }, `Rent ${offer.gpu_name}`), errors.el, form, confirmSlot);
    replace(el, body);

    const readRequest = () => {
      const request = { offer_id: offer.id, kind: kindInterruptible.input.checked ? "interruptible" : "on_demand" };
      let units = 1;
      let thousandths = 1000;
      if (unitMig.input.checked) {
        request.gpu_count = 1;
        request.mig_profile = migProfile.input.value;
        thousandths = migMilli(request.mig_profile);
      } else if (unitShare.input.checked) {
        const m = Number(milli.input.value);
        if (!Number.isInteger(m) || m < (share || 1) || m > 999) {
          throw Object.assign(new Error(`Enter a share between ${share || 1} and 999 thousandths of the GPU.`), { focus: milli.input });
        }
        request.gpu_count = 1;
        request.gpu_milli = m;
        thousandths = m;
      } else {
        const n = Number(count.input.value);
        if (!Number.isInteger(n) || n < 1) throw Object.assign(new Error("Enter a whole number of GPUs, at least 1."), { focus: count.input });
        if (n > offer.num_gpus) {
          throw Object.assign(new Error(`This offer has only ${offer.num_gpus} free GPU${offer.num_gpus === 1 ? "" : "s"}; ask for at most ${offer.num_gpus}.`),
            { focus: count.input });
        }
        request.gpu_count = n;
        units = n;
      }
      let rate = offer.price_per_gpu_hour;
      if (request.kind === "interruptible") {
        const text = bid.input.value;
        const problem = amountProblem(text, { places: 6, positive: true, label: "The bid (USD per GPU-hour)" });
        if (problem) throw Object.assign(new Error(problem), { focus: bid.input });
        request.bid = text;
        rate = text;
      }
      Object.assign(request, run.read());
      const mounts = volumes.read();
      if (mounts.length) {
        if (request.workload && request.workload.kind !== "container") {
          throw Object.assign(new Error("Volumes mount into a container: choose a template or a custom image, or untick the volumes."),
            { focus: el.querySelector(".volume-choice input") });
        }
        request.volumes = mounts;
      }
      return { request, perHour: multiply(rate, units, thousandths), rate, units, thousandths };
    };

    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      await Promise.all([run.ready, volumes.ready]);
      errors.clear();
      run.clear();
      let chosen;
      try {
        chosen = readRequest();
      } catch (error) {
        if (error.target && run.showAt(error.target, error.message)) return;
        errors.show(error.message);
        if (error.focus) error.focus.focus();
        return;
      }
      showConfirmation(chosen);
    });

    function showConfirmation({ request, perHour, rate, units, thousandths }) {
      const what = request.mig_profile ? `one MIG ${request.mig_profile} instance`
        : request.gpu_milli ? `${thousandths / 10} % of one GPU` : `${units} GPU${units === 1 ? "" : "s"}`;
      confirmAndRent(ctx, { form, slot: confirmSlot, backTo: review, errors, close }, {
        confirmId: "confirm-rent", path: "/rentals", request, noun: "Rental", page: "rentals",
        summary: [h("h3", {}, "Confirm your rental"),
          facts([["GPU", `${offer.gpu_name} on ${offer.host_id}`], ["Amount", what],
            ["Pricing", request.kind === "interruptible" ? `interruptible, bid ${usdRate(rate)} per GPU-hour` : `on demand, ${usdRate(rate)} per GPU-hour`],
            ["What runs", h("span", { id: "confirm-runs" }, `${run.describe(request)}.`)], portsFact(request, run.templateOf),
            ...(request.volumes ? [["Volumes", h("span", { id: "confirm-volumes" }, `${volumes.describe(request.volumes)}.`)]] : [])]),
          h("p", { class: "price-total" }, "Price: ", h("strong", { id: "confirm-price", dataset: { perHour } }, `${usdRate(perHour)} per hour`),
            h("span", { class: "hint block" }, `${usdRate(rate)} per GPU-hour × ${request.gpu_milli || request.mig_profile ? `${thousandths}/1000 of a GPU` : `${units} GPU${units === 1 ? "" : "s"}`} = ${usdRate(perHour)} per hour, billed per second after a 60-second minimum while it runs.`))],
        onError(error) {
          if (run.showApiError(error)) return; // shown next to the field it names
          errors.show(error);
          const target = error.code === "bid_below_minimum" ? bid.input : error.code && error.code.includes("capacity") ? count.input : review;
          if (!target.disabled) target.focus();
        },
      });
    }

    sync();
    if (!el.open) el.showModal();
    (unitWhole.input.checked ? count.input : unitMig.input.checked ? migProfile.input : review).focus();
  }

  return { el, open };
}

// ---- Rentals ------------------------------------------------------------------------

function gpuAmount(rental) {
  if (rental.gpu_milli && rental.gpu_milli < 1000) return `${rental.gpu_milli / 10} % of 1`;
  if (rental.mig_profile) return `MIG ${rental.mig_profile}`;
  return String(rental.gpu_count);
}

export function rentalsPage(page, ctx) {
  const slot = h("div", {});
  const refresh = h("button", { type: "button", class: "secondary" }, "Refresh");
  const unfold = field({ label: "List services' failed replicas one by one", name: "failed_replicas", type: "checkbox" });
  replace(page, heading("Rentals", ctx.role === "admin" ? "Every rental, newest first." : "Your rentals, newest first."),
    h("div", { class: "actions" }, refresh, ctx.role === "renter" ? [" ", link("#/offers", "Rent more GPUs")] : null), unfold.row, slot);
  const load = loadInto(ctx, slot, async () => {
    const body = await api("GET", "/rentals?limit=100");
    // A service whose replicas cannot start leaves a failed rental per attempt: one row per service, where its first is.
    const folded = new Map();
    const rows = [];
    for (const r of body.items) {
      if (!unfold.input.checked && r.service_id && r.state === "failed") {
        let group = folded.get(r.service_id);
        if (!group) {
          group = { count: 0, label: h("span", {}) };
          folded.set(r.service_id, group);
          rows.push([link(`#/services/${encodeURIComponent(r.service_id)}`, group.label, { class: "folded-replicas" }), badge(r.state),
            r.gpu_model ?? "—", gpuAmount(r), runsShort(r), "service replicas", "—", "on the service's page", timeEl(r.created_at)]);
        }
        group.count += 1;
        continue;
      }
      rows.push([
        link(`#/rentals/${encodeURIComponent(r.id)}`, r.id, { class: "rental-link" }),
        badge(r.state),
        r.gpu_model ?? "—",
        gpuAmount(r),
        runsShort(r),
        r.kind === "interruptible" ? `interruptible (bid ${usdRate(r.bid_per_gpu_hour)})` : "on demand",
        usdRate(r.price_per_hour),
        usd(r.charged),
        timeEl(r.created_at),
      ]);
    }
    for (const [serviceId, group] of folded) {
      group.label.textContent = `${group.count} failed replica${group.count === 1 ? "" : "s"} of service ${serviceId}`;
    }
    return table({ caption: `Rentals (${body.total})`, columns: ["Rental", "State", "GPU model", "GPUs", "Runs", "Kind", "Price / hour", "Charged", "Created"],
      rows, empty: "No rentals yet. Find GPUs in the marketplace.", className: "rentals" });
  });
  refresh.addEventListener("click", () => load());
  unfold.input.addEventListener("change", () => load());
  const timer = setInterval(() => load(true), 5000);
  ctx.onLeave(() => clearInterval(timer));
}

/**
 * A start-up step (an image pull's progress) rather than a change of state: {stage, percent, text}, or null.
 * The master stores one as an event from a state to itself, caused "workload pulling: <what the agent said> (45%)".
 */
function progressOf(event) {
  const cause = event.cause || "";
  const named = /^workload ([a-z]+):\s*/.exec(cause);
  if (!event.stage && !(named && event.from === event.to)) return null;
  const stage = event.stage || (named ? named[1] : "progress");
  const text = named ? cause.slice(named[0].length) : cause;
  let percent = typeof event.percent === "number" ? event.percent : null;
  if (percent === null) {
    const found = /\((\d{1,3}(?:\.\d+)?)\s?%\)\s*$/.exec(text) || /(\d{1,3}(?:\.\d+)?)\s?%/.exec(text);
    if (found) percent = Math.min(100, Number(found[1]));
  }
  return { stage: stage.toLowerCase(), percent, text };
}

/** The rental's events, oldest first; a run of progress steps of one stage reads as its latest, with a bar. */
function eventsTable(events) {
  const rows = [];
  let run = null; // the row of the progress run being collapsed
  for (const e of events) {
    const step = progressOf(e);
    if (step && run && run.stage === step.stage) {
      run.count += 1;
      run.event = e;
      run.step = step;
      continue;
    }
    run = step ? { stage: step.stage, count: 1, event: e, step } : null;
    rows.push(run || e);
  }
  return table({ caption: "State changes and start-up steps", columns: ["When", "From", "To", "What happened"], className: "events",
    empty: "No events yet.",
    rows: rows.map((row) => {
      if (!row.step) return [timeEl(row.at), row.from ?? "—", badge(row.to), row.cause ?? ""];
      const { event, step, count } = row;
      return h("tr", { class: "event-progress", dataset: { stage: step.stage } },
        h("td", {}, timeEl(event.at)), h("td", {}, event.from ?? "—"), h("td", {}, badge(step.stage, "progress")),
        h("td", {}, step.text,
          step.percent === null ? null : h("progress", { max: 100, value: step.percent, "aria-label": `${step.stage} ${num(step.percent, 0)} %` }),
          count > 1 ? h("span", { class: "hint block" }, `${count} updates; the latest shown`) : null));
    }) });
}

export function rentalPage(page, ctx) {
  const [rentalId] = ctx.params;
  ctx.setTitle(`Rental ${rentalId}`);
  const errors = errorBox();
  const summary = h("div", { class: "rental-summary" }, loading());
  const actions = h("div", { class: "actions rental-actions" });
  const events = h("div", {});
  const logs = h("pre", { class: "logs", tabindex: "0", role: "region", "aria-label": "Workload output" });
  const chartsSlot = h("div", {});
  const connect = connectPanel(ctx, rentalId);
  connect.el.hidden = true; // until the rental is loaded
  replace(page, h("p", { class: "crumbs" }, link("#/rentals", "← Rentals")), heading(`Rental ${rentalId}`), errors.el, actions, summary,
    connect.el, chartsSlot, h("section", { "aria-labelledby": "events-title" }, h("h2", { id: "events-title" }, "Events"), events),
    h("section", { "aria-labelledby": "logs-title" }, h("h2", { id: "logs-title" }, "Logs"), logs));

  let charts = null;
  let chartWindow = { start: null, end: null }; // the rental's own time: no sample from before it started
  let logOffset = 0;
  let lastState = null;
  let changedAt = Date.now();
  const confirmation = { confirming: false };
  ctx.onLeave(() => charts && charts.close());

  const renderActions = (rental) => {
    if (confirmation.confirming) return;
    if (!ACTIVE.has(rental.state)) {
      actions.replaceChildren();
      return;
    }
    const stop = stopWithConfirmation(ctx, {
      slot: actions, errors, state: confirmation, id: "stop-rental", confirmId: "confirm-stop", label: "Stop rental",
      confirmLabel: "Yes, stop it", question: "Stop this rental? Its workload is stopped and billing ends.",
      path: `/rentals/${encodeURIComponent(rentalId)}`, what: `Rental ${rentalId}`, refresh: () => refresh(), redraw: () => renderActions(rental),
    });
    replace(actions, stop);
  };

  const refresh = async () => {
    let rental;
    try {
      rental = await api("GET", `/rentals/${encodeURIComponent(rentalId)}`);
    } catch (error) {
      if (ctx.alive() && error.status !== 401) {
        errors.show(error);
        if (lastState === null) summary.replaceChildren();
      }
      return;
    }
    if (!ctx.alive()) return;
    summary.dataset.state = rental.state;
    replace(summary, facts([
      ["State", badge(rental.state)],
      rental.queued && rental.queue ? ["Queue", rental.queue.message] : null,
      rental.queued ? ["Queued until", timeEl(rental.queue_until)] : null,
      ["GPU model", rental.gpu_model ?? "—"],
      ["GPUs", gpuAmount(rental)],
      ["Host", rental.host_id ? h("code", {}, rental.host_id) : "not placed yet"],
      ["Kind", rental.kind === "interruptible" ? `interruptible, bid ${usdRate(rental.bid_per_gpu_hour)} per GPU-hour` : "on demand"],
      ["Price per GPU-hour", usdRate(rental.price_per_gpu_hour)],
      ["Price per hour", usdRate(rental.price_per_hour)],
      ["Charged so far", h("span", { id: "rental-charged", dataset: { amount: rental.charged ?? "" } }, usd(rental.charged))],
      ...workloadFacts(rental),
      ["Created", timeEl(rental.created_at)],
      ["Started", timeEl(rental.started_at)],
      ["Stopped", timeEl(rental.stopped_at)],
      rental.failure_reason ? ["Why it ended", rental.failure_reason] : null,
      rental.preempted_by ? ["Preempted by", link(`#/rentals/${encodeURIComponent(rental.preempted_by)}`, rental.preempted_by)] : null,
      rental.preempting_by ? ["Being preempted by", link(`#/rentals/${encodeURIComponent(rental.preempting_by)}`, rental.preempting_by)] : null,
      rental.requeued_from ? ["Queued again after", link(`#/rentals/${encodeURIComponent(rental.requeued_from)}`, rental.requeued_from)] : null,
    ]));
    if (rental.state !== lastState) {
      renderActions(rental);
      lastState = rental.state;
      changedAt = Date.now();
    }
    connect.update(rental);
    connect.el.hidden = false;
    replace(events, eventsTable(rental.events || []));
    chartWindow = { start: rental.started_at || rental.created_at || null, end: rental.stopped_at || null };
    if (!charts && rental.host_id && rental.gpu_uuids && rental.gpu_uuids.length) {
      charts = gpuCharts(rental.host_id, { uuids: rental.gpu_uuids, heading: "Live GPU telemetry of this rental", window: () => chartWindow });
      replace(chartsSlot, charts.el);
    }
    try {
      const chunk = await api("GET", `/rentals/${encodeURIComponent(rentalId)}/logs?offset=${logOffset}`);
      if (!ctx.alive()) return;
      if (chunk.data) {
        const atBottom = logs.scrollTop + logs.clientHeight >= logs.scrollHeight - 4;
        logs.append(document.createTextNode(chunk.data));
        if (logs.textContent.length > MAX_LOG_CHARS) logs.textContent = logs.textContent.slice(-MAX_LOG_CHARS);
        if (atBottom) logs.scrollTop = logs.scrollHeight;
      }
      logOffset = chunk.next_offset;
      logs.dataset.empty = logs.textContent ? "false" : "true";
    } catch {
      /* logs are best effort; the rental's own errors show above */
    }
  };
  refresh();
  // Every 3 s while the rental is active; an ended one changes only when its last charge posts.
  let ticks = 0;
  const timer = setInterval(() => {
    ticks += 1;
    const settling = lastState === null || ACTIVE.has(lastState) || lastState === "stopping" || Date.now() - changedAt < 30_000;
    if (settling || ticks % 5 === 0) refresh();
  }, 3000);
  ctx.onLeave(() => clearInterval(timer));
}

// ---- Billing ------------------------------------------------------------------------

export function billingPage(page, ctx) {
  const accountSlot = h("div", {});
  const errors = errorBox();
  const cap = field({ label: "Monthly spend cap (USD)", name: "monthly_spend_cap", inputmode: "decimal", placeholder: "e.g. 100.00",
    hint: "Whole cents. Leave empty to remove the cap. Rentals are refused or stopped before going past it." });
  const save = h("button", { type: "submit" }, "Save spend cap");
  const form = h("form", { class: "card", novalidate: true, "aria-labelledby": "cap-title" }, h("h2", { id: "cap-title" }, "Spend cap"),
    cap.row, errors.el, h("div", { class: "actions" }, save));

  const showAccount = loadInto(ctx, accountSlot, async () => {
    const account = await api("GET", "/account");
    const credit = account.credit || {};
    const quota = account.quota || {};
    if (document.activeElement !== cap.input && !form.dataset.touched) cap.input.value = credit.monthly_spend_cap ?? "";
    return h("section", { "aria-labelledby": "credit-title", class: "card credit-card" }, h("h2", { id: "credit-title" }, "Credit"),
      facts([
        ["Balance", h("span", { id: "balance" }, usd(credit.balance))],
        ["Burn rate", `${usdRate(credit.burn_rate_per_hour)} per hour`],
        ["Lasts", credit.hours_left === null || credit.hours_left === undefined ? "—" : `${num(credit.hours_left, 1)} hours at this rate`],
        ["Spent this month", usd(credit.spent_this_month)],
        ["Monthly spend cap", h("span", { id: "spend-cap" }, credit.monthly_spend_cap ? usd(credit.monthly_spend_cap) : "none")],
        ["GPUs held", `${quota.used_gpus ?? "0"}${quota.max_gpus ? ` of at most ${quota.max_gpus}` : ""}`],
        ["Spend quota", quota.max_spend_per_hour ? `${usdRate(quota.max_spend_per_hour)} per hour` : "none"],
      ]));
  });
  cap.input.addEventListener("input", () => {
    form.dataset.touched = "true";
  });
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    errors.clear();
    // Empty (or only spaces) removes the cap; anything else must be an amount of the grammar, untrimmed.
    const text = cap.input.value.trim() === "" ? "" : cap.input.value;
    const problem = text && amountProblem(text, { places: 2, positive: true, label: "The monthly spend cap (USD)" });
    if (problem) {
      errors.show(`${problem} Leave it empty for no cap.`);
      cap.input.focus();
      return;
    }
    await busy(save, async () => {
      try {
        const body = await api("PUT", "/account/spend-cap", { body: { monthly_spend_cap: text || null } });
        ctx.notify(body.monthly_spend_cap ? `Spend cap set to ${usd(body.monthly_spend_cap)} a month.` : "Spend cap removed.");
        delete form.dataset.touched;
        await showAccount(true);
      } catch (error) {
        if (error.status !== 401) errors.show(error);
      }
    }, "Saving…");
  });
  replace(page, heading("Billing", "Prepaid credit, what you spend, and your monthly invoices."), accountSlot,
    creditSection(ctx, { onCredited: () => showAccount(true) }), form, spendSection(ctx), invoicesSection(ctx, { title: "Invoices" }));
}
