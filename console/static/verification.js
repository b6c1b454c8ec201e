// What the GPU challenge proved (issue 40, docs/verification.md): the "verified" badge on offers and in the rent
// dialog, and each GPU's measured vs expected throughput on the host page (a bar, and the words), with what a
// provider does about a failure.

import { h, num, table, timeEl } from "./dom.js";

// What each failure means and what the provider does next (the reason codes of shared/verification/protocol.py).
const ADVICE = {
  wrong_result: "The GPU returned a wrong product. Look for memory errors (nvidia-smi -q -d ECC) and replace a faulty card; the platform challenges it again while it is idle.",
  bad_proof: "The host's proofs did not match what it committed to. Update the agent and restart it (sudo systemctl restart gpumarket-agent); the next challenge runs while it is idle.",
  too_slow: "The GPU finished after the deadline its model allows. Stop anything else using it and check it is not throttled (nvidia-smi -q -d PERFORMANCE).",
  memory_short: "The GPU could not hold a product sized for the memory it claims: it is a smaller card than reported, or other processes hold its memory (nvidia-smi).",
  replayed_commitment: "The host answered with a commitment from another challenge. Update the agent; the next challenge runs while it is idle.",
  no_answer: "Nothing came back before the deadline. Check the agent is running and connected (sudo systemctl status gpumarket-agent).",
  workload_failed: "The challenge's container did not start or did not see its GPU. Check the container engine and the NVIDIA container toolkit (sudo systemctl status docker).",
};

/** Measured vs expected TFLOP/s as a bar (a <meter>) and the words beside it; "—" when nothing was measured. */
export function throughputBar(measured, expected, label) {
  if (measured === null || measured === undefined) return "—";
  const words = expected ? `${num(measured, 0)} of ${num(expected, 0)} TFLOP/s expected (${num((measured / expected) * 100, 0)} %)`
    : `${num(measured, 0)} TFLOP/s`;
  if (!expected) return words;
  const top = Math.max(measured, expected) * 1.1;
  return h("span", { class: "proof-bar" },
    h("meter", { min: 0, max: top, value: measured, low: expected * 0.8, high: expected, optimum: top, "aria-label": `${label}: ${words}` }),
    h("span", { class: "proof-words" }, words));
}

/** The offer's badge: "verified" (proven by the GPU challenge), with the figures in its title; null otherwise. */
export function verifiedBadge(offer) {
  if (!offer.verified) return null;
  const v = offer.verification || {};
  const figures = v.tflops_median !== null && v.tflops_median !== undefined
    ? `: ${num(v.tflops_median, 0)} TFLOP/s measured (median${v.tflops_expected ? `; ${num(v.tflops_expected, 0)} expected` : ""})` : "";
  return h("span", { class: "badge verified-yes", dataset: { verified: "true" },
    title: `Every GPU of this host passed the platform's GPU challenge in the last 7 days${figures}.` }, "✓ verified");
}

/** The rent dialog's line on the offer's proof. */
export function verificationFact(offer) {
  const v = offer.verification || {};
  if (!offer.verified) {
    return v.gpus_failed ? "Not verified: a GPU failed the platform's GPU challenge." : "Not verified by the platform's GPU challenge yet.";
  }
  return h("span", { class: "proof-fact" }, verifiedBadge(offer), " ",
    throughputBar(v.tflops_median, v.tflops_expected, "Measured throughput"), " ",
    h("span", { class: "hint" }, "checked ", timeEl(v.verified_at)));
}

function outcomeBadge(proof) {
  if (!proof || !proof.outcome) return h("span", { class: "badge verified-never" }, "not challenged yet");
  if (proof.outcome === "failed") return h("span", { class: "badge verified-failed" }, "failed");
  return proof.fresh ? h("span", { class: "badge verified-yes" }, "✓ passed") : h("span", { class: "badge verified-stale" }, "passed, stale");
}

/** The host page's section: what each GPU proved, and for its provider (or an admin) why one failed and what to do. */
export function proofSection(host, role) {
  const gpus = host.gpus || [];
  const operator = role === "provider" || role === "admin";
  const failed = gpus.filter((g) => g.verification && g.verification.outcome === "failed");
  const rows = gpus.map((g) => {
    const p = g.verification || {};
    return [String(g.index), outcomeBadge(p), throughputBar(p.tflops, p.tflops_expected, `GPU ${g.index} throughput`),
      p.vram_mib ? `${num(p.vram_mib / 1024, 0)} GiB` : "—", timeEl(p.verified_at)];
  });
  return h("div", { class: "host-proof" },
    h("p", {}, host.verified ? "Every GPU passed the platform's GPU challenge in the last 7 days: its offers show ✓ verified."
      : "Not verified: a GPU has not passed the platform's GPU challenge in the last 7 days."),
    table({ caption: "What the GPU challenge proved", columns: ["GPU", "Outcome", "Throughput, measured vs expected", "Memory proven", "Checked"],
      rows, empty: "No GPUs reported yet.", className: "proofs" }),
    operator ? failed.map((g) => h("div", { class: "proof-failure", role: "note" },
      h("p", {}, h("strong", {}, `GPU ${g.index} failed: ${g.verification.reason || "no reason given"}`),
        g.verification.failures_in_a_row > 1 ? ` (${g.verification.failures_in_a_row} times in a row)` : "",
        ". Its host is not listed until it passes."),
      h("p", {}, ADVICE[g.verification.reason] || "Ask the platform's admins what the reason means."))) : null);
}
