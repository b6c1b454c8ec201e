// Teams: the context switcher in the header (act for your own account or for a team you are in: api.js then sends
// Gpumarket-Team on every call but the person's own), the team pages (#/teams: yours and a new one; #/teams/<id>:
// members and roles, invitations, leaving) and the mailed invitation (#/invite/<token>). Managing teams is always
// the person's own call (api.js's PERSONAL_PATHS), whatever the context.

import { acting, api, session } from "./api.js";
import { field, h, replace, table, timeEl, wrapAt } from "./dom.js";
import { busy, errorBox, heading, loadInto } from "./ui.js";

const ROLES = [["member", "member"], ["billing", "billing"], ["admin", "admin"], ["owner", "owner"]];
const ROLES_HINT = "member: rents and sees everything; billing: pays and sees, does not rent; admin: also manages members; owner: everything.";
const MANAGERS = new Set(["owner", "admin"]);
const PENDING_INVITE = "gpumarket.invite";

/** The teams the signed-in person is in ({id, name, role, members}), as GET /teams last said. */
export const teams = { list: [] };

function storageKey() {
  return `gpumarket.team.${session.current ? session.current.account.id : "none"}`;
}

function stored() {
  try {
    return JSON.parse(localStorage.getItem(storageKey()) || "null");
  } catch {
    return null;
  }
}

function store(team) {
  try {
    if (team) localStorage.setItem(storageKey(), JSON.stringify({ id: team.id, name: team.name }));
    else localStorage.removeItem(storageKey());
  } catch {
    /* private mode: the context lasts for this page only */
  }
}

/** Act for `team` ({id, name, role, kind}) or, with null, for the person's own account; remembered in this browser. */
export function actFor(team) {
  acting.team = team ? { id: team.id, name: team.name, role: team.role, kind: team.kind || "renter" } : null;
  store(acting.team);
}

/**
 * Ask for the person's teams and take up the remembered context. Resolves to a message when the remembered team is
 * no longer among them (the person left or was removed): the console falls back to the personal account, once.
 */
export async function loadTeams() {
  const answer = await api("GET", "/teams", { personal: true });
  teams.list = answer.items;
  const remembered = stored();
  if (!remembered) {
    acting.team = null;
    return null;
  }
  const found = teams.list.find((t) => t.id === remembered.id);
  actFor(found || null);
  return found ? null : `You are no longer a member of team ${remembered.name || remembered.id}: acting for your personal account.`;
}

/** Forget the context (the API said the team is not ours any more); the message to show once. */
export function lostTeam() {
  const name = acting.team ? acting.team.name : "";
  actFor(null);
  return `You are no longer a member of team ${name}: acting for your personal account.`;
}

export function contextLabel(team) {
  return `team ${team.name} (${team.role})`;
}

/**
 * The header's switcher: "Acting for" Personal or one of the teams (`onSwitch(team|null)` after a choice), and the
 * link to the team pages; the link alone for a person in no team.
 */
export function contextSwitcher(onSwitch, { current = false } = {}) {
  const teamsLink = h("a", { href: "#/teams", class: "teams-link", "aria-current": current ? "page" : null }, "Teams");
  if (!teams.list.length && !acting.team) return h("div", { class: "context-switch" }, teamsLink);
  const select = h("select", { id: "team-context", name: "team-context" },
    h("option", { value: "" }, "Personal"),
    teams.list.map((t) => h("option", { value: t.id, selected: acting.team && acting.team.id === t.id }, `${t.name} (${t.role})`)));
  select.addEventListener("change", () => {
    const team = teams.list.find((t) => t.id === select.value) || null;
    actFor(team);
    onSwitch(team);
  });
  return h("div", { class: "context-switch has-teams" }, h("label", { for: "team-context" }, "Acting for"), select, teamsLink);
}

/** The line under the header in a team's context. */
export function contextBanner() {
  if (!acting.team) return null;
  return h("p", { class: "context-banner", id: "context-banner" }, "Acting for ", h("strong", {}, `team ${acting.team.name}`),
    ` (${acting.team.role}): rentals, credit, SSH keys and registry logins here are the team's.`);
}

function roleOptions(mine) {
  return ROLES.filter(([role]) => role !== "owner" || mine === "owner");
}

