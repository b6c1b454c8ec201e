// The rental page's Connect panel: how to reach a running rental. SSH (the gpumarket command to
// copy, file copies, the host key's SHA256 fingerprint), an Open button per port the workload
// declared (POST /rentals/{id}/connect, then the relay's web address in a new tab), and the bytes
// moved through relays. The panel is built once per mode and then updated in place, so the page's
// refresh every few seconds neither loses the focus nor clears a message.

import { api } from "./api.js";
import { h, link, num, replace, timeEl } from "./dom.js";
import { busy, copyable, errorBox } from "./ui.js";

const JUPYTER_PORT = 8888;

/** Bytes in decimal units as people read them: 0 B, 950 B, 12.3 kB, 12.3 MB, 1.5 GB. */
export function humanBytes(bytes) {
  const n = Number(bytes) || 0;
  const units = ["B", "kB", "MB", "GB", "TB", "PB"];
  let value = n;
  let unit = 0;
  while (value >= 1000 && unit < units.length - 1) {
    value /= 1000;
    unit += 1;
  }
  return unit === 0 ? `${num(value, 0)} B` : `${num(value, value < 100 ? 1 : 0)} ${units[unit]}`;
}

/**
 * An OpenSSH public key line ("ssh-ed25519 AAAA… comment") → "SHA256:…" as ssh-keygen -l prints it
 * (SHA-256 of the decoded key blob, base64 without padding). Resolves to null when the line is not
 * a key or the page has no crypto.subtle (a console served over plain HTTP from another machine).
 */
export async function sshFingerprint(line) {
  const blob = String(line || "").trim().split(/\s+/)[1];
  if (!blob || !/^[A-Za-z0-9+/]+={0,2}$/.test(blob) || !globalThis.crypto || !crypto.subtle) return null;
  let bytes;
  try {
    bytes = Uint8Array.from(atob(blob), (c) => c.charCodeAt(0));
  } catch {
    return null;
  }
  const digest = new Uint8Array(await crypto.subtle.digest("SHA-256", bytes));
  return `SHA256:${btoa(String.fromCharCode(...digest)).replace(/=+$/, "")}`;
}

/** Whether the rental's /workspace is still reachable over SFTP after its workload ended. */
function workspaceOpen(rental) {
  return Boolean(rental.workspace_until) && new Date(rental.workspace_until).getTime() > Date.now();
}

/** What the panel shows for the rental: hold, waiting, live, files, ended, or others (not the viewer's). */
function modeOf(rental, role) {
  const kind = (rental.workload || { kind: "hold" }).kind;
  if (kind === "hold") return "hold";
  if (role !== "renter") return "others";
  if (rental.state === "running") return "live";
  if (rental.state === "pending" || rental.state === "starting") return "waiting";
  if (workspaceOpen(rental)) return "files";
  return "ended";
}

/**
 * The Connect panel of rental `rentalId`. Returns {el, update(rental)}: call update with every
 * fresh GET /rentals/{id}.
 */
