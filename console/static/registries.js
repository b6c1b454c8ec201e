// Private registry logins, a section of the SSH keys page: the credentials a rental's start sends to pull an image
// under their prefix (GET/POST/DELETE /registry-credentials). Prefix, user name and dates only: the secret goes in
// once and the API never shows it again. They are the acting account's: a team's in its context.

import { api } from "./api.js";
import { field, h, replace, table, timeEl, wrapAt } from "./dom.js";
import { busy, errorBox, loadInto, showAtField, withError } from "./ui.js";

export function registriesSection(ctx) {
  const errors = errorBox();
  const prefix = withError(field({ label: "Images under", name: "prefix", autocomplete: "off", spellcheck: "false",
    autocapitalize: "off", placeholder: "registry.example.com:5000/myorg/",
    hint: "A registry host and optionally a path (docker.io/myorg/ for Docker Hub). The same prefix again replaces its login." }));
  const username = withError(field({ label: "User name", name: "username", autocomplete: "off", spellcheck: "false", autocapitalize: "off" }));
  const password = withError(field({ label: "Password or access token", name: "password", type: "password", autocomplete: "new-password",
    hint: "Stored sealed; never shown again." }));
  const fields = { prefix, username, password };
  const add = h("button", { type: "submit" }, "Add login");
  const form = h("form", { class: "registry-form", novalidate: true, "aria-label": "Add a registry login" },
    h("div", { class: "grid" }, prefix.row, username.row, password.row), errors.el, h("div", { class: "actions" }, add));
  const listSlot = h("div", {});

  const row = (c) => {
    const remove = h("button", { type: "button", class: "secondary small", "aria-label": `Remove the login for ${c.prefix}` }, "Remove");
    remove.addEventListener("click", () => busy(remove, async () => {
      errors.clear();
      try {
        await api("DELETE", `/registry-credentials/${encodeURIComponent(c.id)}`);
        ctx.notify(`The login for ${c.prefix} is removed: rentals started from now on pull without it.`);
        await show();
      } catch (error) {
        if (error.status !== 401) errors.show(error);
      }
    }, "Removing…"));
    return h("tr", { dataset: { registryCredentialId: c.id } }, h("td", {}, h("code", { class: "registry-prefix" }, wrapAt(c.prefix))), h("td", {}, c.username),
      h("td", {}, timeEl(c.created_at)), h("td", {}, c.last_used_at ? timeEl(c.last_used_at) : "never"), h("td", { class: "row-actions" }, remove));
  };

  const show = loadInto(ctx, listSlot, async () => {
    const { items } = await api("GET", "/registry-credentials");
    return table({ caption: `${items.length} login${items.length === 1 ? "" : "s"}`, className: "registry-credentials",
      columns: ["Prefix", "User name", "Added", "Last used", h("th", { scope: "col" }, h("span", { class: "visually-hidden" }, "Actions"))],
      rows: items.map(row), empty: "No registry logins: public images need none." });
  });

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    errors.clear();
    for (const f of Object.values(fields)) f.clear();
    const empty = Object.values(fields).find((f) => !f.input.value.trim());
    if (empty) {
      empty.show("Fill this in.");
      empty.input.focus();
      return;
    }
    const body = { prefix: prefix.input.value.trim(), username: username.input.value.trim(), password: password.input.value };
    await busy(add, async () => {
      try {
        const saved = await api("POST", "/registry-credentials", { body });
        ctx.notify(`Login for ${saved.prefix} saved as ${saved.username}.`);
        for (const f of Object.values(fields)) f.input.value = "";
        await show(true);
      } catch (error) {
        if (error.status === 401) return;
        if (!showAtField(error, fields)) errors.show(error);
      } finally {
        password.input.value = "";
      }
    }, "Saving…");
  });

  return h("section", { class: "card registries", id: "registries", "aria-labelledby": "registries-title" },
    h("h2", { id: "registries-title" }, "Private registry logins"),
    h("p", { class: "hint block" }, "For images in a private registry: a rental whose image is under a prefix pulls it with that login."),
    form, listSlot);
}
