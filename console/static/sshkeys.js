// The SSH keys page (#/ssh-keys): the public keys SSH into your rentals accepts. Paste a .pub
// file's line to add one (the API's refusal is shown at the field it is about), delete one after
// confirming. Every key shown is the acting account's own (GET /account/ssh-keys): a team's in its context. Below
// them, the private registry logins (registries.js).

import { acting, api } from "./api.js";
import { field, h, replace, table, timeEl } from "./dom.js";
import { busy, errorBox, heading, loadInto, showAtField, withError } from "./ui.js";
import { registriesSection } from "./registries.js";

export function sshKeysPage(page, ctx) {
  const errors = errorBox();
  const key = withError(field({ label: "Public key", name: "public_key", type: "textarea", rows: 4, spellcheck: "false",
    autocomplete: "off", autocapitalize: "off", class: "ssh-key-input", placeholder: "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAA… you@laptop",
    hint: "One line of your public key file, e.g. ~/.ssh/id_ed25519.pub (never the file without .pub). " +
      "Ed25519, ECDSA or RSA of 2048 bits or more. No key yet? ssh-keygen -t ed25519" }));
  const name = withError(field({ label: "Name (optional)", name: "name", maxlength: 100, autocomplete: "off",
    hint: "To tell your keys apart; the key's comment when empty." }));
  const add = h("button", { type: "submit" }, "Add key");
  const form = h("form", { class: "card ssh-key-form", novalidate: true, "aria-labelledby": "add-key-title" },
    h("h2", { id: "add-key-title" }, "Add a key"), key.row, name.row, errors.el, h("div", { class: "actions" }, add));
  const listSlot = h("div", {});
  const fields = { public_key: key, name };

  const clearAll = () => {
    errors.clear();
    key.clear();
    name.clear();
  };

  /** The API's refusal at the field it names (details.problems[0].field), else in the form's box. */
  const showError = (error) => {
    if (!showAtField(error, fields)) {
      errors.show(error);
      if (error.code === "ssh_key_exists" || error.code === "too_many_ssh_keys") key.input.focus();
    }
  };

  const row = (k) => {
    const del = h("button", { type: "button", class: "secondary", "aria-label": `Delete key ${k.name}` }, "Delete");
    const cell = h("td", { class: "key-actions" }, del);
    const tr = h("tr", { dataset: { sshKeyId: k.id } },
      h("td", {}, k.name), h("td", {}, k.algorithm), h("td", {}, h("code", { class: "fingerprint" }, k.fingerprint)),
      h("td", {}, timeEl(k.created_at)), h("td", {}, k.last_used_at ? timeEl(k.last_used_at) : "never"), cell);
    del.addEventListener("click", () => {
      const yes = h("button", { type: "button", class: "danger" }, "Yes, delete");
      const no = h("button", { type: "button", class: "secondary" }, "Keep it");
      no.addEventListener("click", () => {
        replace(cell, del);
        del.focus();
      });
      yes.addEventListener("click", async () => {
        errors.clear();
        await busy(yes, async () => {
          try {
            await api("DELETE", `/account/ssh-keys/${encodeURIComponent(k.id)}`);
            ctx.notify(`Key ${k.name} deleted; SSH no longer accepts it.`);
            await showKeys(); // not quietly: the focus is on this row, which a quiet refresh would leave alone
          } catch (error) {
            replace(cell, del);
            if (error.status !== 401) errors.show(error);
          }
        }, "Deleting…");
      });
      replace(cell, h("p", { class: "confirm-text" }, "Delete this key? SSH stops accepting it."), h("div", { class: "actions" }, yes, no));
      no.focus();
    });
    return tr;
  };

  const showKeys = loadInto(ctx, listSlot, async () => {
    const { ssh_keys: keys } = await api("GET", "/account/ssh-keys");
    return h("section", { class: "card", "aria-labelledby": "keys-title" }, h("h2", { id: "keys-title" }, "Your keys"),
      table({ caption: `${keys.length} key${keys.length === 1 ? "" : "s"} (at most 50)`, className: "ssh-keys",
        columns: ["Name", "Type", "Fingerprint (SHA256)", "Added", "Last used", h("th", { scope: "col" }, h("span", { class: "visually-hidden" }, "Actions"))],
        rows: keys.map(row), empty: "No keys yet: add one above to SSH into your rentals." }));
  });

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    clearAll();
    const text = key.input.value.trim();
    if (!text) {
      key.show("Paste your public key: the contents of a .pub file, e.g. ~/.ssh/id_ed25519.pub.");
      key.input.focus();
      return;
    }
    const body = { public_key: text };
    if (name.input.value.trim()) body.name = name.input.value.trim();
    await busy(add, async () => {
      try {
        const created = await api("POST", "/account/ssh-keys", { body });
        ctx.notify(`Key ${created.name} added (${created.fingerprint}).`);
        key.input.value = "";
        name.input.value = "";
        await showKeys(true);
      } catch (error) {
        if (error.status !== 401) showError(error);
      }
    }, "Adding…");
  });

  replace(page, heading("SSH keys", acting.team
    ? `The public keys SSH into team ${acting.team.name}'s rentals accepts. The team's members see them.`
    : "The public keys SSH into your rentals accepts. Only you see them."), form, listSlot,
    registriesSection(ctx));
}
