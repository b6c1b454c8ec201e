// The renter's "Add credit" form (Billing page): POST /api/v1/account/credit through the master's
// payment provider. The demo provider credits at once ("demo payment: no card charged"); Stripe
// answers a checkout_url and the page goes there (Stripe sends the renter back to #/billing?credit=…,
// and its webhook credits the payment). Each top-up sends its own Idempotency-Key, kept until it
// succeeds, so a retry after a lost answer is the same top-up, never a second one.

import { api, uuid4 } from "./api.js";
import { field, h, replace } from "./dom.js";
import { amountProblem, usd } from "./money.js";
import { busy, errorBox } from "./ui.js";

const PRESETS = ["10.00", "25.00", "50.00", "100.00"];

/** Only a web page may be where the browser is sent to pay (never a javascript: or data: URL). */
function checkoutUrl(text) {
  try {
    const url = new URL(text);
    return url.protocol === "https:" || url.protocol === "http:" ? url.href : null;
  } catch {
    return null;
  }
}

/** What Stripe's return to the page says (?credit=paid|cancelled), as a line; null when it says nothing. */
function returnNotice(query) {
  const state = query && query.get("credit");
  if (state === "paid") return "Payment received: your balance grows as soon as the payment provider confirms it.";
  if (state === "cancelled") return "Payment cancelled: nothing was charged or credited.";
  return null;
}

/** The "Add credit" card; `onCredited()` is called after a credit posted (to show the new balance). */
export function creditSection(ctx, { onCredited = () => {} } = {}) {
  const errors = errorBox();
  const amount = field({ label: "Amount (USD)", name: "credit_amount", inputmode: "decimal", placeholder: "e.g. 25.00",
    hint: "Whole cents. The marketplace sets the smallest and the largest top-up." });
  const result = h("p", { class: "credit-result", id: "credit-result", role: "status" });
  const notice = returnNotice(ctx.query);
  if (notice) result.textContent = notice;
  const presets = PRESETS.map((value) => h("button", { type: "button", class: "secondary", "data-amount": value,
    on: { click: () => { amount.input.value = value; errors.clear(); amount.input.focus(); } } }, usd(value)));
  const submit = h("button", { type: "submit" }, "Add credit");
  const form = h("form", { class: "card credit-form", novalidate: true, "aria-labelledby": "add-credit-title" },
    h("h2", { id: "add-credit-title" }, "Add credit"),
    h("div", { class: "actions credit-presets", role: "group", "aria-label": "Preset amounts" }, presets),
    amount.row, errors.el, h("div", { class: "actions" }, submit), result);

  let key = null; // this top-up's Idempotency-Key, until it succeeds or the amount changes
  let keyFor = null;
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    errors.clear();
    const text = amount.input.value;
    const problem = amountProblem(text, { places: 2, positive: true, label: "The amount (USD)" });
    if (problem) {
      errors.show(problem);
      amount.input.focus();
      return;
    }
    if (keyFor !== text) {
      key = uuid4();
      keyFor = text;
    }
    await busy(submit, async () => {
      try {
        const body = await api("POST", "/account/credit", { body: { amount: text }, headers: { "Idempotency-Key": key } });
        key = keyFor = null;
        if (body.checkout_url) {
          const url = checkoutUrl(body.checkout_url);
          if (!url) {
            errors.show("The payment provider gave no page to pay at; nothing was charged. Try again.");
            return;
          }
          replace(result, `Taking you to the payment page for ${usd(body.amount)}…`);
          window.location.assign(url);
          return;
        }
        const demo = body.demo ? ` — ${body.message || "demo payment: no card charged"}` : "";
        replace(result, `Added ${usd(body.amount)}${demo}. New balance: `, h("strong", { class: "credit-balance" }, usd(body.balance)), ".");
        amount.input.value = "";
        ctx.notify(`Added ${usd(body.amount)} of credit.`);
        await onCredited();
      } catch (error) {
        if (error.status !== 401) errors.show(error);
      }
    }, "Adding…");
  });
  return form;
}
