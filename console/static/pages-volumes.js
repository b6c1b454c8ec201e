// Renter page for volumes (#/volumes, over /api/v1/volumes; docs/volumes.md): a disk of its own on one host that
// outlives rentals. The form makes one (on a host, in a region, or on the cheapest host with room), the list shows
// each with its state, size, host, cost per hour and the rentals that mount it, and Delete asks first. While one is
// being made or deleted the list refreshes itself until its host's agent has answered.

import { api, uuid4 } from "./api.js";
import { badge, field, h, replace, table, timeEl } from "./dom.js";
import { usdRate } from "./money.js";
import { busy, confirmedAction, errorBox, heading, loadInto, showAtField, withError } from "./ui.js";

const NAME_RE = /^[a-z0-9][a-z0-9._-]{0,63}$/;
const ID_RE = /^vol-[0-9a-f]{16}$/;
const MAX_GIB = 65536; // shared.protocol.MAX_VOLUME_GIB
const LIST_LIMIT = 100;
const REFRESH_MS = 2000;
const MOVING = new Set(["creating", "deleting"]);

function mountsCell(volume) {
  const mounts = volume.mounted_by || [];
  if (!mounts.length) return "—";
  return h("span", {}, mounts.map((m, i) => [i ? ", " : "", h("a", { href: `#/rentals/${encodeURIComponent(m.rental_id)}` }, m.rental_id),
    ` at ${m.mount}${m.read_only ? " (read-only)" : ""}`]));
}

function stateCell(volume) {
  const state = badge(volume.state);
  if (volume.state !== "failed") return state;
  return h("span", {}, state, h("span", { class: "hint block volume-failure" }, `${volume.failure_code}: ${volume.failure_reason || ""}`));
}