/** #/teams: the teams you are in, and a new one. */
export function teamsPage(page, ctx) {
  const listSlot = h("div", {});
  const box = errorBox();
  const name = field({ label: "Team name", name: "name", maxlength: 64, autocomplete: "off", spellcheck: "false",
    hint: "1 to 64 letters, digits, spaces, '.', '_' or '-'. You become its owner." });
  const create = h("button", { type: "submit" }, "Create team");
  const form = h("form", { class: "card team-form", novalidate: true, "aria-labelledby": "new-team-title" },
    h("h2", { id: "new-team-title" }, "New team"), name.row, box.el, h("div", { class: "actions" }, create));

  const show = loadInto(ctx, listSlot, async () => {
    await ctx.teams.refresh();
    const rows = teams.list.map((t) => {
      const act = h("button", { type: "button", class: "secondary small", "aria-label": `Act for ${t.name}`,
        disabled: acting.team && acting.team.id === t.id }, acting.team && acting.team.id === t.id ? "Acting for it" : "Act for it");
      act.addEventListener("click", () => ctx.teams.switchTo(t));
      return h("tr", { dataset: { teamId: t.id } }, h("td", {}, h("a", { href: `#/teams/${encodeURIComponent(t.id)}` }, t.name)),
        h("td", {}, t.role), h("td", {}, String(t.members)), h("td", {}, timeEl(t.created_at)), h("td", { class: "row-actions" }, act));
    });
    return h("section", { class: "card", "aria-labelledby": "teams-title" }, h("h2", { id: "teams-title" }, "Your teams"),
      table({ caption: `${teams.list.length} team${teams.list.length === 1 ? "" : "s"}`, className: "teams",
        columns: ["Team", "Your role", "Members", "Created", h("th", { scope: "col" }, h("span", { class: "visually-hidden" }, "Actions"))],
        rows, empty: "You are in no team yet: make one below, or open an invitation's link." }));
  });

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    box.clear();
    const wanted = name.input.value.trim();
    if (!wanted) {
      box.show("Give the team a name.");
      name.input.focus();
      return;
    }
    await busy(create, async () => {
      try {
        const team = await api("POST", "/teams", { body: { name: wanted }, personal: true });
        ctx.notify(`Team ${team.name} is made, with you as its owner.`);
        name.input.value = "";
        await ctx.teams.refresh();
        location.hash = `#/teams/${encodeURIComponent(team.id)}`;
      } catch (error) {
        if (error.status !== 401) box.show(error);
      }
    }, "Creating…");
  });

  replace(page, heading("Teams", "Act for a team to rent, pay and keep SSH keys together; the switcher at the top says for whom you act."),
    listSlot, form);
  void show;
}

