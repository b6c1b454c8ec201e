// Monthly invoices (renters) and statements (providers): GET /invoices lists the months,
// GET /invoices/{id} is one document as JSON, and its html_url a printable page.

import { api } from "./api.js";
import { facts, h, idText, link, replace, table, timeEl, num } from "./dom.js";
import { usd, usdRate } from "./money.js";
import { loadInto, errorBox, loading } from "./ui.js";

function gpus(line) {
  if (line.gpu_count === null || line.gpu_count === undefined) return "—";
  if (line.gpu_milli && line.gpu_milli < 1000) return `${line.gpu_count} × ${line.gpu_milli / 10} % share`;
  return String(line.gpu_count);
}

function documentView(doc) {
  const statement = doc.kind === "statement";
  const summary = statement
    ? facts([
      ["Month", doc.month],
      ["Opening payable", usd(doc.opening_payable)],
      ["Renters charged", usd(doc.total_charged)],
      ["Platform fee", usd(doc.total_platform_fee)],
      ["Earned", usd(doc.total_earned)],
      ["Paid out", usd(doc.total_paid_out)],
      ["Closing payable", usd(doc.closing_payable)],
    ])
    : facts([
      ["Month", doc.month],
      ["Opening balance", usd(doc.opening_balance)],
      ["Paid in", usd(doc.total_paid)],
      ["Charged", usd(doc.total_charged)],
      ["Closing balance", usd(doc.closing_balance)],
    ]);
  const columns = ["Rental", "GPU model", "GPUs", "Kind", "Price / GPU-hour", "Started", "Stopped", "Seconds billed",
    statement ? "Earned" : "Total"];
  const rows = (doc.lines || []).map((line) => [
    line.rental_id ? h("code", { class: "id" }, line.rental_id) : "—",
    line.gpu_model ?? "—",
    gpus(line),
    line.rental_kind ?? "—",
    usdRate(line.price_per_gpu_hour),
    timeEl(line.started_at),
    timeEl(line.stopped_at),
    line.seconds_billed === null || line.seconds_billed === undefined ? "—" : num(line.seconds_billed, 0),
    usd(statement ? line.earned : line.total),
  ]);
  // Volumes' storage: a line per volume (GiB, hours, amount), counted in the totals above.
  const storageLines = (doc.storage && doc.storage.lines) || [];
  const storage = storageLines.length === 0 ? null : table({
    caption: `Storage, ${doc.month}`, columns: ["Volume", "GiB", "Price / GiB-hour", "Hours", statement ? "Earned" : "Amount"],
    rows: storageLines.map((line) => [h("code", { class: "id" }, line.name ? `${line.name} (${line.volume_id})` : line.volume_id),
      String(line.size_gib ?? "—"), usdRate(line.price_per_gib_hour), line.hours, usd(statement ? line.earned : line.amount)]),
    className: "invoice-storage",
  });
  return h("div", { class: "invoice-doc" }, summary,
    table({ caption: `${statement ? "Statement" : "Invoice"} lines, ${doc.month}`, columns, rows, empty: "No rentals this month.", className: "invoice-lines" }),
    storage);
}

/** The list of the account's invoices or statements, each opening its lines. */
export function invoicesSection(ctx, { title = "Invoices", empty = "No invoices yet: they appear once something is charged." } = {}) {
  const slot = h("div", {});
  const detail = h("div", { class: "invoice-detail", "aria-live": "polite" });
  const section = h("section", { "aria-labelledby": "invoices-title" }, h("h2", { id: "invoices-title" }, title), slot, detail);
  loadInto(ctx, slot, async () => {
    const body = await api("GET", "/invoices");
    const rows = body.items.map((item) => {
      const open = h("button", { type: "button", class: "secondary small", "aria-controls": "invoice-detail" }, "Show lines");
      open.addEventListener("click", async () => {
        replace(detail, loading(`Loading ${item.id}…`));
        try {
          const doc = await api("GET", `/invoices/${encodeURIComponent(item.id)}`);
          if (ctx.alive()) replace(detail, h("h3", {}, `${doc.kind === "statement" ? "Statement" : "Invoice"} ${doc.id}`), documentView(doc));
        } catch (error) {
          const box = errorBox();
          box.show(error);
          replace(detail, box.el);
        }
      });
      return [item.month, item.kind, h("code", {}, idText(item.id)), h("span", { class: "row-actions" }, open, " ",
        link(item.html_url, "Printable page", { target: "_blank", rel: "noopener" }))];
    });
    return table({ caption: title, columns: ["Month", "Kind", "Id", "Open"], rows, empty });
  });
  detail.id = "invoice-detail";
  return section;
}