export function connectPanel(ctx, rentalId) {
  const body = h("div", { class: "connect-body" });
  const el = h("section", { class: "card connect", "aria-labelledby": "connect-title" }, h("h2", { id: "connect-title" }, "Connect"), body);
  const rid = encodeURIComponent(rentalId);
  let mode = null;
  let parts = null; // the live pieces update() rewrites: fingerprint, bytes

  const connect = (port) => api("POST", `/rentals/${rid}/connect`, { body: { port } });

  const keysNote = () => {
    const note = h("p", { class: "hint ssh-keys-note", hidden: true });
    api("GET", "/account/ssh-keys").then(({ ssh_keys: keys }) => {
      if (!ctx.alive() || keys.length) return;
      replace(note, "No SSH key yet? Add one on the ", link("#/ssh-keys", "SSH keys page"), "; rentals started after that accept it (a rental gets the keys its renter has when it starts).");
      note.hidden = false;
    }).catch(() => {
      /* the note is a hint; without the list there is nothing to say */
    });
    return note;
  };

  const sshPart = (rental, filesOnly) => {
    const fingerprint = h("code", { class: "fingerprint", id: "ssh-host-key" }, "—");
    const files = h("div", { class: "connect-files" },
      h("p", { class: "connect-label" }, filesOnly ? "Copy your files out of /workspace:" : "Copy files to and from /workspace:"),
      filesOnly ? null : copyable(`gpumarket cp ./data ${rentalId}:`, { id: "cp-to-command", label: "the command that copies ./data to the rental" }),
      copyable(`gpumarket cp ${rentalId}:results.csv .`, { id: "cp-from-command", label: "the command that copies results.csv from the rental" }));
    const part = h("div", { class: "connect-part connect-ssh" },
      h("h3", {}, filesOnly ? "Files" : "SSH"),
      h("div", { class: "ssh-grid" },
        h("div", { class: "ssh-commands" },
          filesOnly
            ? h("p", { id: "workspace-note" }, "The workload has ended; its /workspace stays reachable over SFTP until ", timeEl(rental.workspace_until),
              ". A shell is no longer possible.")
            : [h("p", { class: "connect-label" }, "Open a shell in the rental:"),
              copyable(`gpumarket ssh ${rentalId}`, { id: "ssh-command", label: "the SSH command" }),
              h("p", { class: "hint" }, "Add ", h("code", {}, "-L 8888:localhost:8888"), " to forward a port, as with ssh.")],
          files),
        h("div", { class: "ssh-key" },
          h("dl", { class: "facts" }, h("dt", {}, "Host key"), h("dd", {}, fingerprint,
            h("span", { class: "hint block host-key-hint" }, "gpumarket ssh pins it for you; compare it when another SSH client asks."))),
          keysNote())));
    return { part, fingerprint };
  };

  const portRow = (port) => {
    const jupyter = port === JUPYTER_PORT;
    const errors = errorBox();
    const open = h("button", { type: "button", class: "small", dataset: { port },
      "aria-label": jupyter ? `Open Jupyter (port ${port}) in a new tab` : `Open port ${port} in a new tab` }, jupyter ? "Open Jupyter" : "Open");
    const fallback = h("span", { class: "port-link" });
    open.addEventListener("click", async () => {
      errors.clear();
      fallback.replaceChildren();
      // The tab opens now, while the click still counts: one opened after the fetch would be blocked as a popup.
      const tab = window.open("", "_blank");
      if (tab) {
        try {
          tab.opener = null;
          tab.document.title = `Connecting to port ${port}…`;
          tab.document.body.textContent = `Connecting to port ${port} of rental ${rentalId}…`;
        } catch {
          /* a browser that opened it elsewhere: the navigation below still works */
        }
      }
      try {
        const view = await busy(open, () => connect(port), "Opening…");
        if (!view.web_url) {
          if (tab) tab.close();
          errors.show(`The relay of this host serves no web ports; reach port ${port} with gpumarket ssh ${rentalId} -L ${port}:localhost:${port}.`);
          return;
        }
        if (tab && !tab.closed) tab.location.replace(view.web_url);
        else replace(fallback, h("a", { href: view.web_url, target: "_blank", rel: "noopener noreferrer" }, `Open port ${port}`), " (the browser blocked the new tab)");
      } catch (error) {
        if (tab) tab.close();
        if (error.status !== 401) errors.show(error);
      }
    });
    return h("li", { class: "port-row", dataset: { port } },
      h("span", { class: "port-name" }, jupyter ? `Jupyter, port ${port}` : `Port ${port}`), open, fallback, errors.el);
  };

  const portsPart = (rental) => {
    const w = rental.workload || {};
    const ports = w.kind === "container" ? w.ports || [] : [];
    if (!ports.length) return null;
    const jupyter = ports.includes(JUPYTER_PORT);
    return h("div", { class: "connect-part connect-ports" },
      h("h3", {}, "Ports"),
      h("p", { class: "hint" }, "Each opens in a new tab over HTTPS, through the relay; only you can open it."),
      h("ul", { class: "port-list" }, ports.map(portRow)),
      jupyter ? h("p", { class: "hint" }, "Jupyter asks for its token: JUPYTER_TOKEN from the rental's environment, or the one it printed in the logs below.") : null);
  };

  const moved = () => {
    const bytesIn = h("span", { id: "tunnel-in" }, "—");
    const bytesOut = h("span", { id: "tunnel-out" }, "—");
    const part = h("div", { class: "connect-part connect-moved" }, h("h3", {}, "Data moved"),
      h("dl", { class: "facts" }, h("dt", {}, "To the rental"), h("dd", {}, bytesIn), h("dt", {}, "From the rental"), h("dd", {}, bytesOut)),
      h("p", { class: "hint" }, "Through relays, by SSH and ports, since the rental started."));
    return { part, bytesIn, bytesOut };
  };

  const build = (rental) => {
    parts = null;
    if (mode === "hold") {
      replace(body, h("p", { id: "connect-none" }, "This rental holds GPUs and runs nothing to connect to. Rent with a template or an image to log in or open ports."));
      return;
    }
    if (mode === "others") {
      replace(body, h("p", { id: "connect-none" }, "Only the rental's renter can connect to it."));
      return;
    }
    if (mode === "waiting") {
      replace(body, h("p", { id: "connect-none" }, "SSH and the rental's ports open once its workload is running."));
      return;
    }
    const data = moved();
    if (mode === "ended") {
      replace(body, h("p", { id: "connect-none" }, "The rental has ended: nothing to connect to any more."), data.part);
      parts = { data };
      return;
    }
    const ssh = sshPart(rental, mode === "files");
    replace(body, ssh.part, h("div", { class: "connect-grid" }, mode === "live" ? portsPart(rental) : null, data.part));
    parts = { data, ssh };
  };

  let shownKey;
  const update = (rental) => {
    const next = modeOf(rental, ctx.role);
    el.dataset.mode = next;
    if (next !== mode) {
      mode = next;
      shownKey = undefined;
      build(rental);
    }
    if (!parts) return;
    const tunnel = rental.tunnel || {};
    parts.data.bytesIn.textContent = humanBytes(tunnel.bytes_in);
    parts.data.bytesIn.dataset.bytes = String(tunnel.bytes_in ?? 0);
    parts.data.bytesOut.textContent = humanBytes(tunnel.bytes_out);
    parts.data.bytesOut.dataset.bytes = String(tunnel.bytes_out ?? 0);
    if (parts.ssh && rental.ssh_host_key !== shownKey) {
      shownKey = rental.ssh_host_key;
      const target = parts.ssh.fingerprint;
      if (!shownKey) {
        target.textContent = "not reported: this host's agent serves no SSH (use the ports and logs)";
        target.classList.add("missing");
        return;
      }
      target.classList.remove("missing");
      const algorithm = shownKey.trim().split(/\s+/)[0];
      sshFingerprint(shownKey).then((fp) => {
        if (shownKey !== rental.ssh_host_key) return; // a newer key arrived meanwhile
        replace(target, fp || algorithm, " ", h("span", { class: "word" }, fp ? `(${algorithm})` : "(open the console over HTTPS to see its fingerprint)"));
        if (fp) target.dataset.fingerprint = fp;
      });
    }
  };

  return { el, update };
}

