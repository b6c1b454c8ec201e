// Off-peak power limits (docs/power.md), for providers and admins:
//   powerSection(ctx, hostId)  the host page: the opt-in form (a cap in watts or a share of each GPU's default, the
//                              off-peak threshold), each GPU's allowed range, target, limit now and energy saved, and
//                              the window its agent holds   (GET/PUT /hosts/{id}/power-policy)
//   energySection(ctx)         the Earnings page: the energy the policies saved, per UTC day and per host
//                              (GET /provider/power)
// The API checks every cap against each GPU's range; its refusal (400 invalid_power_policy) is shown at the form.

import { api } from "./api.js";
import { dayChart } from "./charts-time.js";
import { facts, field, h, link, num, replace, table, timeEl } from "./dom.js";
import { busy, errorBox, loadInto, loading } from "./ui.js";

// Small figures keep three decimals: a demo host saves a few mWh-hours in its first minutes.
const wh = (v) => (v >= 1000 ? `${num(v / 1000, 2)} kWh` : `${num(v, v < 10 ? 3 : 1)} Wh`);
/** The y axis' labels, with as many decimals as it takes to tell them apart (0.001 Wh and 0.0015 Wh, not 0.001 twice). */
function energyTicks(values) {
  for (let digits = 0; digits < 6; digits += 1) {
    const labels = values.map((v) => `${v.toFixed(digits)} Wh`);
    if (new Set(labels).size === labels.length) return labels;
  }
  return values.map((v) => `${v} Wh`);
}
const watts = (v) => (v === null || v === undefined ? "—" : `${num(v, 0)} W`);

function agentLine(agent) {
  if (!agent) return "nothing sent yet";
  if (agent.state === "succeeded") {
    const data = (agent.result && agent.result.data) || {};
    const capped = Object.keys(data.capped || {}).length;
    const skipped = Object.entries(data.skipped || {});
    return `applied: ${capped} GPU${capped === 1 ? "" : "s"} lowered${skipped.length ? `; left alone: ${skipped.map(([u, why]) => `${u.slice(0, 12)}… (${why})`).join(", ")}` : ""}`;
  }
  if (agent.state === "failed") return `refused by the agent: ${(agent.result && agent.result.detail) || "no reason given"}`;
  return `sent, waiting for the agent (${agent.state})`;
}

