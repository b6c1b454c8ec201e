// Provider pages: hosts and their live telemetry, listings (prices), enrollment, earnings.
// Admins see the hosts pages too (every host).

import { demandSection, earningsSection, occupancySection } from "./charts-money.js";
import { api } from "./api.js";
import { badge, facts, field, h, link, num, replace, table, timeEl } from "./dom.js";
import { invoicesSection } from "./invoices.js";
import { maintenanceSection } from "./maintenance.js";
import { energySection, powerSection } from "./power.js";
import { amountProblem, usd, usdRate } from "./money.js";
import { gpuCharts } from "./telemetry.js";
import { busy, copyButton, errorBox, heading, loadInto, loading } from "./ui.js";
import { proofSection } from "./verification.js";
import { isolationBadge, isolationFacts } from "./workloads.js";

function gpuSummary(gpus) {
  const byName = new Map();
  for (const gpu of gpus || []) byName.set(gpu.name, (byName.get(gpu.name) || 0) + 1);
  return [...byName].map(([name, n]) => `${n} × ${name}`).join(", ") || "none";
}

function rentalsCell(ids, role) {
  if (!Array.isArray(ids)) return "—";
  if (ids.length === 0) return "none";
  return h("span", { class: "id-list" }, ids.map((id, i) => [i ? ", " : "",
    role === "admin" ? link(`#/rentals/${encodeURIComponent(id)}`, id) : h("code", { class: "id" }, id)]));
}

// Failed rentals by whose failure it was: only the provider's lower the host's reliability.
function failedRentals(counts) {
  if (!counts) return "—";
  return `${counts.provider ?? 0} the host's (counted in the score) · ${counts.renter ?? 0} the renters' · `
    + `${counts.platform ?? 0} the platform's (not counted)`;
}

// ---- Hosts ----------------------------------------------------------------------------

export function hostsPage(page, ctx) {
  const slot = h("div", {});
  const refresh = h("button", { type: "button", class: "secondary" }, "Refresh");
  const intro = ctx.role === "admin" ? "Every host on the platform." : "Your hosts, their state and what they earn.";
  replace(page, heading("Hosts", intro),
    h("div", { class: "actions" }, refresh, ctx.role === "provider" ? [" ", link("#/enroll", "Enroll a host")] : null), slot);
  const load = loadInto(ctx, slot, async () => {
    const body = await api("GET", "/hosts?limit=500");
    const rows = body.items.map((host) => [
      link(`#/hosts/${encodeURIComponent(host.id)}`, host.name || host.id, { class: "host-link" }),
      badge(host.state),
      host.region ?? "—",
      gpuSummary(host.gpus),
      host.tier ? badge(host.tier, "tier") : "—",
      "isolation" in host ? isolationBadge(host.isolation) : "—",
      num(host.score, 1),
      host.reliability_score === null || host.reliability_score === undefined ? "—"
        : num(host.reliability_score, 3) + (host.reliability_seeded ? " (seeded)" : ""),
      rentalsCell(host.active_rentals, ctx.role),
      usd(host.earned),
      timeEl(host.last_seen_at),
    ]);
    return table({ caption: `Hosts (${body.total})`, columns: ["Host", "State", "Region", "GPUs", "Tier", "Isolation", "Score", "Reliability",
      "Current rentals", "Earned", "Last seen"], rows, empty: "No hosts yet: enroll one.", className: "hosts" });
  });
  refresh.addEventListener("click", () => load());
  const timer = setInterval(() => load(true), 10000);
  ctx.onLeave(() => clearInterval(timer));
}

