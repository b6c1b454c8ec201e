// The console's entry point: the session, the hash router (#/offers, #/rentals/<id>, ...),
// the role's navigation; the pages a visitor sees before signing in are join.js's.

import { acting, api, ApiError, onSignedOut, onTeamLost, session } from "./api.js";
import { h, replace } from "./dom.js";
import { errorBox, busy } from "./ui.js";
import { offersPage, rentalsPage, rentalPage, billingPage } from "./pages-renter.js";
import { hostsPage, hostPage, enrollPage, earningsPage } from "./pages-provider.js";
import { fleetPage } from "./pages-admin.js";
import { sshKeysPage } from "./sshkeys.js";
import { clustersPage, clusterPage } from "./pages-clusters.js";
import { servicesPage, servicePage } from "./pages-services.js";
import { volumesPage } from "./pages-volumes.js";
import { PUBLIC, securityPage, signInPage, verifyBanner } from "./join.js";
import { apiKeysPage, devicePage } from "./apikeys.js";
import { actFor, contextBanner, contextLabel, contextSwitcher, invitePage, loadTeams, lostTeam, pendingInvite, teamPage, teamsPage } from "./teams.js";

const ROUTES = [
  { path: /^\/fleet$/, roles: ["admin"], title: "Fleet", nav: "#/fleet", render: fleetPage },
  { path: /^\/offers$/, roles: ["renter", "admin"], title: "Marketplace", nav: "#/offers", render: offersPage },
  { path: /^\/rentals$/, roles: ["renter", "admin"], title: "Rentals", nav: "#/rentals", render: rentalsPage },
  { path: /^\/rentals\/([^/]+)$/, roles: ["renter", "admin"], title: "Rental", render: rentalPage },
  { path: /^\/clusters$/, roles: ["renter", "admin"], title: "Clusters", nav: "#/clusters", render: clustersPage },
  { path: /^\/clusters\/([^/]+)$/, roles: ["renter", "admin"], title: "Cluster", render: clusterPage },
  { path: /^\/services$/, roles: ["renter", "admin"], title: "Services", nav: "#/services", render: servicesPage },
  { path: /^\/services\/([^/]+)$/, roles: ["renter", "admin"], title: "Service", render: servicePage },
  { path: /^\/volumes$/, roles: ["renter"], title: "Volumes", nav: "#/volumes", render: volumesPage },
  { path: /^\/billing$/, roles: ["renter"], title: "Billing", nav: "#/billing", render: billingPage },
  { path: /^\/ssh-keys$/, roles: ["renter", "admin"], title: "SSH keys", nav: "#/ssh-keys", render: sshKeysPage },
  { path: /^\/hosts$/, roles: ["provider", "admin"], title: "Hosts", nav: "#/hosts", render: hostsPage },
  { path: /^\/hosts\/([^/]+)$/, roles: ["provider", "admin"], title: "Host", render: hostPage },
  { path: /^\/enroll$/, roles: ["provider"], title: "Enroll a host", nav: "#/enroll", render: enrollPage },
  { path: /^\/earnings$/, roles: ["provider"], title: "Earnings", nav: "#/earnings", render: earningsPage },
  { path: /^\/api-keys$/, roles: ["renter", "provider", "admin"], title: "API keys", nav: "#/api-keys", render: apiKeysPage },
  { path: /^\/device(?:\/([^/]+))?$/, roles: ["renter", "provider", "admin"], title: "Sign in the CLI", render: devicePage },
  { path: /^\/security$/, roles: ["renter", "provider", "admin"], title: "Security", nav: "#/security", render: securityPage },
  { path: /^\/teams$/, roles: ["renter", "provider", "admin"], title: "Teams", nav: "#/teams", navClass: "nav-teams", render: teamsPage },
  { path: /^\/teams\/([^/]+)$/, roles: ["renter", "provider", "admin"], title: "Team", render: teamPage },
];
// Pages with an id that belongs to one account: switching context goes to their list instead.
const OWNED_DETAIL = /^\/(rentals|clusters|services|hosts)\/[^/]+$/;

const HOME = { renter: "#/offers", provider: "#/hosts", admin: "#/fleet" };
// A 401 in the middle of using the console means the session is gone (expired, signed out
// elsewhere, its API key revoked; missing_api_key: the cookie itself is gone).
const EXPIRED_CODES = new Set(["session_expired", "not_signed_in", "missing_api_key", "invalid_api_key"]);

