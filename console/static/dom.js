// Building the page from data without ever parsing data as HTML: every text goes in as a
// text node or an attribute value, so nothing a user typed (a host name, a GPU model, an
// error message) can become markup.

const SVG_NS = "http://www.w3.org/2000/svg";

function append(parent, child) {
  if (child === null || child === undefined || child === false) return;
  if (Array.isArray(child)) {
    for (const c of child) append(parent, c);
    return;
  }
  parent.append(child instanceof Node ? child : document.createTextNode(String(child)));
}

function apply(el, attrs) {
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "on") {
      for (const [event, handler] of Object.entries(value)) el.addEventListener(event, handler);
    } else if (key === "dataset") {
      for (const [k, v] of Object.entries(value)) el.dataset[k] = String(v);
    } else if (key === "text") {
      el.textContent = String(value);
    } else if (key === "class") {
      el.setAttribute("class", Array.isArray(value) ? value.filter(Boolean).join(" ") : String(value));
    } else if (key === "value" && "value" in el) {
      el.value = String(value);
    } else if (key === "checked" || key === "selected" || key === "disabled" || key === "readOnly") {
      el[key] = Boolean(value);
    } else {
      el.setAttribute(key, value === true ? "" : String(value));
    }
  }
}

/** An HTML element: h("button", {type: "button", on: {click}}, "Rent"). */
export function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  apply(el, attrs);
  append(el, children);
  return el;
}

/** An SVG element (charts). */
export function s(tag, attrs, ...children) {
  const el = document.createElementNS(SVG_NS, tag);
  apply(el, attrs);
  append(el, children);
  return el;
}

/** Replace every child of el. */
export function replace(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

let counter = 0;
/** A document-unique id for label/for and aria-describedby pairs. */
export function uid(prefix = "f") {
  counter += 1;
  return `${prefix}-${counter}`;
}

/**
 * A labelled form control: {label, name, type, value, hint, options, ...attributes}.
 * Returns {row, input}; the row holds the <label>, the control and its hint.
 */
export function field({ label, name, type = "text", value, hint, options, ...rest }) {
  const id = uid(name || "field");
  const hintId = hint ? `${id}-hint` : null;
  let input;
  if (type === "select") {
    input = h("select", { id, name, "aria-describedby": hintId, ...rest },
      options.map(([v, text]) => h("option", { value: v, selected: String(v) === String(value ?? "") }, text)));
  } else if (type === "textarea") {
    input = h("textarea", { id, name, "aria-describedby": hintId, ...rest });
    if (value !== undefined && value !== null) input.value = String(value);
  } else {
    input = h("input", { id, name, type, "aria-describedby": hintId, ...rest });
    if (value !== undefined && value !== null) input.value = String(value);
  }
  const row = h("div", { class: type === "checkbox" || type === "radio" ? "field field-check" : "field" },
    type === "checkbox" || type === "radio" ? [input, h("label", { for: id }, label)] : [h("label", { for: id }, label), input],
    hint ? h("p", { class: "hint", id: hintId }, hint) : null);
  return { row, input };
}

/** A table in a horizontally scrollable, keyboard-focusable region (narrow screens). */
export function table({ caption, columns, rows, empty = "Nothing yet.", className }) {
  const head = h("thead", {}, h("tr", {}, columns.map((c) => (c instanceof Node ? c : h("th", { scope: "col" }, c)))));
  const body = h("tbody", {});
  if (rows.length === 0) {
    body.append(h("tr", {}, h("td", { colspan: columns.length, class: "empty" }, empty)));
  }
  for (const row of rows) {
    body.append(row instanceof Node ? row : h("tr", {}, row.map((cell) => (cell instanceof Node && cell.tagName === "TD" ? cell : h("td", {}, idText(cell))))));
  }
  // Each cell names its column in data-label: on a narrow screen the rows become cards (app.css) that show it.
  const labels = [...head.querySelectorAll("th")].map((th) => {
    const hidden = th.querySelector(".visually-hidden");
    return hidden ? "" : th.textContent.replace(/[↕▲▼]/g, "").trim();
  });
  for (const tr of body.rows) {
    [...tr.cells].forEach((cell, i) => {
      if (!cell.classList.contains("empty") && cell.dataset.label === undefined) cell.dataset.label = labels[i] ?? "";
    });
  }
  const tableEl = h("table", { class: className }, caption ? h("caption", {}, caption) : null, head, body);
  const labelId = caption ? uid("table") : null;
  if (labelId) tableEl.querySelector("caption").id = labelId;
  return h("div", { class: "table-wrap", tabindex: "0", role: "region", "aria-labelledby": labelId, "aria-label": labelId ? null : "table" }, tableEl);
}

/** A definition list of [term, value] pairs (ids in a text value never break inside). */
export function facts(pairs) {
  return h("dl", { class: "facts" }, pairs.filter(Boolean).map(([k, v]) => [h("dt", {}, k), h("dd", {}, idText(v ?? "—"))]));
}

/** The ISO time as the reader's local date and time ("—" when missing). */
export function when(iso) {
  if (!iso) return "—";
  const d = new Date(iso);
  if (Number.isNaN(d.getTime())) return String(iso);
  return d.toLocaleString(undefined, { year: "numeric", month: "short", day: "numeric", hour: "2-digit", minute: "2-digit", second: "2-digit" });
}

/** A <time> element showing when(iso) with the exact value in datetime. */
export function timeEl(iso) {
  return iso ? h("time", { datetime: iso }, when(iso)) : "—";
}

/** A number with at most `digits` decimals, or "—". */
export function num(value, digits = 2) {
  if (value === null || value === undefined || value === "") return "—";
  const n = Number(value);
  if (!Number.isFinite(n)) return String(value);
  return n.toLocaleString(undefined, { maximumFractionDigits: digits });
}

/** A state badge: <span class="badge state-running">running</span>. */
export function badge(text, kind = "state") {
  const safe = String(text ?? "unknown").replace(/[^a-z0-9_-]/gi, "");
  return h("span", { class: `badge ${kind}-${safe}` }, text ?? "unknown");
}

/** A link to a console page (an id in its text never breaks inside). */
export function link(hash, text, attrs = {}) {
  return h("a", { href: hash, ...attrs }, idText(text));
}

/** Text that may wrap before each "@" and after each "/" or ":" (an address, an image prefix), never elsewhere. */
export function wrapAt(text) {
  return String(text).split(/(?=@)|(?<=[/:])/).flatMap((part, i) => (i ? [h("wbr", {}), part] : [part]));
}

/** An object's id ("r-" and 16 hex digits, as shared/ids.py makes them) in text. */
export const ID_PATTERN = /\b([a-z]{1,4}-[0-9a-f]{16})\b/;

/**
 * Text with each id in it as a <span class="id">, which never breaks inside (app.css), after a <wbr>: a line may end
 * before an id that follows a hyphen or a slash ("stm-2026-11-acct-…"). Other text stays as it is.
 */
export function idText(text) {
  if (typeof text !== "string") return text;
  const parts = text.split(new RegExp(ID_PATTERN.source, "g"));
  if (parts.length === 1) return text;
  return parts.map((part, i) => (i % 2 ? [i > 1 || parts[0] ? h("wbr", {}) : null, h("span", { class: "id" }, part)] : part)).filter((part) => part !== "");
}
