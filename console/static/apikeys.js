// #/api-keys: the account's API keys — make one (named, scoped, expiring, bound to networks; its secret shown once),
// see them (never their secrets) and revoke one.

import { api } from "./api.js";
import { h, replace } from "./dom.js";
import { busy, copyable, errorBox, heading } from "./ui.js";

const SCOPES = [
  ["read", "read: see everything of the account"],
  ["rent", "rent: rentals, clusters, services, SSH keys"],
  ["billing", "billing: credit, spend cap, invoices"],
  ["provider", "provider: hosts, listings, enrolment"],
  ["admin", "admin: the operators' routes"],
];

function when(iso) {
  return iso ? new Date(iso).toLocaleString() : "never";
}

export function apiKeysPage(el, ctx) {
  const list = h("div", { class: "card", id: "api-key-list" }, "Loading…");
  const made = h("div", { id: "api-key-made" });
  const box = errorBox();
  const name = h("input", { id: "key-name", name: "name", required: true, maxlength: "100", spellcheck: "false" });
  // The scopes the account's role can use (a key's scope never lends a role: a renter's provider scope does nothing).
  const mine = { renter: ["read", "rent", "billing"], provider: ["read", "provider", "billing"] }[ctx.role];
  const boxes = SCOPES.filter(([scope]) => !mine || mine.includes(scope)).map(([scope, label]) => {
    const input = h("input", { type: "checkbox", id: `scope-${scope}`, value: scope, checked: scope === "read" });
    return { scope, input, el: h("label", { for: `scope-${scope}` }, input, ` ${label}`) };
  });
  const days = h("input", { id: "key-days", name: "days", type: "number", min: "1", max: "3650", inputmode: "numeric" });
  const networks = h("input", { id: "key-networks", name: "networks", spellcheck: "false", placeholder: "e.g. 203.0.113.0/24" });
  const submit = h("button", { type: "submit" }, "Make key");
  const form = h("form", { class: "card key-form", novalidate: true },
    h("div", { class: "field" }, h("label", { for: "key-name" }, "Name"), name),
    h("fieldset", { class: "field scopes" }, h("legend", {}, "Scopes"), boxes.map((b) => b.el)),
    h("details", { class: "key-limits" }, h("summary", {}, "Expiry and networks"),
      h("div", { class: "field" }, h("label", { for: "key-days" }, "Expires after (days)"), days,
        h("p", { class: "hint" }, "Empty: never.")),
      h("div", { class: "field" }, h("label", { for: "key-networks" }, "Only from"), networks,
        h("p", { class: "hint" }, "Addresses or networks, separated by spaces or commas. Empty: anywhere."))),
    box.el, h("div", { class: "actions" }, submit));

  async function load() {
    const answer = await api("GET", "/api-keys");
    if (!ctx.alive()) return;
    const rows = answer.items.filter((k) => k.state === "active").map((k) => {
      const revoke = h("button", { type: "button", class: "secondary small", "aria-label": `Revoke ${k.name}` }, "Revoke");
      revoke.addEventListener("click", () => busy(revoke, async () => {
        await api("DELETE", `/api-keys/${encodeURIComponent(k.id)}`);
        ctx.notify(`Revoked ${k.name}: it works nowhere from now on.`);
        await load();
      }, "Revoking…"));
      return h("li", {}, h("div", { class: "item-head" }, h("strong", {}, k.name), " ", h("code", {}, `${k.prefix}…`), " ", revoke),
        h("p", { class: "item-detail" }, `scopes ${k.all_scopes ? "all" : k.scopes.join(", ")} · expires ${when(k.expires_at)}`
          + ` · from ${(k.allowed_networks || ["anywhere"]).join(", ")} · last used ${when(k.last_used_at)}`));
    });
    replace(list, rows.length ? h("ul", { class: "items" }, rows) : h("p", {}, "No active keys."));
  }

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    box.clear();
    const scopes = boxes.filter((b) => b.input.checked).map((b) => b.scope);
    if (!name.value.trim()) {
      box.show("Give the key a name.");
      name.focus();
      return;
    }
    if (!scopes.length) {
      box.show("Choose at least one scope.");
      return;
    }
    const body = { name: name.value.trim(), scopes };
    if (days.value) body.expires_at = new Date(Date.now() + Number(days.value) * 86400000).toISOString();
    const nets = networks.value.split(/[\s,]+/).filter(Boolean);
    if (nets.length) body.allowed_networks = nets;
    await busy(submit, async () => {
      try {
        const key = await api("POST", "/api-keys", { body });
        replace(made, h("div", { class: "card made-key" }, h("p", {}, `Your new key ${key.name}. Copy it now: it is not shown again.`),
          copyable(key.key, { id: "new-api-key", label: "Copy the key", anywhere: true })));
        name.value = "";
        await load();
      } catch (error) {
        box.show(error);
      }
    }, "Making…");
  });

  replace(el, heading("API keys", "Keys for the CLI and the API. Give each only the scopes its job needs."), made, form, list);
  load().catch((error) => {
    const failed = errorBox();
    failed.show(error);
    replace(list, failed.el);
  });
}

/** #/device/<code>: approve a CLI's sign-in (`gpumarket login --browser`) with the scopes its key may have. */
export function devicePage(el, ctx) {
  const box = errorBox();
  const given = ctx.params[0] || "";
  const code = h("input", { id: "device-code", name: "code", value: given, autocomplete: "off", spellcheck: "false",
    placeholder: "e.g. BCDF-GHJK" });
  const mine = { renter: ["read", "rent", "billing"], provider: ["read", "provider", "billing"] }[ctx.role];
  const boxes = SCOPES.filter(([scope]) => !mine || mine.includes(scope)).map(([scope, label]) => {
    const input = h("input", { type: "checkbox", id: `device-scope-${scope}`, value: scope, checked: scope !== "admin" });
    return { scope, input, el: h("label", { for: `device-scope-${scope}` }, input, ` ${label}`) };
  });
  const who = h("p", { id: "device-client", role: "status" });
  const approve = h("button", { type: "submit" }, "Approve");
  const form = h("form", { class: "card key-form", novalidate: true },
    h("div", { class: "field" }, h("label", { for: "device-code" }, "Code the CLI shows"), code), who,
    h("fieldset", { class: "field scopes" }, h("legend", {}, "The new key's scopes"), boxes.map((b) => b.el)),
    box.el, h("div", { class: "actions" }, approve));
  const look = async () => {
    if (!code.value.trim()) return;
    try {
      const waiting = await api("GET", `/device-codes/${encodeURIComponent(code.value.trim())}`);
      who.textContent = `${waiting.client_name} asks to sign in as you.`;
    } catch (error) {
      box.show(error);
    }
  };
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    box.clear();
    const scopes = boxes.filter((b) => b.input.checked).map((b) => b.scope);
    if (!scopes.length) {
      box.show("Choose at least one scope.");
      return;
    }
    await busy(approve, async () => {
      try {
        await api("POST", `/device-codes/${encodeURIComponent(code.value.trim())}/approve`, { body: { scopes } });
        replace(el, heading("Approved", "The CLI is signed in: it saved a new API key with the scopes you chose. You can close this page."),
          h("p", {}, h("a", { href: "#/api-keys" }, "See your API keys")));
      } catch (error) {
        box.show(error);
      }
    }, "Approving…");
  });
  code.addEventListener("change", look);
  replace(el, heading("Sign in the CLI", "Approve only a code you started yourself with gpumarket login --browser."), form);
  look();
}