const main = document.getElementById("main");
const nav = document.getElementById("nav");
const who = document.getElementById("who");
const context = document.getElementById("context");
const notice = document.getElementById("notice");
const banner = document.getElementById("banner");

let current = { cleanups: [], token: 0 };
let wantedHash = null; // where to go after signing in
let noticeTimer = null;

/** A short success message in the polite live region at the top of the page. */
export function notify(text) {
  notice.textContent = text;
  notice.classList.add("shown");
  clearTimeout(noticeTimer);
  noticeTimer = setTimeout(() => {
    notice.textContent = "";
    notice.classList.remove("shown");
  }, 8000);
}

function leavePage() {
  for (const cleanup of current.cleanups) {
    try {
      cleanup();
    } catch {
      /* a page's cleanup failing must not block navigation */
    }
  }
  current = { cleanups: [], token: current.token + 1 };
}

/** The role pages are chosen by: a team's is what it does (a renter or a provider team), whatever the person is. */
function actingRole() {
  return acting.team ? acting.team.kind || "renter" : session.current.account.role;
}

/** The team context, for the pages that change it. */
const teamsApi = {
  /** Ask for the person's teams again (after making, joining or leaving one); falls back to personal, saying so. */
  async refresh() {
    const lost = await loadTeams();
    if (lost) notify(lost);
    renderChrome();
  },
  /** Act for `team` ({id, name, role}) or personal (null), and load the page again in that context. */
  switchTo(team, { quiet = false } = {}) {
    actFor(team);
    if (!quiet) notify(team ? `Acting for ${contextLabel(team)}.` : "Acting for your personal account.");
    const path = location.hash.replace(/^#/, "").split("?")[0];
    const list = OWNED_DETAIL.exec(path) ? `#/${path.split("/")[1]}` : null;
    if (list && location.hash !== list) location.hash = list;
    else route();
  },
  notify,
};

/** Take up the remembered team context; a failure to ask leaves the personal one. */
async function loadContext() {
  try {
    const lost = await loadTeams();
    if (lost) notify(lost);
  } catch (error) {
    acting.team = null; // this page only: the remembered team is asked for again next time
    if (error instanceof ApiError && error.status === 401) throw error;
  }
}

function renderChrome() {
  const account = session.current && session.current.account;
  replace(banner, verifyBanner(account), account ? contextBanner() : null);
  if (!account) {
    nav.replaceChildren();
    context.replaceChildren();
    who.replaceChildren();
    return;
  }
  const path = location.hash.replace(/^#/, "");
  const role = actingRole();
  const items = ROUTES.filter((r) => r.nav && r.roles.includes(role));
  nav.replaceChildren(h("ul", {}, items.map((r) => {
    const active = path === r.nav.slice(1) || path.startsWith(`${r.nav.slice(1)}/`);
    return h("li", { class: r.navClass || null }, h("a", { href: r.nav, "aria-current": active ? "page" : null }, r.title));
  })));
  const signOut = h("button", { type: "button", class: "secondary", id: "sign-out" }, "Sign out");
  signOut.addEventListener("click", () => signOutNow(signOut));
  context.replaceChildren(contextSwitcher((team) => teamsApi.switchTo(team), { current: path === "/teams" || path.startsWith("/teams/") }));
  who.replaceChildren(h("span", { class: "account" }, h("span", { class: "account-name" }, account.name), " ",
      h("span", { class: `badge role-${account.role}` }, account.role)), signOut);
}

async function signOutNow(button) {
  await busy(button, async () => {
    try {
      await api("DELETE", "/sessions/current", { quietAuth: true });
    } catch {
      /* signed out either way */
    }
  }, "Signing out…");
  session.current = null;
  acting.team = null;
  wantedHash = null;
  history.replaceState(null, "", "#/signin");
  showSignIn("You are signed out.", false);
}

function showSignIn(message, isProblem = true) {
  leavePage();
  renderChrome();
  signInPage(main, { message, isProblem, done: signedIn });
}

async function signedIn(opened) {
  session.current = opened;
  await loadContext().catch(() => {});
  const invite = pendingInvite({ take: true }); // once: the mail's link opens it again
  const target = invite ? `#/invite/${invite}`
    : wantedHash && wantedHash !== "#/signin" ? wantedHash : HOME[actingRole()] || "#/";
  wantedHash = null;
  if (location.hash === target) route();
  else location.hash = target;
}

/** A page anyone may open (sign up, the mailed links): rendered whether signed in or not; false when `path` is none. */
function publicPage(path) {
  const pages = [...PUBLIC, { path: /^\/invite\/([^/]+)$/, render: invitePage }];
  const found = pages.map((r) => ({ r, m: r.path.exec(path) })).find(({ m }) => m);
  if (!found || (path === "/signin" && session.current)) return false;
  leavePage();
  renderChrome();
  found.r.render(main, { params: found.m.slice(1).map(decodeURIComponent), done: signedIn, message: null, teamsApi });
  const title = main.querySelector("h1");
  if (title) title.focus({ preventScroll: true });
  return true;
}

onSignedOut((error) => {
  if (!wantedHash && location.hash && location.hash !== "#/signin") wantedHash = location.hash;
  const message = EXPIRED_CODES.has(error.code) ? "Your session expired — sign in again." : error.message;
  history.replaceState(null, "", "#/signin");
  showSignIn(message);
});

onTeamLost(() => {
  notify(lostTeam());
  loadContext().finally(route);
});

function route() {
  const hash = location.hash || "#/";
  if (!hash.startsWith("#/")) return; // an in-page anchor, not a page
  if (publicPage(hash.slice(1).split("?")[0])) return;
  if (!session.current) {
    if (hash !== "#/signin") wantedHash = hash;
    showSignIn(null);
    return;
  }
  const role = actingRole();
  const path = hash.slice(1).split("?")[0];
  const found = ROUTES.map((r) => ({ r, m: r.path.exec(path) })).find(({ r, m }) => m && r.roles.includes(role));
  if (!found) {
    location.replace(HOME[role] || "#/offers");
    return;
  }
  leavePage();
  renderChrome();
  const token = current.token;
  const page = h("div", { class: `page page-${found.r.title.toLowerCase().replace(/[^a-z]+/g, "-")}` });
  replace(main, page);
  document.title = `${found.r.title} · gpumarket`;
  const ctx = {
    params: found.m.slice(1).map((v) => (v === undefined ? "" : decodeURIComponent(v))),
    query: new URLSearchParams(hash.split("?")[1] || ""),
    role,
    account: session.current.account,
    team: acting.team,
    teams: teamsApi,
    alive: () => current.token === token,
    onLeave: (fn) => current.cleanups.push(fn),
    notify,
    setTitle: (title) => {
      document.title = `${title} · gpumarket`;
    },
  };
  try {
    found.r.render(page, ctx);
  } catch (error) {
    const box = errorBox();
    box.show(error instanceof ApiError ? error : `This page failed to load: ${error.message}`);
    replace(page, box.el);
  }
  const title = page.querySelector("h1");
  if (title && document.activeElement !== title) title.focus({ preventScroll: true });
}

async function boot() {
  document.querySelector(".skip-link").addEventListener("click", (event) => {
    event.preventDefault();
    const target = main.querySelector("h1") || main;
    // Only here does the heading show a focus box (app.css): a keyboard user moved to it, and sees where they are.
    target.classList.add("skip-target");
    target.addEventListener("blur", () => target.classList.remove("skip-target"), { once: true });
    target.focus();
  });
  window.addEventListener("hashchange", route);
  try {
    session.current = await api("GET", "/sessions/current", { quietAuth: true });
  } catch (error) {
    session.current = null;
    if (error instanceof ApiError && error.code === "session_expired") {
      if (location.hash && location.hash !== "#/signin") wantedHash = location.hash;
      showSignIn("Your session expired — sign in again.");
      return;
    }
    if (error instanceof ApiError && error.status !== 401) {
      if (location.hash && location.hash !== "#/signin") wantedHash = location.hash;
      showSignIn(`The console could not reach the API: ${error.message}`);
      return;
    }
  }
  if (session.current) {
    try {
      await loadContext();
    } catch {
      return; // the session ended meanwhile: the sign-in page is shown
    }
  }
  if (session.current && (location.hash === "" || location.hash === "#/" || location.hash === "#/signin" || location.hash === "#/signup")) {
    location.replace(HOME[actingRole()] || "#/offers");
    return;
  }
  route();
}

boot();
