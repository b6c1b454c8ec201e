// Money as the API gives it: decimal strings ("0.450000"). The console never does float
// arithmetic on money; the one product it shows (price × GPUs × share) is computed exactly
// on integers (BigInt) from the decimal strings.

const DECIMAL = /^(-)?(\d+)(?:\.(\d*))?$/;

// What a person may type as an amount: the server's one grammar (shared/money.py), the same pattern
// and the same words. ASCII digits and at most one dot, at most `places` decimals; no sign, exponent,
// spaces (not even around it) or digit-group separators. `\d` would be ASCII too, but say it plainly.
const EXAMPLES = { 0: "2", 1: "2.5", 2: "25.00", 3: "1.5" };

/** The grammar as a RegExp: amountPattern(6) is the JSON Schema's pattern for prices. */
export function amountPattern(places = 6) {
  if (places === 0) return /^[0-9]+$/;
  return new RegExp(String.raw`^(?:[0-9]+(?:\.[0-9]{1,${places}})?|\.[0-9]{1,${places}})$`);
}

/**
 * Null if `text` is an amount of the grammar (and, with `positive`, more than 0); else what to write,
 * worded as the API words it: "Bid must be a plain amount like 0.45 (ASCII digits and at most one dot, ...)".
 */
export function amountProblem(text, { places = 6, positive = false, label = "The amount" } = {}) {
  const value = String(text ?? "");
  if (value.length > 32 || !amountPattern(places).test(value)) {
    const example = EXAMPLES[places] ?? "0.45";
    const decimals = places === 0 ? "no decimals" : `at most ${places} decimal${places > 1 ? "s" : ""}`;
    const dot = places === 0 ? "" : " and at most one dot";
    return `${label} must be a plain amount like ${example} (ASCII digits${dot}, ${decimals}; no sign, exponent, spaces or separators).`;
  }
  if (positive && !/[1-9]/.test(value)) return `${label} must be more than 0.`;
  return null;
}

/** A decimal string as {units: BigInt, scale: number}: "0.45" → {units: 45n, scale: 2}. Null if it is not one. */
export function parseDecimal(text) {
  const m = DECIMAL.exec(String(text ?? "").trim());
  if (!m) return null;
  const frac = m[3] || "";
  const units = BigInt((m[2] || "0") + frac) * (m[1] ? -1n : 1n);
  return { units, scale: frac.length };
}

/** The exact decimal string of units × 10^-scale ("112500", 6 → "0.112500"). */
export function formatUnits(units, scale) {
  const negative = units < 0n;
  let digits = (negative ? -units : units).toString();
  if (scale > 0) {
    digits = digits.padStart(scale + 1, "0");
    digits = `${digits.slice(0, -scale)}.${digits.slice(-scale)}`;
  }
  return (negative ? "-" : "") + digits;
}

/**
 * price × count × milli / 1000, exactly, as a decimal string with at least `minScale` places
 * (trailing zeros beyond that are dropped): multiply("0.450000", 2) → "0.90".
 */
export function multiply(price, count = 1, milli = 1000, minScale = 2) {
  const p = parseDecimal(price);
  if (!p) return null;
  const units = p.units * BigInt(count) * BigInt(milli); // scale + 3 (milli is thousandths)
  let text = formatUnits(units, p.scale + 3);
  if (text.includes(".")) {
    const [whole, frac] = text.split(".");
    let trimmed = frac.replace(/0+$/, "");
    if (trimmed.length < minScale) trimmed = trimmed.padEnd(minScale, "0");
    text = trimmed ? `${whole}.${trimmed}` : whole;
  }
  return text;
}

/** Compare two decimal strings: -1, 0 or 1 (null if either is not a decimal). */
export function compare(a, b) {
  const x = parseDecimal(a);
  const y = parseDecimal(b);
  if (!x || !y) return null;
  const scale = Math.max(x.scale, y.scale);
  const xu = x.units * 10n ** BigInt(scale - x.scale);
  const yu = y.units * 10n ** BigInt(scale - y.scale);
  return xu < yu ? -1 : xu > yu ? 1 : 0;
}

const SHOWN_PLACES = { total: 2, rate: 6 };

/**
 * A USD amount as the console writes it, by the rules of format_usd in shared/money.py (the CLI's):
 * a "total" (balance, charge, earnings) in cents, rounded half up ("1234.5" → "$1,234.50"; under half a
 * cent but not zero → "<$0.01"); a "rate" (per GPU-hour, per hour, per second) with its decimals down to
 * a millionth, at least two ("0.300000" → "$0.30", "0.000125" → "$0.000125"). Commas group thousands,
 * a negative amount starts with "-", `per: "h"` adds "/h"; never an exponent, never through a float.
 * Null or "" is `missing`; text that is no decimal comes back as it is.
 */
export function formatUsd(text, { kind = "total", per = "", missing = "—" } = {}) {
  if (text === null || text === undefined || text === "") return missing;
  const places = SHOWN_PLACES[kind];
  if (places === undefined) throw new Error(`kind must be "total" or "rate", not ${kind}`);
  const d = parseDecimal(text);
  if (!d) return String(text);
  const magnitude = d.units < 0n ? -d.units : d.units;
  let shown;
  if (d.scale <= places) {
    shown = magnitude * 10n ** BigInt(places - d.scale);
  } else {
    const factor = 10n ** BigInt(d.scale - places);
    shown = (magnitude + factor / 2n) / factor; // half up, on the digits
  }
  const sign = d.units < 0n ? "-" : "";
  const suffix = per ? `/${per}` : "";
  if (shown === 0n && magnitude !== 0n) return `${sign}<$0.${"0".repeat(places - 1)}1${suffix}`;
  const scale = 10n ** BigInt(places);
  const whole = (shown / scale).toString().replace(/\B(?=(\d{3})+(?!\d))/g, ",");
  let decimals = (shown % scale).toString().padStart(places, "0");
  decimals = decimals.slice(0, 2) + decimals.slice(2).replace(/0+$/, "");
  return `${sign}$${whole}.${decimals}${suffix}`;
}

/** A total ("$12.35"): formatUsd(text). */
export function usd(text) {
  return formatUsd(text);
}

/** A rate ("$0.45", "$0.000125"): formatUsd(text, { kind: "rate" }). */
export function usdRate(text, per = "") {
  return formatUsd(text, { kind: "rate", per });
}

/** Whether a decimal string is more than zero. */
export function positive(text) {
  const d = parseDecimal(text);
  return d !== null && d.units > 0n;
}

/** The exact sum of decimal strings (those that are not decimals are skipped), as a decimal string. */
export function sum(values) {
  const parsed = values.map(parseDecimal).filter(Boolean);
  const scale = Math.max(0, ...parsed.map((d) => d.scale));
  const total = parsed.reduce((acc, d) => acc + d.units * 10n ** BigInt(scale - d.scale), 0n);
  return formatUnits(total, scale);
}
