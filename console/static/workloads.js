// What a rental runs: the Rent dialog's "What to run" choice (a template, a custom image, a
// command on the host, or hold), the client-side checks that mirror the API's, and how a
// workload and a host's isolation read on the other pages.

import { api } from "./api.js";
import { facts, field, h, num, replace, uid, wrapAt } from "./dom.js";
import { withError } from "./ui.js";

// The API's image-reference grammar (shared/imageref.py, the distribution project's), ASCII only.
const DOMAIN_COMPONENT = "(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])";
const DOMAIN = `(?:${DOMAIN_COMPONENT}(?:\\.${DOMAIN_COMPONENT})*(?::[0-9]{1,5})?)`;
const PATH_COMPONENT = "(?:[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*)";
const TAG = "(?:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})";
const DIGEST = "(?:[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})";
const REFERENCE_RE = new RegExp(`^(?<name>(?:${DOMAIN}/)?${PATH_COMPONENT}(?:/${PATH_COMPONENT})*)(?::${TAG})?(?:@${DIGEST})?$`);
const MAX_REFERENCE_CHARS = 512;
const MAX_NAME_CHARS = 255;
const MAX_PORTS = 32;
const MAX_ENV_VARS = 256;
const ENV_NAME_RE = /^[A-Za-z_][A-Za-z0-9_]*$/;
const RESERVED_ENV = new Set(["CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"]);
const MAX_SHM_MIB = 1 << 20;

/** A problem with an image reference, in the API's words, or null when it is valid. */
export function imageProblem(text) {
  if (!text) return "Enter an image reference such as ubuntu:24.04 or nvcr.io/nvidia/pytorch:24.05-py3.";
  if (text.length > MAX_REFERENCE_CHARS) return `An image reference has at most ${MAX_REFERENCE_CHARS} characters.`;
  const match = REFERENCE_RE.exec(text);
  if (!match) {
    if (REFERENCE_RE.test(text.toLowerCase())) return `"${text.slice(0, 80)}" is not a valid image reference: the name must be lower-case (only the registry and the tag may have capitals).`;
    return `"${text.slice(0, 80)}" is not a valid image reference: write [registry/]name[:tag] in ASCII, e.g. ubuntu:24.04.`;
  }
  if (match.groups.name.length > MAX_NAME_CHARS) return `The image name is longer than ${MAX_NAME_CHARS} characters.`;
  return null;
}

/** "8888, 6006" → [8888, 6006]; throws an Error saying what is wrong. */
export function parsePorts(text) {
  const words = text.split(/[\s,]+/).filter(Boolean);
  const ports = [];
  for (const word of words) {
    const port = /^\d{1,6}$/.test(word) ? Number(word) : NaN;
    if (!Number.isInteger(port) || port < 1 || port > 65535) {
      throw new Error(`Port ${word.slice(0, 20)} is out of range: each port is a whole number from 1 to 65535.`);
    }
    if (ports.includes(port)) throw new Error(`Port ${port} is named twice.`);
    ports.push(port);
  }
  if (ports.length > MAX_PORTS) throw new Error(`At most ${MAX_PORTS} ports.`);
  return ports;
}

/** "NAME=value" lines → {NAME: "value"} (empty lines and # comments skipped); throws an Error. */
export function parseEnv(text) {
  const env = {};
  const lines = text.split(/\r?\n/);
  for (const [i, raw] of lines.entries()) {
    const line = raw.trim();
    if (!line || line.startsWith("#")) continue;
    const eq = line.indexOf("=");
    const name = eq < 0 ? line : line.slice(0, eq).trim();
    if (eq < 0 || !ENV_NAME_RE.test(name)) {
      throw new Error(`Line ${i + 1}: write NAME=value, where NAME is letters, digits and _ and does not start with a digit.`);
    }
    if (RESERVED_ENV.has(name) || name.startsWith("GPUMARKET_")) throw new Error(`Line ${i + 1}: ${name} is set by the agent to the rental's GPUs.`);
    if (Object.hasOwn(env, name)) throw new Error(`Line ${i + 1}: ${name} is set twice.`);
    env[name] = raw.slice(raw.indexOf("=") + 1);
  }
  if (Object.keys(env).length > MAX_ENV_VARS) throw new Error(`At most ${MAX_ENV_VARS} variables.`);
  return env;
}

