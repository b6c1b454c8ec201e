// The console's only way to the server: the REST API under /api/v1, authenticated by the
// HTTP-only session cookie (credentials: "same-origin"), with the session's CSRF token on
// every request that changes something. Errors become ApiError with the API's code and
// message; a 401 means the session is gone and the app shows the sign-in page. In a team's
// context (teams.js's switcher) every call carries `Gpumarket-Team: <team id>` but the
// person's own: signing in and out, the account's security, and managing teams.

export const API = "/api/v1";

const UNSAFE = new Set(["POST", "PUT", "PATCH", "DELETE"]);
export const TEAM_HEADER = "Gpumarket-Team";
// Calls that are always the person's own, whatever the context: the session, the account and its second factor,
// password resets, and the teams routes (which act for the caller on the team their path names).
const PERSONAL_PATHS = /^\/(sessions|accounts|password-resets|account\/totp|account\/passkeys|teams|team-invitations)(\/|\?|$)/;

/** The signed-in session: {account: {id, name, role}, csrf_token, expires_at}, or null. */
export const session = { current: null };

/** The team the console acts for: {id, name, role}, or null for the person's own account (teams.js sets it). */
export const acting = { team: null };

let signedOutHandler = () => {};
let teamLostHandler = () => {};

/** Called with the ApiError whenever the API says the session is missing or expired. */
export function onSignedOut(handler) {
  signedOutHandler = handler;
}

/** Called with the ApiError when a call in a team's context answers that the caller is not in that team (any more). */
export function onTeamLost(handler) {
  teamLostHandler = handler;
}

export class ApiError extends Error {
  constructor(status, body) {
    const message = (body && typeof body.message === "string" && body.message) || `The server answered ${status}.`;
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.code = (body && body.code) || `http_${status}`;
    this.details = (body && body.details) || null;
  }
}

/** A random UUID (v4) for Idempotency-Key; works outside secure contexts too. */
export function uuid4() {
  const b = crypto.getRandomValues(new Uint8Array(16));
  b[6] = (b[6] & 0x0f) | 0x40;
  b[8] = (b[8] & 0x3f) | 0x80;
  const hex = Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
  return `${hex.slice(0, 8)}-${hex.slice(8, 12)}-${hex.slice(12, 16)}-${hex.slice(16, 20)}-${hex.slice(20)}`;
}

/** A query string from an object, leaving out empty values: {a: 1, b: ""} → "?a=1". */
export function query(params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params || {})) {
    if (v !== undefined && v !== null && String(v).trim() !== "") q.set(k, String(v).trim());
  }
  const text = q.toString();
  return text ? `?${text}` : "";
}

/**
 * Call the API: api("GET", "/offers?sort=price"), api("POST", "/rentals", {body, headers}).
 * `personal: true` leaves out the team header (the person's own account) where the path does not already.
 * Resolves to the parsed JSON body; rejects with ApiError.
 */
export async function api(method, path, { body, headers = {}, signal, quietAuth = false, personal = false } = {}) {
  const init = { method, credentials: "same-origin", cache: "no-store", headers: { Accept: "application/json", ...headers }, signal };
  const team = !personal && !PERSONAL_PATHS.test(path) && acting.team ? acting.team.id : null;
  if (team) init.headers[TEAM_HEADER] = team;
  if (body !== undefined) {
    init.body = JSON.stringify(body);
    init.headers["Content-Type"] = "application/json";
  }
  if (UNSAFE.has(method) && session.current) init.headers["X-CSRF-Token"] = session.current.csrf_token;
  let response;
  try {
    response = await fetch(API + path, init);
  } catch (error) {
    if (error && error.name === "AbortError") throw error;
    throw new ApiError(0, { code: "network_error", message: "The server could not be reached. Check your connection and try again." });
  }
  const text = await response.text();
  let data = null;
  if (text) {
    try {
      data = JSON.parse(text);
    } catch {
      data = null;
    }
  }
  if (!response.ok) {
    const error = new ApiError(response.status, data);
    if (team && error.code === "team_not_found" && acting.team && acting.team.id === team) teamLostHandler(error);
    if (response.status === 401 && !quietAuth) {
      session.current = null;
      signedOutHandler(error);
    }
    throw error;
  }
  return data;
}
