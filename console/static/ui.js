// Pieces every page uses: the error box next to a form, loading placeholders, page headings.

import { api, uuid4 } from "./api.js";
import { h, idText, replace, uid, wrapAt } from "./dom.js";

/** A message box for a form's errors (role="alert": read out when it changes). */
export function errorBox() {
  const el = h("div", { class: "error", role: "alert" });
  return {
    el,
    show(error) {
      const message = typeof error === "string" ? error : (error && error.message) || "Something went wrong.";
      const extra = error && error.details && Array.isArray(error.details.problems) && error.details.problems.length > 1
        ? h("ul", {}, error.details.problems.map((p) => h("li", {}, `${p.field || "body"}: ${p.problem}`)))
        : null;
      replace(el, h("p", {}, message), extra);
      el.classList.add("shown");
      if (error && error.code) el.dataset.code = error.code;
    },
    clear() {
      el.replaceChildren();
      el.classList.remove("shown");
      delete el.dataset.code;
    },
  };
}

/** A modal <dialog> labelled by its title `titleId`, closed by a click on its backdrop: {el, close}. */
export function modal(className, titleId) {
  const el = h("dialog", { class: className, "aria-labelledby": titleId });
  const close = () => {
    if (el.open) el.close();
  };
  el.addEventListener("click", (event) => {
    if (event.target === el) close(); // a click on the backdrop
  });
  return { el, close };
}

/** The page's <h1> and optional intro line; an id in the title ("Rental r-47c3…") never breaks inside (idText). */
export function heading(title, intro) {
  return [h("h1", { tabindex: "-1", class: "page-title" }, idText(title)), intro ? h("p", { class: "intro" }, intro) : null];
}

/** A placeholder shown while something loads. */
export function loading(what = "Loading…") {
  return h("p", { class: "loading", role: "status" }, what);
}

/**
 * Fill `slot` with what `load` renders; show its error instead if it fails. Returns a
 * function that loads again. `ctx.alive()` keeps a page that was left from being written.
 */
export function loadInto(ctx, slot, load, { placeholder = "Loading…" } = {}) {
  const run = async (quiet = false) => {
    if (!quiet) replace(slot, loading(placeholder));
    try {
      const content = await load();
      // A background refresh leaves alone a part the user is working in (focus would be lost).
      if (quiet && slot.contains(document.activeElement) && document.activeElement !== slot) return;
      if (ctx.alive()) replace(slot, content);
    } catch (error) {
      if (!ctx.alive() || (error && error.status === 401)) return;
      const box = errorBox();
      box.show(error);
      replace(slot, box.el);
    }
  };
  run();
  return run;
}

/** Disable a form's submit button while `work` runs. */
export async function busy(button, work, label = "Working…") {
  const text = button.textContent;
  button.disabled = true;
  button.setAttribute("aria-busy", "true");
  button.textContent = label;
  try {
    return await work();
  } finally {
    button.disabled = false;
    button.removeAttribute("aria-busy");
    button.textContent = text;
  }
}

/**
 * The API's refusal at the field it names (`details.problems[0].field`, its last part, a key of `fields`: each a
 * `withError` field), focused; returns whether one took it (else the caller shows it elsewhere).
 */
export function showAtField(error, fields) {
  const problem = error.details && Array.isArray(error.details.problems) ? error.details.problems[0] : null;
  const target = problem && fields[String(problem.field || "").split(".").pop()];
  if (!target) return false;
  target.show(error.message.replace(/^\w+: /, ""));
  target.input.focus();
  return true;
}

/** A field's own error line (next to the control, named by its aria-describedby). */
export function withError(f) {
  const id = uid("error");
  const el = h("p", { class: "field-error", id, hidden: true });
  (f.row.querySelector(".hint") || f.input).after(el);
  const control = f.input;
  return {
    ...f,
    error: el,
    show(message) {
      el.textContent = message;
      el.hidden = false;
      control.setAttribute("aria-invalid", "true");
      const described = (control.getAttribute("aria-describedby") || "").split(" ").filter(Boolean);
      if (!described.includes(id)) control.setAttribute("aria-describedby", [...described, id].join(" "));
    },
    clear() {
      el.textContent = "";
      el.hidden = true;
      control.removeAttribute("aria-invalid");
    },
  };
}

/**
 * A button that asks first. Its click puts `question`, a confirming button (`confirmLabel`) and `keepLabel` into `slot`
 * and sets `state.confirming` (a page that redraws its actions on every refresh leaves the question alone meanwhile).
 * Confirming runs `act()` with `busyLabel` on the button; an error it throws shows in `errors` (a 401 does not: the
 * sign-in page takes over). `keepLabel` calls `redraw` and focuses the slot's first button again.
 */
