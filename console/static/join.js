// The pages a stranger sees: sign in (email and password, or an API key), sign up, verify the address from the
// mailed link (#/verify/<token>), ask for a reset link (#/reset) and choose a new password (#/reset/<token>); and,
// signed in, the account's security page (#/security: second factor, passkeys, audit log, sign out everywhere) and the
// banner that asks an unverified account to open its link.

import { api, session } from "./api.js";
import { h, idText, replace } from "./dom.js";
import { passkeySignIn, passkeysCard } from "./passkeys.js";
import { busy, copyable, errorBox, heading } from "./ui.js";

/** Public pages by path; each renders into `main` and calls `done(session)` once the visitor is signed in. */
export const PUBLIC = [
  { path: /^\/signin$/, render: signInPage },
  { path: /^\/signup$/, render: signUpPage },
  { path: /^\/verify\/([^/]+)$/, render: verifyPage },
  { path: /^\/reset$/, render: resetRequestPage },
  { path: /^\/reset\/([^/]+)$/, render: resetPage },
];

function field(id, label, attrs, hint) {
  const input = h("input", { id, name: id, required: true, spellcheck: "false", ...attrs,
    "aria-describedby": hint ? `${id}-hint` : null });
  return { input, el: h("div", { class: "field" }, h("label", { for: id }, label), input,
    hint ? h("p", { class: "hint", id: `${id}-hint` }, hint) : null) };
}

function page(main, title, ...children) {
  document.title = `${title} · gpumarket`;
  replace(main, h("div", { class: "page page-signin" }, heading(title), ...children));
}

function links(...items) {
  return h("p", { class: "join-links" }, items.flatMap((item, i) => (i ? [" · ", item] : [item])));
}

/** A form whose submit runs `act` (busy button, errors in the box); `act` returns false to keep the form as it is. */
function form(className, fields, submitLabel, busyLabel, act) {
  const box = errorBox();
  const submit = h("button", { type: "submit" }, submitLabel);
  const el = h("form", { class: `card signin ${className}`, novalidate: true }, fields.map((f) => f.el), box.el,
    h("div", { class: "actions" }, submit));
  el.addEventListener("submit", async (event) => {
    event.preventDefault();
    box.clear();
    const empty = fields.find((f) => !f.input.value.trim());
    if (empty) {
      box.show(`Fill in ${empty.el.querySelector("label").textContent.toLowerCase()}.`);
      empty.input.focus();
      return;
    }
    await busy(submit, async () => {
      try {
        await act();
      } catch (error) {
        box.show(error);
      }
    }, busyLabel);
  });
  return el;
}

export function signInPage(main, { message, isProblem, done }) {
  const box = errorBox();
  const info = h("p", { class: "info", role: "status" });
  if (message && isProblem) box.show(message);
  else if (message) info.textContent = message;
  const email = field("email", "Email", { type: "email", autocomplete: "username" });
  const password = field("password", "Password", { type: "password", autocomplete: "current-password" });
  const code = field("totp-code", "Code from your authenticator app", { autocomplete: "one-time-code", inputmode: "numeric" },
    "Six digits, or one of your recovery codes.");
  const fields = [email, password];
  const byPassword = form("signin-password", fields, "Sign in", "Signing in…", async () => {
    const body = { email: email.input.value.trim(), password: password.input.value };
    if (fields.includes(code)) body.totp_code = code.input.value.trim();
    let opened;
    try {
      opened = await api("POST", "/sessions", { body, quietAuth: true });
    } catch (error) {
      if (error.code === "totp_required" && !fields.includes(code)) {
        fields.push(code);
        password.el.after(code.el);
        code.input.focus();
        throw new Error("Your account has a second factor: type the code your authenticator app shows.");
      }
      throw error;
    }
    password.input.value = "";
    done(opened);
  });
  const key = field("api-key", "API key", { type: "password", autocomplete: "off" },
    "Your account's API key (gmk_…). The demo's keys are in credentials.json in the data directory.");
  const byKey = form("signin-key", [key], "Sign in with the API key", "Signing in…", async () => {
    const opened = await api("POST", "/sessions", { body: { api_key: key.input.value.trim() }, quietAuth: true });
    key.input.value = "";
    done(opened);
  });
  page(main, "Sign in to gpumarket", info, box.el, byPassword, passkeySignIn(done),
    links(h("a", { href: "#/signup" }, "Create an account"), h("a", { href: "#/reset" }, "Forgot your password?")),
    h("h2", { class: "signin-or" }, "Or with an API key"), byKey);
  email.input.focus();
}