/** Words separated by spaces, or a JSON list of strings when the text starts with "["; null when empty. */
export function parseWords(text) {
  const trimmed = text.trim();
  if (!trimmed) return null;
  if (trimmed.startsWith("[")) {
    let words;
    try {
      words = JSON.parse(trimmed);
    } catch {
      throw new Error('Write a JSON list of strings, e.g. ["bash", "-c", "echo hello"].');
    }
    if (!Array.isArray(words) || !words.every((w) => typeof w === "string")) throw new Error('Write a JSON list of strings, e.g. ["bash", "-c", "echo hello"].');
    return words;
  }
  return trimmed.split(/\s+/);
}

/** Words as the user would type them back: plain when no word has a space, a JSON list otherwise. */
export function wordsText(words) {
  if (!words || words.length === 0) return "";
  return words.every((w) => w && !/[\s"[\]]/.test(w)) ? words.join(" ") : JSON.stringify(words);
}

function portsText(ports) {
  return ports && ports.length ? ports.join(", ") : "none";
}

// ---- Isolation --------------------------------------------------------------------

/** How a host isolates rentals, in a few words: [text, class suffix]. */
export function isolationSummary(isolation) {
  if (!isolation) return ["isolation unknown", "unknown"];
  if (!isolation.isolated) return ["not isolated", "none"];
  const kinds = isolation.kinds || [];
  if (kinds.includes("container")) return ["isolated · containers", "containers"];
  if (kinds.includes("process") && isolation.process_isolation === "uid") return ["isolated · per-user processes", "processes"];
  return ["isolated · hold only", "hold"];
}

/** The isolation badge of an offer or a host, with the details in its title. */
export function isolationBadge(isolation) {
  const [text, kind] = isolationSummary(isolation);
  let title = "The host's agent has not said how it isolates workloads.";
  if (isolation) {
    title = [
      `Runs: ${(isolation.kinds || []).join(", ") || "hold"}`,
      isolation.container_engine ? `engine ${isolation.container_engine}` : "no container engine",
      isolation.process_isolation === "uid" ? "host processes under a user of their own" : null,
      isolation.isolated ? null : "not proven isolated",
      egressText(isolation.network),
    ].filter(Boolean).join("; ");
  }
  return h("span", { class: `badge isolation-${kind}`, title, dataset: { isolation: kind } }, text);
}

/** What a host's rentals may reach beyond it, in one line. */
export function egressText(network) {
  if (!network || network.guarded == null) return null;
  if (!network.guarded) return "rentals' network guard off";
  const allowed = network.egress_allow && network.egress_allow.length ? network.egress_allow.join(", ") : "none";
  return `egress: internet only; private ranges allowed: ${allowed}`;
}

function policyText(policy) {
  const allowed = policy && policy.allowed && policy.allowed.length ? policy.allowed.join(", ") : "any image";
  const largest = policy && policy.max_image_mib ? `${num(policy.max_image_mib / 1024, 1)} GiB` : "no limit";
  return { allowed, largest };
}

/** The facts of a host's isolation and image policy (the host page). */
export function isolationFacts(isolation) {
  if (!isolation) {
    return facts([["Isolation", isolationBadge(null)],
      ["What it means", "The host's agent predates isolation reports; renters see it as unknown."]]);
  }
  const { allowed, largest } = policyText(isolation.image_policy);
  return facts([
    ["Isolation", isolationBadge(isolation)],
    ["Workloads it runs", (isolation.kinds || []).join(", ") || "hold"],
    ["Container engine", isolation.container_engine || "none answers"],
    ["Host processes", isolation.process_isolation === "uid" ? "each rental under a user of its own" : "not separated (no per-rental users)"],
    ["Rentals' network", h("span", { id: "egress-policy" }, egressText(isolation.network) || "not reported by this agent")],
    isolation.network && isolation.network.self_test ? ["Self-test", isolation.network.self_test] : null,
    ["Allowed images", h("span", { id: "image-policy-allowed" }, allowed)],
    ["Largest image", h("span", { id: "image-policy-largest" }, largest)],
    isolation.reason ? ["Why not more", isolation.reason] : null,
  ]);
}

// ---- What a rental runs ----------------------------------------------------------------

/** One line saying what a rental's request or view runs. */
export function describeRun({ template, workload }, templates = []) {
  if (template) {
    const known = templates.find((t) => t.name === template);
    const image = (workload && workload.image) || (known && known.image);
    return `Runs template ${template}${image ? ` (${image})` : ""}`;
  }
  if (!workload || !workload.kind || workload.kind === "hold") return "Holds the GPUs and runs nothing"; // kind-less: a hold
  if (workload.kind === "container") return `Runs image ${workload.image}`;
  if (workload.kind === "process") return `Runs ${wordsText(workload.argv)} on the host`;
  return `Runs a ${workload.kind} workload`;
}

/** A few words for a rentals table: "template base", an image, "command" or "hold". */
export function runsShort({ template, workload }) {
  if (template) return `template ${template}`;
  if (!workload || !workload.kind || workload.kind === "hold") return "hold";
  if (workload.kind === "container") return h("code", { class: "image-ref" }, wrapAt(workload.image)); // breaks at "/", ":", "@" only
  return workload.kind === "process" ? "command on the host" : workload.kind;
}

/** The rental page's facts about its workload. */
export function workloadFacts(rental) {
  const w = rental.workload || { kind: "hold" };
  const pairs = [["What runs", h("span", { id: "rental-runs" }, describeRun(rental))]];
  if (w.kind === "container") {
    pairs.push(["Image", h("code", { class: "image-ref" }, wrapAt(w.image))]);
    if (w.command && w.command.length) pairs.push(["Command", h("code", {}, wordsText(w.command))]);
    if (w.args && w.args.length) pairs.push(["Arguments", h("code", {}, wordsText(w.args))]);
    if (w.ports && w.ports.length) pairs.push(["Ports", portsText(w.ports)]);
    if (w.env && Object.keys(w.env).length) pairs.push(["Environment", h("code", {}, Object.keys(w.env).join(", "))]);
  } else if (w.kind === "process") {
    pairs.push(["Command", h("code", {}, wordsText(w.argv))]);
  }
  return pairs;
}

/**
 * The confirmation's "Ports" fact for a request ({template} or {workload}), or null when it runs nothing that serves
 * ports (a hold, a command on the host): each declared port with the web address it gets once the rental runs (a
 * name of its own under the relay's ports domain, opened from the rental's page). `templateOf(name)` gives a template.
 */
export function portsFact(request, templateOf = () => null) {
  const template = request.template ? templateOf(request.template) : null;
  const workload = request.workload || {};
  if (!template && workload.kind !== "container") return null;
  const ports = (template ? template.ports : workload.ports) || [];
  if (!ports.length) return ["Ports", h("span", { id: "confirm-ports" }, "none declared: reach it by SSH")];
  return ["Ports", [h("ul", { class: "confirm-ports", id: "confirm-ports" }, ports.map((port) => h("li", { dataset: { port } },
    h("strong", {}, String(port)), port === 8888 ? " (Jupyter)" : "", " → ",
    h("code", {}, "https://", h("wbr", {}), h("span", { class: "id" }, `‹rental›-${port}`), h("wbr", {}), ".‹relay’s domain›/")))),
  h("span", { class: "hint block" }, "Each its own web address through the relay, opened from the rental’s page once it runs.")]];
}

/** The platform's templates, as they are now (an admin may have changed them since the last dialog). */
export async function loadTemplates() {
  return (await api("GET", "/templates")).templates || [];
}

const fail = (message, target) => Object.assign(new Error(message), { target });

/**
 * The "What to run" fieldset for an offer. Returns {el, ready, read, clear, showApiError, describe, templateOf}:
 * read() → {template} | {workload}, throwing an Error whose .target shows it next to the field; await `ready` (the
 * templates loaded or failed) before read().
 * `containersOnly` offers a template or an image alone (a service's replicas), `preferred` the template chosen first.
 */
export function workloadChooser(offer, { containersOnly = false, preferred: preferredName = "base" } = {}) {
  const isolation = offer.isolation || null;
  const kinds = isolation ? isolation.kinds || ["hold"] : null;
  const group = uid("run");
  // A host whose agent said it runs no containers gets no template or image (placement would refuse them).
  const runsContainers = !kinds || kinds.includes("container");
  const choice = (label, value, checked, disabled = false) => field({ label, name: group, type: "radio", value, checked, disabled });
  const useTemplate = choice("A template", "template", runsContainers, !runsContainers);
  const useImage = choice("Custom image", "image", false, !runsContainers);
  const useProcess = choice("A command on the host (no image)", "process", false);
  const useHold = choice("Hold only (reserve GPUs, run nothing)", "hold", !runsContainers);
  const showProcess = !containersOnly && (!kinds || kinds.includes("process"));

  // Templates: radio cards, "base" chosen once they load.
  const templateName = uid("template");
  const cards = h("div", { class: "template-cards", role: "radiogroup", "aria-label": "Templates" }, h("p", { class: "loading" }, "Loading templates…"));
  const templateError = h("p", { class: "field-error", id: uid("error"), hidden: true });
  const templateBox = h("div", { class: "run-part", "data-part": "template" }, cards, templateError);
  let templates = [];
  // Settles once the templates are shown (or could not be): a Review pressed before then waits for it, so the default
  // template is chosen rather than refused as "no template chosen" (seen on a loaded machine).
  const ready = loadTemplates().then((list) => {
    templates = list;
    if (list.length === 0) {
      replace(cards, h("p", { class: "hint" }, "No templates yet: choose a custom image."));
      return;
    }
    const preferred = list.some((t) => t.name === preferredName) ? preferredName : list[0].name;
    replace(cards, list.map((t) => {
      const id = uid("tpl");
      const input = h("input", { type: "radio", name: templateName, value: t.name, id, checked: t.name === preferred, "aria-describedby": `${id}-about` });
      input.addEventListener("change", sync);
      return h("div", { class: "template-card" }, input,
        h("label", { for: id }, h("span", { class: "template-name" }, t.name),
          h("span", { class: "template-about", id: `${id}-about` },
            t.description ? h("span", { class: "block" }, t.description) : null,
            h("code", { class: "block" }, t.image),
            h("span", { class: "hint block" }, t.ports && t.ports.length ? `Ports ${portsText(t.ports)}` : "No ports"))));
    }));
    sync();
  }).catch((error) => {
    if (error && error.status === 401) return;
    replace(cards, h("p", { class: "field-error" }, `The templates could not be loaded (${error.message}). Choose a custom image or hold.`));
  });

  // A custom image.
  const image = withError(field({ label: "Image", name: "image", placeholder: "e.g. ubuntu:24.04", spellcheck: "false", autocomplete: "off",
    autocapitalize: "none", hint: "[registry/]name[:tag], lower-case, e.g. ubuntu:24.04 or nvcr.io/nvidia/pytorch:24.05-py3. Without a registry it comes from Docker Hub." }));
  const command = withError(field({ label: "Command (optional)", name: "command", placeholder: "e.g. python3 -m http.server", spellcheck: "false", autocomplete: "off",
    autocapitalize: "none", hint: 'Replaces the image\'s entrypoint. Words split at spaces, nothing else (no quotes, no $VARS); for a word with spaces write a JSON list: ["bash", "-c", "echo hi"]. Empty: the image\'s own.' }));
  const args = withError(field({ label: "Arguments (optional)", name: "args", placeholder: "e.g. 8000", spellcheck: "false", autocomplete: "off",
    autocapitalize: "none", hint: "Replace the image's default arguments; written like the command. Empty: the image's own." }));
  const ports = withError(field({ label: "Ports (optional)", name: "ports", placeholder: "e.g. 8888, 6006", inputmode: "numeric", autocomplete: "off",
    hint: "TCP ports it serves, separated by commas, each 1 to 65535." }));
  const env = withError(field({ label: "Environment (optional)", name: "env", type: "textarea", rows: 3, placeholder: "HF_HOME=/workspace/hf", spellcheck: "false",
    autocomplete: "off", autocapitalize: "none", hint: "One NAME=value a line; the GPU variables are set for you." }));
  const shm = withError(field({ label: "Shared memory /dev/shm, MiB (optional)", name: "shm_mib", type: "number", min: 1, max: MAX_SHM_MIB, step: 1,
    inputmode: "numeric", hint: "PyTorch data loaders want a few GiB, e.g. 8192. Empty: the host's default." }));
  const policy = isolation ? policyText(isolation.image_policy) : null;
  const imageBox = h("div", { class: "run-part", "data-part": "image" }, image.row, command.row, args.row, ports.row, env.row, shm.row,
    policy ? h("p", { class: "hint" }, `This host allows ${policy.allowed}; largest image ${policy.largest}.`) : null);

  // A command on the host (the process kind), where the host runs those.
  const argv = withError(field({ label: "Command", name: "argv", placeholder: "python3 train.py --epochs 3", spellcheck: "false", autocomplete: "off",
    autocapitalize: "none", hint: "Words split at spaces, or a JSON list for words with spaces. It runs on the host under a user of its own." }));
  const processBox = h("div", { class: "run-part", "data-part": "process" }, argv.row);

  let note = null;
  if (!runsContainers) {
    note = h("p", { class: "warn-note", id: "run-host-note" },
      `This host runs no containers, so no template or image. ${isolation.reason ? `Its agent says: ${isolation.reason.replace(/\.$/, "")}. ` : ""}`
      + `Hold its GPUs${showProcess ? " or run a command on it" : ""}, or rent another host for a template or an image.`);
  } else if (isolation && !isolation.isolated) {
    note = h("p", { class: "warn-note", id: "run-host-note" }, "This host is not isolated: a workload runs as the agent's own user.");
  }

  const el = h("fieldset", { class: "run-choice" }, h("legend", {}, "What to run"), note,
    useTemplate.row, templateBox, useImage.row, imageBox, showProcess ? [useProcess.row, processBox] : null, containersOnly ? null : useHold.row);

  function sync() {
    templateBox.hidden = !useTemplate.input.checked;
    imageBox.hidden = !useImage.input.checked;
    processBox.hidden = !useProcess.input.checked;
  }
  for (const f of [useTemplate, useImage, useProcess, useHold]) f.input.addEventListener("change", sync);
  sync();

  const fields = { image, command, args, ports, env, shm_mib: shm, argv };

  function showTemplateError(message) {
    templateError.textContent = message;
    templateError.hidden = false;
  }

  function clear() {
    for (const f of Object.values(fields)) f.clear();
    templateError.hidden = true;
    templateError.textContent = "";
  }

  function read() {
    if (useHold.input.checked) return { workload: { kind: "hold" } };
    if (useTemplate.input.checked) {
      const chosen = cards.querySelector("input:checked");
      if (!chosen) throw fail("Choose a template, or a custom image.", "template");
      return { template: chosen.value };
    }
    if (useProcess.input.checked) {
      let words;
      try {
        words = parseWords(argv.input.value);
      } catch (error) {
        throw fail(error.message, "argv");
      }
      if (!words) throw fail("Enter the command to run, or choose another option.", "argv");
      return { workload: { kind: "process", argv: words } };
    }
    const ref = image.input.value.trim();
    const problem = imageProblem(ref);
    if (problem) throw fail(problem, "image");
    const workload = { kind: "container", image: ref };
    for (const [key, f] of [["command", command], ["args", args]]) {
      try {
        const words = parseWords(f.input.value);
        if (words) workload[key] = words;
      } catch (error) {
        throw fail(error.message, key);
      }
    }
    try {
      const list = parsePorts(ports.input.value);
      if (list.length) workload.ports = list;
    } catch (error) {
      throw fail(error.message, "ports");
    }
    try {
      const vars = parseEnv(env.input.value);
      if (Object.keys(vars).length) workload.env = vars;
    } catch (error) {
      throw fail(error.message, "env");
    }
    const shmText = shm.input.value.trim();
    if (shmText) {
      const n = Number(shmText);
      if (!Number.isInteger(n) || n < 1 || n > MAX_SHM_MIB) throw fail(`Enter /dev/shm in whole MiB from 1 to ${MAX_SHM_MIB}, or leave it empty.`, "shm_mib");
      workload.shm_mib = n;
    }
    return { workload };
  }

  /** Show an error next to its field: target is a field name ("ports", "template"). Returns whether it found one. */
  function showAt(target, message) {
    if (target === "template") {
      if (!useTemplate.input.checked) return false;
      showTemplateError(message);
      const chosen = cards.querySelector("input:checked") || cards.querySelector("input");
      if (chosen) chosen.focus();
      return true;
    }
    const f = fields[target];
    if (!f || f.row.closest("[hidden]")) return false;
    f.show(message);
    f.input.focus();
    return true;
  }

  /** An API error about the workload shown next to the field it names; false when it names none here. */
  function showApiError(error) {
    const problems = (error.details && error.details.problems) || [];
    for (const p of problems) {
      const parts = String(p.field || "").split(".");
      if (parts[0] === "template") return showAt("template", error.message);
      if (parts[0] !== "workload") continue;
      const name = parts.find((part) => part in fields);
      if (name && showAt(name, String(p.problem).replace(/^Value error, /, ""))) return true;
    }
    const code = error.code || "";
    if (code.includes("template")) return showAt("template", error.message);
    if (code.includes("image")) return showAt("image", error.message);
    if (code.includes("port")) return showAt("ports", error.message);
    return false;
  }

  return { el, ready, read, clear, showAt, showApiError, describe: (chosen) => describeRun(chosen, templates),
    templateOf: (name) => templates.find((t) => t.name === name) || null };
}
