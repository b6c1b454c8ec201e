// A cluster's private network in words, for the cluster page (pages-clusters.js). No imports: the same rules as
// `gpumarket cluster show` (gpumarket/renter/clusters.py network_summary), checked against it in Node by
// tests/test_cluster_network_words.py.

const NETWORK_STEPS = { pending: "not made yet", creating: "being made", connecting: "connecting the nodes",
  measuring: "measuring between nodes", deleted: "taken down" };

/** One line on the cluster's private network (as `gpumarket cluster show` says it): its state, and once up the
 * worst round trip and the slowest throughput between two nodes. */
export function networkSummary(network) {
  if (!network) return "not made yet";
  const { state, reason } = network;
  if (state === "up") {
    const all = network.pairs || [];
    const pairs = all.filter((p) => !p.error);
    const rtts = pairs.map((p) => p.rtt_ms).filter((v) => v !== null && v !== undefined);
    const rates = pairs.map((p) => p.mbit_s).filter((v) => v !== null && v !== undefined);
    const figures = [
      rtts.length ? `worst round trip ${Math.max(...rtts)} ms` : "",
      rates.length ? `slowest ${Math.min(...rates)} Mbit/s` : "",
      all.length > pairs.length ? `${all.length - pairs.length} pair(s) unreachable` : "",
    ].filter(Boolean);
    return `up on ${network.subnet}` + (figures.length ? `: ${figures.join(", ")}` : "");
  }
  if (state === "failed" || state === "none") return reason ? `${state}: ${reason}` : state;
  return NETWORK_STEPS[state] || String(state);
}