export function hostPage(page, ctx) {
  const [hostId] = ctx.params;
  ctx.setTitle(`Host ${hostId}`);
  const summary = h("div", {}, loading());
  const gpusSlot = h("div", {});
  const isolationSlot = h("div", { class: "host-isolation" });
  const proofSlot = h("div", {});
  const chartsSlot = h("div", {});
  const eventsSlot = h("div", {});
  const networkSlot = h("div", {});
  const networkErrors = errorBox();
  const measure = h("button", { type: "button", class: "secondary", id: "measure-network" }, "Measure now");
  const title = h("h1", { tabindex: "-1", class: "page-title" }, `Host ${hostId}`);
  // The page's main action, the price, is far down below the telemetry: a button at the top takes you there.
  const toListing = h("button", { type: "button", id: "go-to-listing" }, "Set the price");
  toListing.addEventListener("click", () => {
    const input = page.querySelector(".listing-form input[name=price_per_gpu_hour]");
    if (!input) return;
    input.scrollIntoView({ block: "center" });
    input.focus({ preventScroll: true });
  });
  const listingEvents = new EventTarget(); // keeps the listing form and the maintenance windows (maintenance.js) in step
  replace(page, h("p", { class: "crumbs" }, link("#/hosts", "← Hosts")), title, h("div", { class: "actions" }, toListing), summary,
    h("section", { "aria-labelledby": "gpus-title" }, h("h2", { id: "gpus-title" }, "GPUs"), gpusSlot),
    h("section", { "aria-labelledby": "proof-title" }, h("h2", { id: "proof-title" }, "GPU verification"),
      h("p", { class: "hint" }, "The platform's GPU challenge: each GPU multiplies matrices sized for the memory it claims, within a "
        + "deadline set by its model's expected speed (docs/verification.md)."), proofSlot),
    h("section", { "aria-labelledby": "isolation-title" }, h("h2", { id: "isolation-title" }, "Isolation and image policy"),
      h("p", { class: "hint" }, "How this host's agent keeps rentals apart, and which images renters may run on it (set in the agent's config)."),
      isolationSlot),
    chartsSlot,
    listingSection(ctx, hostId, listingEvents), maintenanceSection(ctx, hostId, listingEvents),
    ctx.role === "provider" || ctx.role === "admin" ? powerSection(ctx, hostId) : null,
    h("section", { "aria-labelledby": "network-title" }, h("h2", { id: "network-title" }, "Network speed tests"),
      h("div", { class: "actions" }, measure), networkErrors.el, networkSlot),
    h("section", { "aria-labelledby": "history-title" }, h("h2", { id: "history-title" }, "State history"), eventsSlot));

  const charts = gpuCharts(hostId, { heading: "Live GPU telemetry" });
  replace(chartsSlot, charts.el);
  ctx.onLeave(() => charts.close());

  const showHost = loadInto(ctx, summary, async () => {
    const host = await api("GET", `/hosts/${encodeURIComponent(hostId)}`);
    title.textContent = `Host ${host.name || host.id}`;
    ctx.setTitle(`Host ${host.name || host.id}`);
    replace(gpusSlot, table({
      caption: "GPUs", columns: ["Index", "Model", "Memory", "Tier", "Score", "Rented", "Share used", "UUID"],
      rows: (host.gpus || []).map((g) => {
        const cls = g.classification || {};
        return [String(g.index), g.name, `${num(g.memory_total_mib / 1024, 0)} GiB`, cls.tier ? badge(cls.tier, "tier") : "—",
          num(cls.score, 1), g.rented ? "yes" : "no", g.milli_used ? `${g.milli_used / 10} %` : "—", h("code", {}, g.uuid)];
      }),
      empty: "No GPUs reported yet.",
    }));
    replace(isolationSlot, isolationFacts(host.isolation));
    replace(proofSlot, proofSection(host, ctx.role));
    return facts([
      ["Host id", h("code", {}, host.id)],
      ["State", badge(host.state)],
      ["Since", timeEl(host.state_changed_at)],
      ["Region", host.region],
      ["Relay", host.relay_id],
      ["Tier", host.tier ? badge(host.tier, "tier") : "—"],
      ["Score", num(host.score, 1)],
      ["Reliability", host.reliability_score === null || host.reliability_score === undefined ? "not scored yet"
        : num(host.reliability_score, 3) + (host.reliability_seeded ? " (includes seeded demo history, not measured)" : "")],
      ["Reliability computed", timeEl(host.reliability && host.reliability.computed_at)],
      ["Failed rentals (score window)", failedRentals(host.reliability && host.reliability.failed_rentals)],
      ["Current rentals", rentalsCell(host.active_rentals, ctx.role)],
      ["Earned", usd(host.earned)],
      ["Agent", `${host.agent_version ?? "—"} (${host.gpu_backend ?? "—"})`],
      ["Last seen", timeEl(host.last_seen_at)],
      ["Certificate valid until", timeEl(host.cert_not_after)],
    ]);
  });

  const showEvents = loadInto(ctx, eventsSlot, async () => {
    const body = await api("GET", `/hosts/${encodeURIComponent(hostId)}/events?limit=50`);
    return table({ caption: `State changes (${body.total})`, columns: ["When", "From", "To", "Cause", "By"],
      rows: body.items.map((e) => [timeEl(e.at), e.from ?? "—", badge(e.to), e.cause ?? "", e.actor ?? ""]), empty: "No state changes." });
  });

  const showNetwork = loadInto(ctx, networkSlot, async () => {
    const body = await api("GET", `/hosts/${encodeURIComponent(hostId)}/network?limit=20`);
    return table({ caption: "Speed tests, newest first", className: "network",
      columns: ["Measured", "Download (Mbit/s)", "Upload (Mbit/s)", "Latency (ms)", "Jitter (ms)", "Loss", "Result"],
      rows: body.items.map((m) => [timeEl(m.measured_at), num(m.download_mbps, 1), num(m.upload_mbps, 1), num(m.latency_ms, 2),
        num(m.jitter_ms, 2), m.loss === undefined || m.loss === null ? "—" : `${num(m.loss * 100, 1)} %`, m.error ? m.error : "ok"]),
      empty: "No measurements yet." });
  });

  if (ctx.role !== "provider" && ctx.role !== "admin") measure.hidden = true;
  measure.addEventListener("click", async () => {
    networkErrors.clear();
    await busy(measure, async () => {
      try {
        const body = await api("POST", `/hosts/${encodeURIComponent(hostId)}/network-test`);
        ctx.notify(`Speed test requested (command ${body.command_id}); the result appears below in a few seconds.`);
      } catch (error) {
        if (error.status !== 401) networkErrors.show(error);
        return;
      }
      let tries = 0;
      const poll = setInterval(() => {
        tries += 1;
        if (!ctx.alive() || tries > 10) clearInterval(poll);
        else showNetwork(true);
      }, 3000);
      ctx.onLeave(() => clearInterval(poll));
    }, "Requesting…");
  });

  const timer = setInterval(() => {
    showHost(true);
    showEvents(true);
  }, 10000);
  ctx.onLeave(() => clearInterval(timer));
}