function signUpPage(main) {
  const email = field("email", "Email", { type: "email", autocomplete: "email" }, "We mail you a link to verify it.");
  const password = field("password", "Password", { type: "password", autocomplete: "new-password", minlength: "10" },
    "At least 10 characters, not a common password. A few unrelated words are easy to remember.");
  const renter = h("input", { type: "radio", name: "role", id: "role-renter", value: "renter", checked: true });
  const provider = h("input", { type: "radio", name: "role", id: "role-provider", value: "provider" });
  // Both: a renter account with a provider team of its own, switched to in the header ("Acting for").
  const both = h("input", { type: "radio", name: "role", id: "role-both", value: "both" });
  const roles = { input: { value: "x" }, el: h("fieldset", { class: "field roles" }, h("legend", {}, "I want to"),
    h("label", { for: "role-renter" }, renter, " rent GPUs"), h("label", { for: "role-provider" }, provider, " offer my GPUs"),
    h("label", { for: "role-both" }, both, " do both")) };
  const el = form("signup", [email, password, roles], "Create account", "Creating…", async () => {
    const answer = await api("POST", "/accounts", { body: { email: email.input.value.trim(), password: password.input.value,
      role: [renter, provider, both].find((input) => input.checked).value }, quietAuth: true });
    page(main, "Check your mail", h("p", { class: "info", role: "status", id: "signup-sent" },
      `${answer.status[0].toUpperCase()}${answer.status.slice(1)}. Then sign in with your email and password.`),
    links(h("a", { href: "#/signin" }, "Sign in")));
  });
  page(main, "Create your gpumarket account", el, links(h("a", { href: "#/signin" }, "I have an account")));
  email.input.focus();
}

function verifyPage(main, { params }) {
  const status = h("p", { class: "info", role: "status", id: "verify-status" }, "Verifying your address…");
  const box = errorBox();
  page(main, "Verify your address", status, box.el, links(h("a", { href: "#/" }, "Go to the console")));
  api("POST", "/accounts/verify", { body: { token: params[0] }, quietAuth: true }).then((answer) => {
    status.textContent = `${answer.email} is verified: you can rent and enrol hosts now.`;
    if (session.current) session.current.account.email_verified = true;
  }, (error) => {
    status.textContent = "";
    box.show(error);
  });
}

function resetRequestPage(main) {
  const email = field("email", "Email", { type: "email", autocomplete: "username" });
  const el = form("reset-request", [email], "Mail me a link", "Sending…", async () => {
    const answer = await api("POST", "/password-resets", { body: { email: email.input.value.trim() }, quietAuth: true });
    page(main, "Check your mail", h("p", { class: "info", role: "status" }, `${answer.status[0].toUpperCase()}${answer.status.slice(1)}.`),
      links(h("a", { href: "#/signin" }, "Sign in")));
  });
  page(main, "Reset your password", el, links(h("a", { href: "#/signin" }, "Back to sign in")));
  email.input.focus();
}

function resetPage(main, { params }) {
  const password = field("password", "New password", { type: "password", autocomplete: "new-password", minlength: "10" },
    "At least 10 characters, not a common password. Every browser signed in to your account is signed out.");
  const el = form("reset", [password], "Set the password", "Saving…", async () => {
    await api("POST", "/password-resets/confirm", { body: { token: params[0], password: password.input.value }, quietAuth: true });
    session.current = null;
    history.replaceState(null, "", "#/signin");
    signInPage(main, { message: "Your password is set: sign in with it.", isProblem: false, done: () => location.reload() });
  });
  page(main, "Choose a new password", el);
  password.input.focus();
}

/** The banner an account whose address is not verified sees on every page. */
export function verifyBanner(account) {
  if (!account || account.email_verified !== false) return null;
  const status = h("span", { role: "status" });
  const again = h("button", { type: "button", class: "secondary small", id: "resend-verification" }, "Send the link again");
  again.addEventListener("click", () => busy(again, async () => {
    try {
      const answer = await api("POST", "/accounts/verify/resend");
      status.textContent = ` ${answer.status[0].toUpperCase()}${answer.status.slice(1)}.`;
    } catch (error) {
      status.textContent = ` ${error.message}`;
    }
  }, "Sending…"));
  return h("div", { class: "verify-banner", id: "verify-banner" },
    "Verify your email address to rent GPUs or enrol hosts: open the link we mailed you. ", again, status);
}