/**
 * A cluster's Connect panel: {el, update(cluster)}, called with every fresh GET /clusters/{id}. Each running node's
 * `gpumarket cluster ssh` line, the ssh-config lines that name every node for plain ssh, and a file copy; only while
 * they work: a hold cluster runs nothing to log in to, and a node that is not running refuses a shell.
 */
export function clusterConnectPanel(clusterId, role) {
  const body = h("div", { class: "connect-body" });
  const el = h("section", { class: "card connect cluster-connect", "aria-labelledby": "cluster-connect-title", hidden: true },
    h("h2", { id: "cluster-connect-title" }, "Connect"), body);
  let drawn = null; // what the panel shows now: redrawn only when it changes (a Copy's status and the focus stay)

  const update = (cluster) => {
    const kind = cluster.template ? "template" : (cluster.workload || { kind: "hold" }).kind || "hold";
    const active = ["pending", "starting", "running", "degraded"].includes(cluster.state);
    const running = (cluster.members || []).filter((m) => m.state === "running").sort((a, b) => a.node_rank - b.node_rank);
    const key = !active ? "ended" : kind === "hold" ? "hold" : role !== "renter" ? "others" : running.map((m) => `${m.node_rank}:${m.rental_id}`).join(",") || "waiting";
    if (key === drawn) return;
    drawn = key;
    el.hidden = key === "ended";
    if (key === "ended") {
      body.replaceChildren();
    } else if (key === "hold") {
      replace(body, h("p", { id: "cluster-connect-none" }, "This cluster holds GPUs and runs nothing to log in to. Rent one with a template or an image to reach its nodes by SSH."));
    } else if (key === "others") {
      replace(body, h("p", { id: "cluster-connect-none" }, "Only the cluster's renter can connect to its nodes."));
    } else if (key === "waiting") {
      replace(body, h("p", { id: "cluster-connect-none" }, "The SSH commands show here once a node runs."));
    } else {
      const first = running[0];
      replace(body, h("div", { class: "connect-grid" },
        h("div", { class: "connect-part" },
          h("h3", {}, "SSH"),
          h("p", { class: "connect-label" }, "Open a shell on a node:"),
          running.map((m) => copyable(`gpumarket cluster ssh ${clusterId} node-${m.node_rank}`,
            { id: `cluster-ssh-node-${m.node_rank}`, label: `the SSH command of node-${m.node_rank}` })),
          h("p", { class: "hint" }, "Each node is a rental of its own: ", h("code", {}, `gpumarket ssh ${first.rental_id}`), " reaches node-", String(first.node_rank), " too.")),
        h("div", { class: "connect-part" },
          h("h3", {}, "Plain ssh, scp, editors"),
          h("p", { class: "connect-label" }, "Write an ssh_config entry for every running rental:"),
          copyable("gpumarket ssh-config --write", { id: "cluster-ssh-config", label: "the ssh-config command" }),
          h("p", { class: "hint" }, "Once, at the top of ~/.ssh/config: ", h("code", {}, "Include ~/.config/gpumarket/ssh_config"), ". Then:"),
          copyable(`ssh ${first.rental_id}.gpumarket`, { id: "cluster-ssh-plain", label: `the plain ssh command of node-${first.node_rank}` }),
          h("p", { class: "connect-label" }, "Copy files to a node's /workspace:"),
          copyable(`gpumarket cp ./data ${first.rental_id}:`, { id: "cluster-cp", label: `the command that copies ./data to node-${first.node_rank}` }))));
    }
  };
  return { el, update };
}
