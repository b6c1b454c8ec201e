// Passkeys (WebAuthn): the sign-in page's "Sign in with a passkey" and the security page's list (add, remove).
// The master hands out the options as JSON (binary fields base64url) and takes the browser's PublicKeyCredential back
// as JSON; the conversions both ways are here, in plain code (no library). docs/accounts.md, "Passkeys".

import { api } from "./api.js";
import { h, replace } from "./dom.js";
import { busy, errorBox } from "./ui.js";

function fromBase64url(text) {
  const base64 = text.replaceAll("-", "+").replaceAll("_", "/").padEnd(Math.ceil(text.length / 4) * 4, "=");
  return Uint8Array.from(atob(base64), (c) => c.charCodeAt(0)).buffer;
}

function toBase64url(buffer) {
  let text = "";
  for (const byte of new Uint8Array(buffer)) text += String.fromCharCode(byte);
  return btoa(text).replaceAll("+", "-").replaceAll("/", "_").replace(/=+$/, "");
}

/** Whether this browser can make and use passkeys here (a secure context with WebAuthn). */
export function passkeysSupported() {
  return window.isSecureContext && typeof window.PublicKeyCredential === "function";
}

/** Passkeys are bound to the relying party's domain: opened at another host (an IP address), they cannot work. */
function checkHost(rpId) {
  const host = location.hostname;
  if (host !== rpId && !host.endsWith(`.${rpId}`)) {
    const url = new URL(location.href);
    url.hostname = rpId;
    throw new Error(`Passkeys work on this marketplace at ${url.origin}/ — open the console there to use them.`);
  }
}

function creationOptions(json) {
  return { ...json, challenge: fromBase64url(json.challenge), user: { ...json.user, id: fromBase64url(json.user.id) },
    excludeCredentials: (json.excludeCredentials || []).map((c) => ({ ...c, id: fromBase64url(c.id) })) };
}

function requestOptions(json) {
  return { ...json, challenge: fromBase64url(json.challenge),
    allowCredentials: (json.allowCredentials || []).map((c) => ({ ...c, id: fromBase64url(c.id) })) };
}

function credentialJson(credential) {
  const { response } = credential;
  const json = { id: credential.id, rawId: toBase64url(credential.rawId), type: credential.type,
    authenticatorAttachment: credential.authenticatorAttachment || undefined,
    clientExtensionResults: credential.getClientExtensionResults(), response: { clientDataJSON: toBase64url(response.clientDataJSON) } };
  if (response.attestationObject) {
    json.response.attestationObject = toBase64url(response.attestationObject);
    json.response.transports = typeof response.getTransports === "function" ? response.getTransports() : [];
  } else {
    json.response.authenticatorData = toBase64url(response.authenticatorData);
    json.response.signature = toBase64url(response.signature);
    if (response.userHandle) json.response.userHandle = toBase64url(response.userHandle);
  }
  return json;
}

/** What a refused or cancelled browser prompt means to a person. */
function promptError(error) {
  if (error && error.name === "NotAllowedError") return new Error("The passkey prompt was cancelled or timed out. Try again.");
  if (error && error.name === "InvalidStateError") return new Error("This device has a passkey for your account already.");
  return error;
}

/** Sign in with a passkey (no email: the authenticator offers the ones it holds here); resolves the session. */
export async function signInWithPasskey() {
  const options = await api("POST", "/sessions/passkey/options", { body: {}, quietAuth: true });
  checkHost(options.rpId);
  let credential;
  try {
    credential = await navigator.credentials.get({ publicKey: requestOptions(options) });
  } catch (error) {
    throw promptError(error);
  }
  return api("POST", "/sessions/passkey", { body: { credential: credentialJson(credential) }, quietAuth: true });
}

/** The "Sign in with a passkey" part of #/signin: a button and its error box; `done(session)` once signed in. */
export function passkeySignIn(done) {
  if (!passkeysSupported()) return null;
  const box = errorBox();
  const button = h("button", { type: "button", class: "secondary", id: "passkey-sign-in" }, "Sign in with a passkey");
  button.addEventListener("click", () => busy(button, async () => {
    box.clear();
    try {
      done(await signInWithPasskey());
    } catch (error) {
      box.show(error);
    }
  }, "Waiting for your passkey…"));
  return h("div", { class: "card signin signin-passkey" }, box.el, h("div", { class: "actions" }, button));
}

/** #/security's passkeys card: the account's passkeys (name, added, last used), adding one, removing one. */
export function passkeysCard(card, ctx) {
  const box = errorBox();
  const list = h("ul", { class: "items passkeys", id: "passkey-list" });
  const name = h("input", { id: "passkey-name", name: "passkey-name", required: true, maxlength: "100", spellcheck: "false",
    placeholder: "laptop" });
  const add = h("button", { type: "submit", id: "passkey-add" }, "Add a passkey");
  const form = h("form", { class: "passkey-add", novalidate: true },
    h("div", { class: "field" }, h("label", { for: "passkey-name" }, "Name of the new passkey"), name), h("div", { class: "actions" }, add));
  const show = (passkeys) => {
    if (!ctx.alive()) return;
    replace(list, passkeys.length ? passkeys.map((passkey) => {
      const remove = h("button", { type: "button", class: "secondary small", "aria-label": `Remove passkey ${passkey.name}` }, "Remove");
      remove.addEventListener("click", () => busy(remove, async () => {
        box.clear();
        try {
          await api("DELETE", `/account/passkeys/${encodeURIComponent(passkey.id)}`);
          await load();
        } catch (error) {
          box.show(error);
        }
      }, "Removing…"));
      return h("li", {}, h("div", { class: "item-head" }, h("strong", { class: "passkey-name" }, passkey.name),
        ` · added ${new Date(passkey.created_at).toLocaleString()}`,
        ` · ${passkey.last_used_at ? `last used ${new Date(passkey.last_used_at).toLocaleString()}` : "never used"}`, " ", remove));
    }) : [h("li", { class: "empty" }, "No passkeys yet.")]);
  };
  const load = async () => show((await api("GET", "/account/passkeys")).passkeys);
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    box.clear();
    if (!name.value.trim()) {
      box.show("Name the passkey, so you can tell it from others (\"laptop\", \"phone\").");
      name.focus();
      return;
    }
    await busy(add, async () => {
      try {
        const options = await api("POST", "/account/passkeys/options", { body: {} });
        checkHost(options.rp.id);
        let credential;
        try {
          credential = await navigator.credentials.create({ publicKey: creationOptions(options) });
        } catch (error) {
          throw promptError(error);
        }
        await api("POST", "/account/passkeys", { body: { name: name.value.trim(), credential: credentialJson(credential) } });
        name.value = "";
        ctx.notify("The passkey is added: you can sign in with it.");
        await load();
      } catch (error) {
        box.show(error);
      }
    }, "Waiting for your passkey…");
  });
  replace(card, h("h2", {}, "Passkeys"),
    h("p", {}, "Sign in with your device's screen lock or a security key instead of a password and code."),
    list, box.el, passkeysSupported() ? form : h("p", { class: "hint" }, "This browser cannot make passkeys here (it needs HTTPS or localhost)."));
  load().catch((error) => box.show(error));
}
