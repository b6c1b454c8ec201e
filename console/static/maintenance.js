// The host page's maintenance windows (providers and admins): the upcoming windows, in UTC with the
// reader's local time beside, each with a Clear button, and a form to add one. It saves through
// POST and DELETE /hosts/{id}/maintenance-windows, which leave the listing's other terms as they are;
// the API's refusal (ends before it starts, already over, overlaps another window) is shown at the form.
// `events` (an EventTarget the host page shares with the listing form) keeps the two in step: a
// "listing" event (the form saved) redraws this list, and this section sends "windows" with the
// listing each change returns, so the form's next PUT does not bring back a window cleared here.

import { api } from "./api.js";
import { field, h, replace, table } from "./dom.js";
import { busy, errorBox, loading } from "./ui.js";

const DURATIONS = [["", "Custom: set the end"], ["1", "1 hour"], ["2", "2 hours"], ["4", "4 hours"], ["8", "8 hours"], ["24", "24 hours"]];
const HOUR_MS = 3600 * 1000;
const LOCAL_ZONE = Intl.DateTimeFormat().resolvedOptions().timeZone || "your browser's time zone";

/** A stored window time ("2027-01-01T00:00:00Z") as "2027-01-01 00:00 UTC" (seconds only when not zero). */
function utcText(iso) {
  return `${iso.replace("T", " ").replace(/:00Z$/, "Z").replace(/Z$/, "")} UTC`;
}

function localText(iso) {
  const d = new Date(iso);
  return d.toLocaleString(undefined, { year: "numeric", month: "short", day: "numeric", hour: "2-digit", minute: "2-digit" });
}

/** A datetime-local value ("2027-01-01T09:30" or with seconds) read as UTC or as local time; null if not a time. */
export function parseInput(value, zone) {
  const m = /^(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2})(?::(\d{2}))?$/.exec(value || "");
  if (!m) return null;
  const [, y, mo, d, hh, mm, ss] = m.map(Number);
  const date = zone === "utc" ? new Date(Date.UTC(y, mo - 1, d, hh, mm, ss || 0)) : new Date(y, mo - 1, d, hh, mm, ss || 0);
  return Number.isNaN(date.getTime()) ? null : date;
}

/** A Date as a datetime-local value in UTC or local time. */
function toInput(date, zone) {
  const pad = (n) => String(n).padStart(2, "0");
  const utc = zone === "utc";
  const parts = utc
    ? [date.getUTCFullYear(), date.getUTCMonth() + 1, date.getUTCDate(), date.getUTCHours(), date.getUTCMinutes()]
    : [date.getFullYear(), date.getMonth() + 1, date.getDate(), date.getHours(), date.getMinutes()];
  return `${parts[0]}-${pad(parts[1])}-${pad(parts[2])}T${pad(parts[3])}:${pad(parts[4])}`;
}