export function confirmedAction({ slot, errors, state, id, confirmId, label, confirmLabel, question, keepLabel, busyLabel, act, redraw,
  buttonClass = "danger" }) {
  const button = h("button", { type: "button", class: buttonClass, id }, label);
  button.addEventListener("click", () => {
    state.confirming = true;
    const yes = h("button", { type: "button", class: "danger", id: confirmId }, confirmLabel);
    const no = h("button", { type: "button", class: "secondary" }, keepLabel);
    no.addEventListener("click", () => {
      state.confirming = false;
      redraw();
      slot.querySelector("button").focus();
    });
    yes.addEventListener("click", async () => {
      errors.clear();
      await busy(yes, async () => {
        try {
          await act();
        } catch (error) {
          state.confirming = false;
          if (error.status !== 401) errors.show(error);
        }
      }, busyLabel);
    });
    replace(slot, h("p", { class: "confirm-text" }, question), yes, " ", no);
    yes.focus();
  });
  return button;
}

/**
 * A "Stop" button that asks first (`confirmedAction`): confirming sends `DELETE path`, says "`what` is <state>." and
 * calls `refresh`.
 */
export function stopWithConfirmation(ctx, { path, what, refresh, keepLabel = "Keep it running", busyLabel = "Stopping…", ...rest }) {
  return confirmedAction({ ...rest, keepLabel, busyLabel, act: async () => {
    const stopped = await api("DELETE", path);
    ctx.notify(`${what} is ${stopped.state}.`);
    rest.state.confirming = false;
    await refresh();
  } });
}

/**
 * One refresh of a page that shows one thing (a cluster, a service): `load()`'s answer, or null when it failed or the
 * page was left meanwhile. A failure shows in `errors` (a 401 does not: the sign-in page takes over) and calls
 * `failed`; an answer clears `errors`.
 */
export async function refreshed(ctx, errors, load, failed) {
  let value;
  try {
    value = await load();
  } catch (error) {
    if (ctx.alive() && error.status !== 401) {
      errors.show(error);
      failed();
    }
    return null;
  }
  if (!ctx.alive()) return null;
  errors.clear();
  return value;
}

function selectText(target) {
  if (typeof target.select === "function") {
    target.focus();
    target.select();
    return;
  }
  const range = document.createRange();
  range.selectNodeContents(target);
  const selection = getSelection();
  selection.removeAllRanges();
  selection.addRange(range);
}

/**
 * A rent dialog's last step: `form` hides and `slot` shows `summary` with "Confirm and rent" (`confirmId`) and Back
 * (back to the form, focus on `backTo`). Confirm POSTs `request` to `path` under one Idempotency-Key (a double
 * submit rents once), closes the dialog, says what was made and opens its page (`#/<page>/<id>`); on an error the
 * form shows again and `onError` gets it (a 401 has already sent the user to sign in).
 */
export function confirmAndRent(ctx, { form, slot, backTo, errors, close }, { confirmId, path, request, noun, page, summary, onError }) {
  const key = uuid4();
  form.hidden = true;
  const confirm = h("button", { type: "button", id: confirmId }, "Confirm and rent");
  const back = h("button", { type: "button", class: "secondary" }, "Back");
  const showForm = () => {
    form.hidden = false;
    slot.replaceChildren();
  };
  back.addEventListener("click", () => {
    showForm();
    backTo.focus();
  });
  confirm.addEventListener("click", async () => {
    errors.clear();
    await busy(confirm, async () => {
      try {
        const made = await api("POST", path, { body: request, headers: { "Idempotency-Key": key } });
        close();
        ctx.notify(`${noun} ${made.id} created: ${made.state}.`);
        location.hash = `#/${page}/${encodeURIComponent(made.id)}`;
      } catch (error) {
        if (error.status === 401) return;
        showForm();
        onError(error);
      }
    }, "Renting…");
  });
  replace(slot, ...summary, h("div", { class: "actions" }, confirm, back));
  confirm.focus();
}

/**
 * A Copy button for `text` and the status line that says what it did: {button, status}. Without the clipboard API
 * (plain HTTP, or refused) it selects `target` (a field, or an element's text) and asks the browser to copy that,
 * else says to press Ctrl+C. `label` names what is copied for screen readers ("Copy the token").
 */
export function copyButton(text, target, { label, id = null, className = "secondary small" }) {
  const button = h("button", { type: "button", class: className, id, "aria-label": `Copy ${label}` }, "Copy");
  const status = h("span", { class: "hint copy-status", role: "status" });
  button.addEventListener("click", async () => {
    let done = false;
    try {
      await navigator.clipboard.writeText(text);
      done = true;
    } catch {
      selectText(target);
      try {
        done = document.execCommand("copy");
      } catch {
        done = false;
      }
    }
    status.textContent = done ? "Copied to the clipboard." : "Selected: press Ctrl+C to copy.";
  });
  return { button, status };
}

/**
 * A value in a <code> with a Copy button and its status line. A command wraps at its spaces only, never inside "r-…"
 * or a path; with `anywhere` (a URL, a token: one long word) it wraps after a "/" or ":" first, else where it must,
 * never inside an id.
 */
export function copyable(text, { id, label, anywhere = false }) {
  const words = anywhere ? wrapAt(text).map(idText) : text.split(" ").map((word, i) => [i ? " " : null, h("span", { class: "word" }, word)]);
  const code = h("code", { class: "command-line", id }, words);
  const { button, status } = copyButton(text, code, { label });
  return h("div", { class: "command-row" }, code, button, status);
}