export function volumesPage(page, ctx) {
  const errors = errorBox();
  const listErrors = errorBox();
  const name = withError(field({ label: "Name", name: "name", autocomplete: "off", spellcheck: "false", autocapitalize: "off",
    placeholder: "data", hint: "Lower-case letters, digits, '-', '_', '.'; rentals mount it by this name." }));
  const size = withError(field({ label: "Size, GiB", name: "size_gib", type: "number", min: "1", max: String(MAX_GIB), step: "1",
    inputmode: "numeric", value: "10", hint: "A hard limit, billed per GiB-hour until you delete it." }));
  const region = withError(field({ label: "Region (optional)", name: "region", autocomplete: "off", spellcheck: "false", autocapitalize: "off",
    placeholder: "eu-west", hint: "The cheapest host with room there; empty: anywhere." }));
  const host = withError(field({ label: "Host (optional)", name: "host_id", autocomplete: "off", spellcheck: "false", autocapitalize: "off",
    placeholder: "h-0123456789abcdef", hint: "This host only (offers show each host's storage price and room)." }));
  const fields = { name, size_gib: size, region, host_id: host };
  const create = h("button", { type: "submit", id: "create-volume" }, "Create volume");
  const form = h("form", { class: "card volume-form", novalidate: true, "aria-labelledby": "volume-form-title" },
    h("h2", { id: "volume-form-title" }, "New volume"),
    h("p", { class: "hint block" }, "It outlives your rentals and the host's reboots, not the loss of the host's disk: keep a copy of what you cannot lose."),
    h("div", { class: "grid" }, name.row, size.row, region.row, host.row), errors.el, h("div", { class: "actions" }, create));
  const showDeleted = field({ label: "Show deleted volumes", name: "deleted", type: "checkbox" });
  const slot = h("div", {});
  replace(page, heading("Volumes", "Disks that outlive rentals: made once on a host, mounted by the rentals you start there."),
    form, h("section", { class: "volumes-list", "aria-label": "Your volumes" }, showDeleted.row, listErrors.el, slot));

  const confirming = new Map(); // volume id → { confirming } while its Delete asks
  let timer = null;

  const deleteCell = (volume) => {
    const cell = h("td", { class: "row-actions" });
    if (volume.state === "deleting" || volume.state === "deleted") return cell;
    const state = confirming.get(volume.id) || { confirming: false };
    confirming.set(volume.id, state);
    const draw = () => replace(cell, confirmedAction({
      slot: cell, errors: listErrors, state, id: `delete-${volume.id}`, confirmId: `confirm-delete-${volume.id}`,
      label: "Delete", confirmLabel: "Delete it and its files", keepLabel: "Keep it", busyLabel: "Deleting…", buttonClass: "secondary small",
      question: `Delete ${volume.name} (${volume.size_gib} GiB)? Its files are gone for good.`, redraw: draw,
      act: async () => {
        const deleted = await api("DELETE", `/volumes/${encodeURIComponent(volume.id)}`);
        state.confirming = false;
        ctx.notify(`Volume ${deleted.name} is ${deleted.state}: billing stopped.`);
        await load(true);
      },
    }));
    draw();
    return cell;
  };

  const row = (v) => h("tr", { dataset: { volumeId: v.id } },
    h("td", {}, h("strong", { class: "volume-name" }, v.name), h("code", { class: "hint block" }, v.id)),
    h("td", {}, stateCell(v)),
    h("td", {}, `${v.size_gib} GiB`),
    h("td", {}, h("code", {}, v.host_id), v.region ? h("span", { class: "hint block" }, v.region) : null),
    h("td", {}, `${usdRate(v.cost_per_hour)}/h`, h("span", { class: "hint block" }, `${usdRate(v.price_per_gib_hour)} per GiB-hour`)),
    h("td", {}, mountsCell(v)),
    h("td", {}, timeEl(v.created_at)),
    deleteCell(v));

  const load = loadInto(ctx, slot, async () => {
    const body = await api("GET", `/volumes?limit=${LIST_LIMIT}${showDeleted.input.checked ? "&deleted=true" : ""}`);
    clearTimeout(timer);
    if (body.items.some((v) => MOVING.has(v.state))) timer = setTimeout(() => load(true), REFRESH_MS);
    return table({ caption: `Volumes (${body.total})`, className: "volumes",
      columns: ["Volume", "State", "Size", "Host", "Cost", "Mounted by", "Created", h("th", { scope: "col" }, h("span", { class: "visually-hidden" }, "Actions"))],
      rows: body.items.map(row), empty: "No volumes yet. Make one above: your data then outlives every rental." });
  });
  showDeleted.input.addEventListener("change", () => load());
  ctx.onLeave(() => clearTimeout(timer));

  const check = () => {
    const wanted = name.input.value.trim();
    if (!NAME_RE.test(wanted) || ID_RE.test(wanted)) {
      return [name, "Use 1 to 64 lower-case letters, digits, '-', '_' or '.', starting with a letter or digit (not a volume id)."];
    }
    const gib = Number(size.input.value);
    if (!Number.isInteger(gib) || gib < 1 || gib > MAX_GIB) return [size, `A whole number of GiB from 1 to ${MAX_GIB}.`];
    if (region.input.value.trim() && host.input.value.trim()) return [host, "Give a host or a region, not both."];
    return null;
  };

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    errors.clear();
    for (const f of Object.values(fields)) f.clear();
    const problem = check();
    if (problem) {
      problem[0].show(problem[1]);
      problem[0].input.focus();
      return;
    }
    const body = { name: name.input.value.trim(), size_gib: Number(size.input.value) };
    if (region.input.value.trim()) body.region = region.input.value.trim();
    if (host.input.value.trim()) body.host_id = host.input.value.trim();
    await busy(create, async () => {
      try {
        const made = await api("POST", "/volumes", { body, headers: { "Idempotency-Key": uuid4() } });
        ctx.notify(`Volume ${made.name} is ${made.state} on host ${made.host_id}: ${made.size_gib} GiB at ${usdRate(made.cost_per_hour)}/h.`);
        name.input.value = "";
        await load(true);
      } catch (error) {
        if (error.status === 401) return;
        if (showAtField(error, fields)) return;
        if (error.code === "invalid_volume_name" || error.code === "volume_name_taken") {
          name.show(error.message);
          name.input.focus();
        } else {
          errors.show(error);
        }
      }
    }, "Creating…");
  });
}
