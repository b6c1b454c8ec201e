// Pieces every page uses: the error box next to a form, loading placeholders, page headings.

import { api } from "./api.js";
import { h, replace, uid } from "./dom.js";

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

/** The page's <h1> and optional intro line. */
export function heading(title, intro) {
  return [h("h1", { tabindex: "-1", class: "page-title" }, title), intro ? h("p", { class: "intro" }, intro) : null];
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
 * A "Stop" button that asks first. Its click puts `question`, a confirming button and "Keep it running" into `slot`
 * and sets `state.confirming` (a page that redraws its actions on every refresh leaves the question alone meanwhile).
 * Confirming sends `DELETE path`, says "`what` is <state>." and calls `refresh`; an error shows in `errors`; keeping it
 * calls `redraw` and focuses the slot's first button again.
 */
export function stopWithConfirmation(ctx, { slot, errors, state, id, confirmId, label, confirmLabel, question, path, what, refresh, redraw }) {
  const stop = h("button", { type: "button", class: "danger", id }, label);
  stop.addEventListener("click", () => {
    state.confirming = true;
    const yes = h("button", { type: "button", class: "danger", id: confirmId }, confirmLabel);
    const no = h("button", { type: "button", class: "secondary" }, "Keep it running");
    no.addEventListener("click", () => {
      state.confirming = false;
      redraw();
      slot.querySelector("button").focus();
    });
    yes.addEventListener("click", async () => {
      errors.clear();
      await busy(yes, async () => {
        try {
          const stopped = await api("DELETE", path);
          ctx.notify(`${what} is ${stopped.state}.`);
          state.confirming = false;
          await refresh();
        } catch (error) {
          state.confirming = false;
          if (error.status !== 401) errors.show(error);
        }
      }, "Stopping…");
    });
    replace(slot, h("p", { class: "confirm-text" }, question), yes, " ", no);
    yes.focus();
  });
  return stop;
}