// ---- Listing ---------------------------------------------------------------------------

function toLocalInput(iso) {
  if (!iso) return "";
  const d = new Date(iso);
  const pad = (n) => String(n).padStart(2, "0");
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())}T${pad(d.getHours())}:${pad(d.getMinutes())}`;
}

function listingSection(ctx, hostId, events) {
  const errors = errorBox();
  const current = h("div", { class: "listing-current" }, loading());
  const boundsSlot = h("div", {});
  const price = field({ label: "Price, USD per GPU-hour", name: "price_per_gpu_hour", inputmode: "decimal", required: true, placeholder: "e.g. 0.45",
    hint: "One price for every GPU of the host, within its best tier's bounds." });
  const minBid = field({ label: "Minimum bid, USD per GPU-hour (optional)", name: "min_bid_per_gpu_hour", inputmode: "decimal",
    hint: "The lowest bid for interruptible use; at most the price. Empty: the tier's lowest price." });
  const unit = field({ label: "Smallest unit", name: "smallest_unit", value: "gpu", spellcheck: "false",
    hint: "gpu (whole GPUs), milli:<n> (shares of n thousandths and up, e.g. milli:250) or mig:<profile> (e.g. mig:1g.10gb)." });
  const until = field({ label: "Offered until (optional)", name: "available_until", type: "datetime-local",
    hint: "Your local time. After it the host is not offered. Empty: no end." });
  // Volumes (docs/volumes.md): what the host lends to renters' volumes, at what price per GiB-hour.
  const storage = field({ label: "Storage price, USD per GiB-hour (optional)", name: "storage_price_per_gib_hour", inputmode: "decimal",
    placeholder: "e.g. 0.0002", hint: "What renters pay per GiB-hour of their volumes on this host; needed to lend any." });
  const lent = field({ label: "Disk lent to volumes, GiB", name: "volume_gib", type: "number", min: "0", step: "1", inputmode: "numeric", value: "0",
    hint: "How much of the host's disk renters' volumes may take in all (0: none). Its agent must keep volumes (root, loop devices)." });
  const save = h("button", { type: "submit" }, "Save listing");
  const form = h("form", { class: "card listing-form", novalidate: true, "aria-labelledby": "listing-form-title" },
    h("h3", { id: "listing-form-title" }, "Set the price"), price.row, minBid.row, unit.row, until.row, storage.row, lent.row, errors.el,
    h("div", { class: "actions" }, save));
  let windows = [];
  const editable = [price, minBid, unit, until, storage, lent];
  events.addEventListener("windows", (event) => { // maintenance.js changed them: new windows, the form's typing kept
    const typed = editable.map((f) => f.input.value);
    showListing(event.detail);
    editable.forEach((f, i) => { f.input.value = typed[i]; });
  });

  const showListing = (listing) => {
    if (!listing) {
      replace(current, h("p", {}, "Not listed: the host is offered at its tier's default price."));
      return;
    }
    windows = (listing.maintenance_windows || []).map((w) => ({ start: w.start, end: w.end }));
    price.input.value = listing.price_per_gpu_hour ?? "";
    minBid.input.value = listing.min_bid_per_gpu_hour ?? "";
    unit.input.value = listing.smallest_unit || "gpu";
    until.input.value = toLocalInput(listing.available_until);
    storage.input.value = listing.storage_price_per_gib_hour ?? "";
    lent.input.value = String(listing.volume_gib ?? 0);
    replace(current, facts([
      ["Price", `${usdRate(listing.price_per_gpu_hour)} per GPU-hour`],
      ["Minimum bid", listing.min_bid_per_gpu_hour ? `${usdRate(listing.min_bid_per_gpu_hour)} per GPU-hour` : "the tier's lowest price"],
      ["Smallest unit", listing.smallest_unit],
      ["Offered until", listing.available_until ? timeEl(listing.available_until) : "no end"],
      ["Maintenance windows", windows.length ? windows.map((w) => `${w.start} – ${w.end}`).join("; ") : "none"],
      ["Storage for volumes", listing.storage_price_per_gib_hour && listing.volume_gib
        ? `${listing.volume_gib} GiB at ${usdRate(listing.storage_price_per_gib_hour)} per GiB-hour` : "none lent"],
      ["Tier", listing.tier ?? "—"],
      ["Verified", listing.verified ? "yes" : "no"],
      ["Updated", timeEl(listing.updated_at)],
    ]));
  };

  loadInto(ctx, boundsSlot, async () => {
    const bounds = await api("GET", "/price-bounds");
    return table({ caption: "Price bounds per tier (USD per GPU-hour)", columns: ["Tier", "Lowest", "Default", "Highest"], className: "bounds",
      rows: bounds.items.map((b) => [badge(b.tier, "tier"), usdRate(b.min), usdRate(b.default), usdRate(b.max)]) });
  });
  (async () => {
    try {
      showListing(await api("GET", `/hosts/${encodeURIComponent(hostId)}/listing`));
    } catch (error) {
      if (!ctx.alive()) return;
      if (error.code === "listing_not_found") showListing(null);
      else if (error.status !== 401) {
        current.replaceChildren();
        errors.show(error);
      }
    }
  })();

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    errors.clear();
    // The server's one grammar for amounts (money.js amountProblem): the same rule and words, no trimming.
    const priceProblem = amountProblem(price.input.value, { places: 6, positive: true, label: "The price per GPU-hour" });
    const minBidText = minBid.input.value.trim() === "" ? "" : minBid.input.value;
    const minBidProblem = minBidText && amountProblem(minBidText, { places: 6, positive: true, label: "The minimum bid" });
    const storageText = storage.input.value.trim() === "" ? "" : storage.input.value;
    const storageProblem = storageText && amountProblem(storageText, { places: 6, positive: true, label: "The storage price per GiB-hour" });
    const gib = lent.input.value.trim() === "" ? 0 : Number(lent.input.value);
    const gibProblem = !Number.isInteger(gib) || gib < 0 ? "The disk lent to volumes is a whole number of GiB, 0 or more." : "";
    const problem = priceProblem || minBidProblem || storageProblem || gibProblem;
    if (problem) {
      errors.show(problem);
      (priceProblem ? price : minBidProblem ? minBid : storageProblem ? storage : lent).input.focus();
      return;
    }
    const body = { price_per_gpu_hour: price.input.value, smallest_unit: unit.input.value.trim() || "gpu", maintenance_windows: windows,
      volume_gib: gib };
    if (minBidText) body.min_bid_per_gpu_hour = minBidText;
    if (storageText) body.storage_price_per_gib_hour = storageText;
    if (until.input.value) {
      const d = new Date(until.input.value);
      if (Number.isNaN(d.getTime())) {
        errors.show("Enter a valid date and time, or leave it empty.");
        until.input.focus();
        return;
      }
      body.available_until = d.toISOString();
    }
    await busy(save, async () => {
      try {
        const listing = await api("PUT", `/hosts/${encodeURIComponent(hostId)}/listing`, { body });
        showListing(listing);
        events.dispatchEvent(new CustomEvent("listing", { detail: listing }));
        ctx.notify(`Listing saved: ${usdRate(listing.price_per_gpu_hour)} per GPU-hour.`);
      } catch (error) {
        if (error.status === 401) return;
        errors.show(error);
        price.input.focus();
      }
    }, "Saving…");
  });

  return h("section", { "aria-labelledby": "listing-title", class: "listing" }, h("h2", { id: "listing-title" }, "Listing"),
    current, form, boundsSlot);
}

// ---- Enrollment -------------------------------------------------------------------------

export function enrollPage(page, ctx) {
  const errors = errorBox();
  const create = h("button", { type: "button", id: "create-token" }, "Create an enrollment token");
  const result = h("div", { class: "enroll-result", "aria-live": "polite" });
  create.addEventListener("click", async () => {
    errors.clear();
    await busy(create, async () => {
      let token;
      try {
        token = await api("POST", "/enrollment-tokens");
      } catch (error) {
        if (error.status !== 401) errors.show(error);
        return;
      }
      const command = h("textarea", { id: "enroll-command", readOnly: true, rows: 3, spellcheck: "false", class: "command", "aria-describedby": "enroll-hint" });
      command.value = token.enroll_command;
      const { button: copy, status: copied } = copyButton(command.value, command,
        { label: "the install command", id: "copy-command", className: "secondary" });
      command.addEventListener("focus", () => command.select());
      replace(result, h("div", { class: "card" },
        h("label", { for: "enroll-command" }, "Run this as root on the new GPU host:"),
        command,
        h("p", { class: "hint", id: "enroll-hint" }, "It checks the host, installs the agent as a systemd service, enrolls it and prints its host id. ",
          "The token works once and expires ", timeEl(token.expires_at),
          ". The host appears in your host list when its agent connects. Running it again later upgrades the agent (no token needed)."),
        h("p", { class: "hint" }, "Without root or systemd, add ", h("code", {}, "--no-systemd"),
          " and start the agent yourself. An agent you installed another way enrolls with ",
          h("code", { id: "enroll-command-manual" }, token.enroll_command_manual), "."),
        h("div", { class: "actions" }, copy, copied)));
      command.focus();
    }, "Creating…");
  });
  replace(page, heading("Enroll a host", "Create a one-time token, then run the install command on the GPU host. It installs the agent, which enrolls with the token and connects."),
    h("div", { class: "actions" }, create), errors.el, result);
}

// ---- Earnings ------------------------------------------------------------------------

export function earningsPage(page, ctx) {
  const totals = h("div", {});
  const payouts = h("div", {});
  replace(page, heading("Earnings and payouts", "What your hosts earned, what was paid out, and your monthly statements."),
    totals, earningsSection(ctx), occupancySection(ctx), demandSection(ctx), energySection(ctx),
    h("section", { "aria-labelledby": "payouts-title" }, h("h2", { id: "payouts-title" }, "Payouts"), payouts),
    invoicesSection(ctx, { title: "Statements", empty: "No statements yet: they appear once a host of yours earns something." }));
  loadInto(ctx, totals, async () => {
    const [account, hosts] = await Promise.all([api("GET", "/account"), api("GET", "/hosts?limit=500")]);
    const earnings = account.earnings || {};
    return h("section", { class: "card", "aria-labelledby": "earned-title" }, h("h2", { id: "earned-title" }, "Earned"),
      facts([
        ["Earned in all", h("span", { id: "earned-total" }, usd(earnings.earned_total))],
        ["Paid out", `${usd(earnings.paid_out)} in ${earnings.payouts ?? 0} payout${earnings.payouts === 1 ? "" : "s"}`],
        ["Owed to you now", h("span", { id: "payable" }, usd(earnings.payable))],
      ]),
      h("p", { class: "hint" }, "What you are owed is paid in the next payout batch once it reaches the payout minimum."),
      table({ caption: "Earned per host", columns: ["Host", "State", "Current rentals", "Earned"], className: "earned",
        rows: hosts.items.map((host) => [link(`#/hosts/${encodeURIComponent(host.id)}`, host.name || host.id), badge(host.state),
          rentalsCell(host.active_rentals, ctx.role), usd(host.earned)]),
        empty: "No hosts yet." }));
  });
  loadInto(ctx, payouts, async () => {
    const body = await api("GET", "/payouts?limit=100");
    return table({ caption: `Payouts (${body.total})`, columns: ["When", "Amount", "Batch", "State", "Exported"],
      rows: body.items.map((p) => [timeEl(p.created_at), `${usd(p.amount)} ${p.currency && p.currency !== "USD" ? p.currency : ""}`, p.batch, badge(p.state), timeEl(p.exported_at)]),
      empty: "No payouts yet: a payout is made once your earnings reach the minimum." });
  });
}