/** #/teams/<id>: members and roles, open invitations, invite, leave. */
export function teamPage(page, ctx) {
  const teamId = ctx.params[0];
  const box = errorBox();
  const slot = h("div", {});
  replace(page, heading("Team"), box.el, slot);

  const act = async (button, label, work) => {
    box.clear();
    await busy(button, async () => {
      try {
        await work();
      } catch (error) {
        if (error.status !== 401) {
          box.show(error);
          box.el.scrollIntoView({ block: "nearest" });
        }
      }
    }, label);
  };

  const memberRow = (team, m) => {
    const me = m.account_id === session.current.account.id;
    const manager = MANAGERS.has(team.role);
    const cell = h("td", { class: "row-actions" });
    let roleCell = m.role;
    if (manager && (team.role === "owner" || m.role !== "owner")) {
      const select = h("select", { "aria-label": `Role of ${m.name}`, class: "member-role" },
        roleOptions(team.role).map(([role]) => h("option", { value: role, selected: role === m.role }, role)));
      const save = h("button", { type: "button", class: "secondary small" }, "Change");
      save.addEventListener("click", () => act(save, "Saving…", async () => {
        const changed = await api("PATCH", `/teams/${encodeURIComponent(team.id)}/members/${encodeURIComponent(m.account_id)}`,
          { body: { role: select.value }, personal: true });
        ctx.notify(`${m.name}'s role is ${changed.role} now.`);
        await ctx.teams.refresh();
        await load();
      }));
      roleCell = h("span", { class: "role-edit" }, select, save);
    }
    if (me) {
      const leave = h("button", { type: "button", class: "secondary small" }, "Leave team");
      leave.addEventListener("click", () => confirmIn(cell, leave, "Leave this team? Your SSH keys in it stop working.", "Yes, leave",
        () => act(leave, "Leaving…", async () => {
          await api("DELETE", `/teams/${encodeURIComponent(team.id)}/members/${encodeURIComponent(m.account_id)}`, { personal: true });
          if (acting.team && acting.team.id === team.id) ctx.teams.switchTo(null, { quiet: true });
          ctx.notify(`You left team ${team.name}.`);
          await ctx.teams.refresh();
          location.hash = "#/teams";
        })));
      cell.append(leave);
    } else if (manager && (team.role === "owner" || m.role !== "owner")) {
      const remove = h("button", { type: "button", class: "secondary small", "aria-label": `Remove ${m.name}` }, "Remove");
      remove.addEventListener("click", () => confirmIn(cell, remove, `Remove ${m.name}? Their SSH keys and API keys for the team stop working.`,
        "Yes, remove", () => act(remove, "Removing…", async () => {
          await api("DELETE", `/teams/${encodeURIComponent(team.id)}/members/${encodeURIComponent(m.account_id)}`, { personal: true });
          ctx.notify(`${m.name} is no longer in the team.`);
          await load();
        })));
      cell.append(remove);
    }
    // A person who signed up is named by their address: shown once.
    return h("tr", { dataset: { accountId: m.account_id } },
      h("td", { class: "member-name" }, wrapAt(m.name), me ? " (you)" : "",
        m.email && m.email !== m.name ? h("span", { class: "hint block" }, wrapAt(m.email)) : null),
      h("td", {}, roleCell), h("td", {}, timeEl(m.added_at)), cell);
  };

  const invitations = (team) => {
    const rows = (team.invitations || []).map((inv) => {
      const withdraw = h("button", { type: "button", class: "secondary small", "aria-label": `Withdraw the invitation to ${inv.email}` }, "Withdraw");
      withdraw.addEventListener("click", () => act(withdraw, "Withdrawing…", async () => {
        await api("DELETE", `/teams/${encodeURIComponent(team.id)}/invitations/${encodeURIComponent(inv.id)}`, { personal: true });
        ctx.notify(`The invitation to ${inv.email} is withdrawn: its link no longer works.`);
        await load();
      }));
      return h("tr", { dataset: { invitationId: inv.id } }, h("td", {}, wrapAt(inv.email)), h("td", {}, inv.role), h("td", {}, timeEl(inv.expires_at)),
        h("td", { class: "row-actions" }, withdraw));
    });
    const email = field({ label: "Email", name: "email", type: "email", autocomplete: "off", spellcheck: "false" });
    const role = field({ label: "Role", name: "role", type: "select", value: "member", options: roleOptions(team.role), hint: ROLES_HINT });
    const send = h("button", { type: "submit" }, "Invite");
    const form = h("form", { class: "invite-form", novalidate: true, "aria-label": "Invite someone" },
      h("div", { class: "grid" }, email.row, role.row), h("div", { class: "actions" }, send));
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      if (!email.input.value.trim()) {
        box.show("Type the address to invite.");
        email.input.focus();
        return;
      }
      act(send, "Inviting…", async () => {
        const made = await api("POST", `/teams/${encodeURIComponent(team.id)}/invitations`,
          { body: { email: email.input.value.trim(), role: role.input.value }, personal: true });
        ctx.notify(`Invitation mailed to ${made.email} (${made.role}); the link works for 7 days.`);
        await load();
      });
    });
    return h("section", { class: "card", "aria-labelledby": "invitations-title" }, h("h2", { id: "invitations-title" }, "Invite someone"),
      h("p", { class: "hint block" }, "They get a link by mail and join once signed in with that address."), form,
      table({ caption: `Open invitations: ${rows.length}`, className: "invitations", columns: ["Email", "Role", "Expires",
        h("th", { scope: "col" }, h("span", { class: "visually-hidden" }, "Actions"))], rows, empty: "No open invitations." }));
  };

  const load = async () => {
    const team = await api("GET", `/teams/${encodeURIComponent(teamId)}`, { personal: true });
    if (!ctx.alive()) return;
    ctx.setTitle(team.name);
    const title = page.querySelector("h1");
    title.textContent = `Team ${team.name}`;
    const here = acting.team && acting.team.id === team.id;
    const switchButton = h("button", { type: "button", id: "act-for-team", disabled: here }, here ? "Acting for this team" : "Act for this team");
    switchButton.addEventListener("click", () => ctx.teams.switchTo({ id: team.id, name: team.name, role: team.role, kind: team.kind }));
    replace(slot, h("p", { class: "crumbs" }, h("a", { href: "#/teams" }, "← All teams")),
      h("p", { class: "team-summary" }, `Your role: ${team.role}. `, h("span", { class: "hint" }, `Created `, timeEl(team.created_at), ".")),
      h("div", { class: "actions" }, switchButton),
      h("section", { class: "card", "aria-labelledby": "members-title" }, h("h2", { id: "members-title" }, "Members"),
        table({ caption: `${team.members.length} member${team.members.length === 1 ? "" : "s"}`, className: "members",
          columns: ["Member", "Role", "Added", h("th", { scope: "col" }, h("span", { class: "visually-hidden" }, "Actions"))],
          rows: team.members.map((m) => memberRow(team, m)) })),
      MANAGERS.has(team.role) ? invitations(team) : null);
  };

  load().catch((error) => {
    if (error.status !== 401 && ctx.alive()) box.show(error);
  });
}