/** #/security: the second factor, passkeys, the account's audit log, and signing out of every browser. */
export function securityPage(el, ctx) {
  const log = h("div", { class: "card" }, "Loading…");
  const everywhere = h("button", { type: "button", class: "secondary", id: "sign-out-everywhere" }, "Sign out everywhere");
  const status = h("p", { class: "info", role: "status" });
  everywhere.addEventListener("click", () => busy(everywhere, async () => {
    const answer = await api("DELETE", "/sessions");
    status.textContent = `Signed out of ${answer.sessions_ended} session(s), this one too.`;
    session.current = null;
    setTimeout(() => location.reload(), 1500);
  }, "Signing out…"));
  const factor = h("div", { class: "card", id: "second-factor" }, "Loading…");
  const keys = h("div", { class: "card", id: "passkeys" }, "Loading…");
  replace(el, heading("Security", "Your second factor, passkeys, signing out everywhere, and what happened to how your account signs in."),
    factor, keys, h("div", { class: "actions" }, everywhere), status, h("h2", {}, "Recent events"), log);
  secondFactor(factor, ctx);
  passkeysCard(keys, ctx);
  api("GET", "/audit-events?limit=100", { personal: true }).then((page_) => {
    if (!ctx.alive()) return;
    const rows = page_.items.map((item) => h("li", {},
      h("div", { class: "item-head" }, h("strong", {}, item.kind.replaceAll("_", " ")), ` · ${new Date(item.at).toLocaleString()}`,
        ` · from ${item.address || "—"}`),
      h("p", { class: "item-detail" }, idText(Object.entries(item.detail).map(([k, v]) => `${k.replaceAll("_", " ")}: ${v}`).join(", ")))));
    replace(log, rows.length ? h("ul", { class: "items audit" }, rows) : h("p", {}, "Nothing yet."));
  }, (error) => {
    const box = errorBox();
    box.show(error);
    replace(log, box.el);
  });
}

/** The TOTP second factor: turn it on (secret, confirm with a code, recovery codes once) or off. */
function secondFactor(card, ctx) {
  const box = errorBox();
  const show = (state) => {
    if (!ctx.alive()) return;
    if (state.enabled) {
      const off = field("totp-off", "Code (or a recovery code)", { autocomplete: "one-time-code" });
      const el = form("totp-disable", [off], "Turn off", "Turning off…", async () => {
        show(await api("POST", "/account/totp/disable", { body: { code: off.input.value.trim() } }));
        ctx.notify("The second factor is off.");
      });
      replace(card, h("h2", {}, "Second factor: on"), h("p", {}, `Signing in by password asks for a code. Recovery codes left: ${state.recovery_codes_left}.`), el);
      return;
    }
    const start = h("button", { type: "button", id: "totp-start" }, "Turn on a second factor");
    start.addEventListener("click", () => busy(start, async () => {
      try {
        const begun = await api("POST", "/account/totp", { body: {} });
        const confirm = field("totp-confirm", "Code from the app", { autocomplete: "one-time-code", inputmode: "numeric" });
        const el = form("totp-confirm", [confirm], "Confirm", "Confirming…", async () => {
          const on = await api("POST", "/account/totp/confirm", { body: { code: confirm.input.value.trim() } });
          replace(card, h("h2", {}, "Second factor: on"),
            h("p", {}, "Store these recovery codes somewhere safe now: each signs in once if you lose your phone. They are not shown again."),
            h("ul", { class: "recovery-codes", id: "recovery-codes" }, on.recovery_codes.map((c) => h("li", {}, h("code", {}, c)))));
        });
        replace(card, h("h2", {}, "Set up the second factor"),
          h("p", {}, "Add this key to your authenticator app (or open the link on your phone), then type the code it shows."),
          copyable(begun.secret.match(/.{1,4}/g).join(" "), { id: "totp-secret", label: "Copy the key" }),
          copyable(begun.otpauth_uri, { id: "totp-uri", label: "Copy the link", anywhere: true }), el);
      } catch (error) {
        box.show(error);
      }
    }, "Starting…"));
    replace(card, h("h2", {}, "Second factor: off"), h("p", {}, "With it on, signing in by password also asks for a code from an authenticator app."),
      box.el, h("div", { class: "actions" }, start));
  };
  api("GET", "/account/totp").then(show, (error) => {
    box.show(error);
    replace(card, box.el);
  });
}