export function powerSection(ctx, hostId) {
  const path = `/hosts/${encodeURIComponent(hostId)}/power-policy`;
  const errors = errorBox();
  const current = h("div", { class: "power-current" }, loading());
  const enabled = field({ label: "Lower this host's idle GPUs off-peak", name: "power_enabled", type: "checkbox" });
  const kind = field({ label: "Cap", name: "power_cap_kind", type: "select", value: "fraction",
    options: [["fraction", "A share of each GPU's default limit (%)"], ["watts", "Watts, the same for every GPU"]] });
  const amount = field({ label: "Value", name: "power_cap_value", inputmode: "decimal", placeholder: "e.g. 60 (%) or 250 (W)",
    hint: "Each GPU's cap must lie within its allowed range (below) and under its default limit." });
  const threshold = field({ label: "Off-peak below this share of the forecast peak (%)", name: "power_threshold", inputmode: "decimal", value: "50",
    hint: "An hour is off-peak when the demand forecast for the host's GPU model and region is below this share of the next 24 hours' peak." });
  const save = h("button", { type: "submit" }, "Save power policy");
  const form = h("form", { class: "card power-form", novalidate: true, "aria-labelledby": "power-form-title" },
    h("h3", { id: "power-form-title" }, "Off-peak power limits"),
    h("p", { class: "hint" }, "Idle GPUs are lowered while demand is forecast to be low, and always restored before a rental starts on them: renters never run on a lowered GPU."),
    enabled.row, kind.row, amount.row, threshold.row, errors.el, h("div", { class: "actions" }, save));

  // The form follows what the server holds until the user changes it (a slow first load must not undo a click).
  let touched = false;
  form.addEventListener("input", () => { touched = true; });
  form.addEventListener("change", () => { touched = true; });
  const show = (policy) => {
    if (!touched) fill(policy);
    return summary(policy);
  };
  const fill = (policy) => {
    enabled.input.checked = policy.enabled;
    if (policy.cap_watts !== null && policy.cap_watts !== undefined) {
      kind.input.value = "watts";
      amount.input.value = String(policy.cap_watts);
    } else if (policy.cap_fraction !== null && policy.cap_fraction !== undefined) {
      kind.input.value = "fraction";
      amount.input.value = String(Number((policy.cap_fraction * 100).toFixed(2)));
    }
    threshold.input.value = String(Number((policy.off_peak_threshold * 100).toFixed(2)));
  };
  const summary = (policy) => h("div", {}, facts([
    ["Policy", policy.enabled ? "on" : "off"],
    ["Off-peak until", policy.off_peak_until ? timeEl(policy.off_peak_until) : "not off-peak now"],
    ["The agent", agentLine(policy.agent)],
    ["Energy saved", h("span", { class: "power-saved" }, wh(policy.energy_saved_wh))],
    ]), table({ caption: "Power limits per GPU", className: "power-gpus",
    columns: ["GPU", "Model", "Allowed range", "Default", "Off-peak cap", "Limit now", "Saved"],
    rows: policy.gpus.map((g) => [String(g.index), g.name, g.min_w === null || g.min_w === undefined ? "not adjustable" : `${watts(g.min_w)} – ${watts(g.max_w)}`,
      watts(g.default_w), g.target_w ? watts(g.target_w) : (g.left_out || "—"), watts(g.limit_w), wh(g.energy_saved_wh)]),
    empty: "No GPUs reported yet." }));

  loadInto(ctx, current, async () => show(await api("GET", path)));

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    errors.clear();
    const body = { enabled: enabled.input.checked };
    const share = Number(threshold.input.value);
    if (!(share > 0 && share <= 100)) {
      errors.show("The off-peak threshold is a share of the peak above 0 and at most 100 %.");
      threshold.input.focus();
      return;
    }
    body.off_peak_threshold = share / 100;
    if (body.enabled) {
      const value = Number(amount.input.value);
      if (!amount.input.value.trim() || !Number.isFinite(value) || value <= 0) {
        errors.show(kind.input.value === "watts" ? "Enter the cap in watts, e.g. 250." : "Enter the cap as a share of the default limit, e.g. 60.");
        amount.input.focus();
        return;
      }
      if (kind.input.value === "watts") body.cap_watts = value;
      else body.cap_fraction = value / 100;
    }
    await busy(save, async () => {
      try {
        const policy = await api("PUT", path, { body });
        touched = false; // saved: the form shows what the server holds again
        replace(current, show(policy));
        ctx.notify(policy.enabled ? "Power policy saved: the host's agent is told within a minute." : "Power policy off: the host's GPUs are restored.");
      } catch (error) {
        if (error.status === 401) return;
        errors.show(error);
        amount.input.focus();
      }
    }, "Saving…");
  });

  return h("section", { "aria-labelledby": "power-title", class: "power" }, h("h2", { id: "power-title" }, "Power"), current, form);
}

export function energySection(ctx, { days = 30 } = {}) {
  const slot = h("div", {});
  loadInto(ctx, slot, async () => {
    const body = await api("GET", `/provider/power?days=${days}`);
    const chart = dayChart({ title: "Energy saved per day", days: body.days.map((d) => d.day), format: (v) => wh(v), ticks: energyTicks,
      series: [{ name: "Energy saved (Wh)", values: body.days.map((d) => d.energy_saved_wh), bars: true }] });
    const rows = body.hosts.map((host) => [link(`#/hosts/${encodeURIComponent(host.host_id)}`, host.name || host.host_id),
      host.enabled ? (host.cap_watts ? `on, ${watts(host.cap_watts)}` : `on, ${num(host.cap_fraction * 100, 0)} % of default`) : "off",
      host.off_peak_until ? timeEl(host.off_peak_until) : "—", wh(host.energy_saved_wh)]);
    return h("div", { class: "chart-grid-wide" },
      h("p", { class: "energy-total" }, "Saved in all: ", h("strong", { id: "energy-saved-total" }, wh(body.energy_saved_wh))),
      chart,
      table({ caption: "Power policy per host", columns: ["Host", "Policy", "Off-peak until", "Energy saved"], rows, className: "energy-per-host",
        empty: "No hosts yet." }));
  });
  return h("section", { class: "charts-section", "aria-labelledby": "energy-title" }, h("h2", { id: "energy-title" }, "Energy saved"),
    h("p", { class: "hint" }, "What your hosts' off-peak power limits saved: each GPU's own idle draw at its full limit, less its draw while lowered, measured by its agent. Opt a host in on its page."),
    slot);
}