export function maintenanceSection(ctx, hostId, events) {
  const path = `/hosts/${encodeURIComponent(hostId)}`;
  const errors = errorBox();
  const listSlot = h("div", { class: "maintenance-list" }, loading());
  const zone = field({ label: "The times below are in", name: "maintenance_zone", type: "select", value: "utc",
    options: [["utc", "UTC"], ["local", `Your local time (${LOCAL_ZONE})`]] });
  const start = field({ label: "Start", name: "maintenance_start", type: "datetime-local", required: true });
  const length = field({ label: "Length", name: "maintenance_length", type: "select", value: "2", options: DURATIONS,
    hint: "Sets the end from the start; choose Custom to type the end yourself." });
  const end = field({ label: "End", name: "maintenance_end", type: "datetime-local", required: true,
    hint: "The host is not offered from the start until the end; a window may touch another, never overlap it." });
  const add = h("button", { type: "submit" }, "Add window");
  const form = h("form", { class: "card maintenance-form", novalidate: true, "aria-labelledby": "maintenance-form-title" },
    h("h3", { id: "maintenance-form-title" }, "Add a maintenance window"), zone.row, start.row, length.row, end.row, errors.el,
    h("div", { class: "actions" }, add));
  form.hidden = true;

  const fillEnd = () => {
    const from = parseInput(start.input.value, zone.input.value);
    if (length.input.value && from) end.input.value = toInput(new Date(from.getTime() + Number(length.input.value) * HOUR_MS), zone.input.value);
  };
  start.input.addEventListener("change", fillEnd);
  length.input.addEventListener("change", fillEnd);
  end.input.addEventListener("input", () => { length.input.value = ""; });
  zone.input.addEventListener("change", () => {
    // Keep the same moments when the reader switches how they are written.
    const before = zone.input.value === "utc" ? "local" : "utc";
    for (const f of [start, end]) {
      const d = parseInput(f.input.value, before);
      if (d) f.input.value = toInput(d, zone.input.value);
    }
  });

  const row = (w) => {
    const clear = h("button", { type: "button", class: "secondary", "aria-label": `Clear the window from ${utcText(w.start)}` }, "Clear");
    clear.addEventListener("click", async () => {
      errors.clear();
      await busy(clear, async () => {
        try {
          const listing = await api("DELETE", `${path}/maintenance-windows/${encodeURIComponent(w.start)}`);
          changed(listing);
          ctx.notify(`Maintenance window from ${utcText(w.start)} cleared.`);
        } catch (error) {
          if (error.status !== 401) errors.show(error);
        }
      }, "Clearing…");
    });
    const open = Date.parse(w.start) <= Date.now();
    return h("tr", { dataset: { start: w.start } },
      h("td", {}, h("time", { datetime: w.start }, utcText(w.start))), h("td", {}, h("time", { datetime: w.end }, utcText(w.end))),
      h("td", {}, `${localText(w.start)} – ${localText(w.end)}`), h("td", {}, open ? "open now" : "upcoming"), h("td", {}, clear));
  };

  const show = (listing) => {
    if (!ctx.alive()) return;
    if (!listing) {
      form.hidden = true;
      replace(listSlot, h("p", {}, "Set the host's price above first: maintenance windows belong to its listing."));
      return;
    }
    form.hidden = false;
    const windows = listing.maintenance_windows || [];
    replace(listSlot, table({ caption: `Upcoming windows (${windows.length}, at most 32)`, className: "maintenance-windows",
      columns: ["Start (UTC)", "End (UTC)", `Your local time (${LOCAL_ZONE})`, "Now", h("th", { scope: "col" }, h("span", { class: "visually-hidden" }, "Actions"))],
      rows: windows.map(row), empty: "No maintenance windows: the host is offered whenever it is online." }));
  };

  const changed = (listing) => {
    show(listing);
    events.dispatchEvent(new CustomEvent("windows", { detail: listing }));
  };
  events.addEventListener("listing", (event) => show(event.detail));

  (async () => {
    try {
      show(await api("GET", `${path}/listing`));
    } catch (error) {
      if (!ctx.alive()) return;
      if (error.code === "listing_not_found") show(null);
      else if (error.status !== 401) {
        listSlot.replaceChildren();
        errors.show(error);
      }
    }
  })();

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    errors.clear();
    const from = parseInput(start.input.value, zone.input.value);
    const until = parseInput(end.input.value, zone.input.value);
    if (!from || !until) {
      errors.show(!from ? "Enter the window's start date and time." : "Enter the window's end date and time, or choose a length.");
      (!from ? start : end).input.focus();
      return;
    }
    await busy(add, async () => {
      try {
        const listing = await api("POST", `${path}/maintenance-windows`, { body: { start: from.toISOString(), end: until.toISOString() } });
        changed(listing);
        ctx.notify(`Maintenance window added: ${utcText(from.toISOString().replace(/\.\d+Z$/, "Z"))} to ${utcText(until.toISOString().replace(/\.\d+Z$/, "Z"))}.`);
        start.input.value = "";
        end.input.value = "";
      } catch (error) {
        if (error.status === 401) return;
        errors.show(error);
        start.input.focus();
      }
    }, "Adding…");
  });

  return h("section", { "aria-labelledby": "maintenance-title", class: "maintenance", id: "maintenance" },
    h("h2", { id: "maintenance-title" }, "Maintenance windows"),
    h("p", { class: "hint" }, "Times the host is not offered to renters. Shown in UTC, with your local time beside."),
    listSlot, form);
}
