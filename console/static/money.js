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

/**
 * A USD amount for display: "12.345678" → "$12.35"; amounts under a cent keep their
 * significant digits ("0.000125" → "$0.000125") so a small charge never reads as zero.
 * Rounds half up on the decimal digits, never through a float.
 */
export function usd(text) {
  if (text === null || text === undefined || text === "") return "—";
  const d = parseDecimal(text);
  if (!d) return String(text);
  const negative = d.units < 0n;
  const abs = negative ? -d.units : d.units;
  let shown;
  if (d.scale <= 2) {
    shown = formatUnits(abs * 10n ** BigInt(2 - d.scale), 2);
  } else {
    const factor = 10n ** BigInt(d.scale - 2);
    const cents = (abs + factor / 2n) / factor;
    if (cents === 0n && abs !== 0n) {
      shown = formatUnits(abs, d.scale).replace(/0+$/, "");
    } else {
      shown = formatUnits(cents, 2);
    }
  }
  const [whole, frac] = shown.split(".");
  const grouped = whole.replace(/\B(?=(\d{3})+(?!\d))/g, ",");
  return `${negative ? "−" : ""}$${grouped}${frac !== undefined ? `.${frac}` : ""}`;
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
