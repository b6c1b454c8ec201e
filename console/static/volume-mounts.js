// The Rent dialog's "Volumes" part (docs/volumes.md): the renter's ready volumes on the offer's host, each mounted
// at a path of its own, read-write or read-only. A volume lives on one host: only that host's are offered here.
import { api } from "./api.js";
import { field, h, link, replace } from "./dom.js";

/** Why `path` cannot be a mount point, or "" (the API's rule, shared.protocol.mount_problem, says more). */
function mountProblem(path) {
  if (!/^(\/[A-Za-z0-9._-]{1,64})+$/.test(path) || /\/\.\.?(\/|$)/.test(path)) {
    return "a mount point is an absolute path of plain folder names, e.g. /data";
  }
  if (path === "/workspace") return "/workspace is the rental's own disk: mount the volume elsewhere, e.g. /data";
  return "";
}

/**
 * {el, ready, read, describe}: read() → [{name, mount, read_only?}] for the volumes ticked (throws an Error with
 * .focus for a bad mount point); describe(list) → one line for the confirmation.
 */
export function volumeChooser(offer) {
  const list = h("div", { class: "volume-choices" }, h("p", { class: "loading" }, "Loading your volumes…"));
  const el = h("fieldset", { class: "volume-choice" }, h("legend", {}, "Volumes"), list);
  const rows = [];
  const ready = api("GET", "/volumes").then((body) => {
    const mine = (body.items || []).filter((v) => v.state === "ready" && v.host_id === offer.host_id);
    if (mine.length === 0) {
      replace(list, h("p", { class: "hint" }, "None of your volumes lives on this host. ",
        link("#/volumes", "Make one here"), " to keep files across rentals."));
      return;
    }
    replace(list, mine.map((v, i) => {
      const use = field({ label: `Mount ${v.name} (${v.size_gib} GiB)`, name: `volume-${v.name}`, type: "checkbox" });
      const mount = field({ label: `Mount point of ${v.name}`, name: `mount-${v.name}`, value: i === 0 ? "/data" : `/${v.name}`,
        spellcheck: "false", autocomplete: "off", autocapitalize: "none" });
      const readOnly = field({ label: `Read-only (${v.name})`, name: `ro-${v.name}`, type: "checkbox" });
      const sync = () => {
        mount.input.disabled = readOnly.input.disabled = !use.input.checked;
      };
      use.input.addEventListener("change", sync);
      sync();
      rows.push({ volume: v, use, mount, readOnly });
      return h("div", { class: "volume-row" }, use.row, mount.row, readOnly.row);
    }));
  }).catch((error) => {
    if (error && error.status === 401) return;
    replace(list, h("p", { class: "field-error" }, `Your volumes could not be loaded (${error.message}).`));
  });

  function read() {
    const chosen = [];
    for (const { volume, use, mount, readOnly } of rows) {
      if (!use.input.checked) continue;
      const path = mount.input.value.trim();
      const problem = mountProblem(path);
      if (problem) throw Object.assign(new Error(`${volume.name}: ${problem}.`), { focus: mount.input });
      chosen.push(readOnly.input.checked ? { name: volume.name, mount: path, read_only: true } : { name: volume.name, mount: path });
    }
    return chosen;
  }

  const describe = (volumes) => volumes.map((v) => `${v.name} at ${v.mount}${v.read_only ? " (read-only)" : ""}`).join(", ");
  return { el, ready, read, describe };
}