/** Ask in `cell` before `run`; "Keep" puts `button` back. */
function confirmIn(cell, button, question, yesLabel, run) {
  const yes = h("button", { type: "button", class: "danger small" }, yesLabel);
  const no = h("button", { type: "button", class: "secondary small" }, "Cancel");
  no.addEventListener("click", () => {
    replace(cell, button);
    button.focus();
  });
  yes.addEventListener("click", async () => {
    await run();
    if (cell.isConnected) replace(cell, button);
  });
  replace(cell, h("p", { class: "confirm-text" }, question), h("div", { class: "actions" }, yes, no));
  no.focus();
}

/** A pending invitation (opened before signing in), taken once. */
export function pendingInvite({ take = false } = {}) {
  try {
    const token = localStorage.getItem(PENDING_INVITE);
    if (take) localStorage.removeItem(PENDING_INVITE);
    return token;
  } catch {
    return null;
  }
}

/** #/invite/<token>: join the team, or sign in (or up) first and come back here. */
export function invitePage(main, { params, teamsApi }) {
  const token = params[0];
  document.title = "Team invitation · gpumarket";
  const box = errorBox();
  if (!session.current) {
    try {
      localStorage.setItem(PENDING_INVITE, token);
    } catch {
      /* the link can be opened again after signing in */
    }
    replace(main, h("div", { class: "page page-invite" }, heading("Join a team"),
      h("p", {}, "You are invited to a team on gpumarket. Sign in with the address the invitation was mailed to — or make an account "
        + "with it and verify it — and you come back here to join."),
      h("p", { class: "join-links" }, h("a", { href: "#/signin" }, "Sign in"), " · ", h("a", { href: "#/signup" }, "Create an account"))));
    return;
  }
  const join = h("button", { type: "button", id: "join-team" }, "Join team");
  join.addEventListener("click", () => busy(join, async () => {
    box.clear();
    try {
      const team = await api("POST", "/team-invitations/accept", { body: { token }, personal: true });
      pendingInvite({ take: true });
      await teamsApi.refresh();
      teamsApi.switchTo(team, { quiet: true });
      teamsApi.notify(`You joined team ${team.name} as ${team.role}, and act for it now.`);
      location.hash = `#/teams/${encodeURIComponent(team.id)}`;
    } catch (error) {
      if (error.code === "invalid_invitation") pendingInvite({ take: true });
      if (error.status !== 401) box.show(error);
    }
  }, "Joining…"));
  replace(main, h("div", { class: "page page-invite" }, heading("Join a team"),
    h("p", {}, `You are invited to a team on gpumarket. Joining adds you to it as ${session.current.account.name}; you can then act for it `
      + "with the switcher at the top."), box.el, h("div", { class: "actions" }, join)));
}
