// Live GPU telemetry of one host: the Server-Sent Events stream
// GET /api/v1/hosts/{id}/metrics/stream (events named "sample", each one raw telemetry item
// like those of GET /hosts/{id}/metrics?resolution=raw: {seq, sampled_at, gpus: [...]}).
// It replays recent samples first, then pushes new ones. Where the stream cannot be opened
// the feed falls back to polling the raw metrics every few seconds.

import { API, acting, api } from "./api.js";
import { LineChart } from "./charts.js";
import { h } from "./dom.js";

const KEEP = 180; // samples kept per host page (30 minutes at the default 10 s)
const POLL_MS = 5000;

export class TelemetryFeed {
  constructor(hostId, onChange, onStatus = () => {}) {
    this.hostId = hostId;
    this.onChange = onChange;
    this.onStatus = onStatus;
    this.samples = new Map(); // seq → sample
    this.closed = false;
    this.source = null;
    this.timer = null;
    this.frame = null;
    this.open();
  }

  open() {
    // An EventSource sends no headers: the team a console acts for goes in the query instead.
    const team = acting.team ? `?team=${encodeURIComponent(acting.team.id)}` : "";
    const url = `${API}/hosts/${encodeURIComponent(this.hostId)}/metrics/stream${team}`;
    let source;
    try {
      source = new EventSource(url, { withCredentials: true });
    } catch {
      this.poll();
      return;
    }
    this.source = source;
    this.onStatus("connecting");
    source.addEventListener("open", () => this.onStatus("live"));
    source.addEventListener("sample", (event) => {
      try {
        this.add([JSON.parse(event.data)]);
        this.onStatus("live");
      } catch {
        /* a malformed event is skipped */
      }
    });
    source.addEventListener("error", () => {
      if (this.closed) return;
      if (source.readyState === EventSource.CLOSED) {
        // Refused (not found, not signed in) or not served: poll instead, which also
        // reports a lost session through the API's 401 handling.
        this.source = null;
        this.poll();
      } else {
        this.onStatus("reconnecting");
      }
    });
  }

  async poll() {
    if (this.closed) return;
    this.onStatus("polling");
    try {
      const body = await api("GET", `/hosts/${encodeURIComponent(this.hostId)}/metrics?resolution=raw&limit=${KEEP}`);
      this.add(body.items || []);
    } catch (error) {
      if (error && error.status === 401) return; // the app shows the sign-in page
      this.onStatus("error");
    }
    if (!this.closed) this.timer = setTimeout(() => this.poll(), POLL_MS);
  }

  add(items) {
    for (const item of items) {
      if (item && Array.isArray(item.gpus)) this.samples.set(`${item.seq}|${item.sampled_at}`, item);
    }
    if (this.samples.size > KEEP) {
      const sorted = this.sorted();
      for (const old of sorted.slice(0, sorted.length - KEEP)) this.samples.delete(`${old.seq}|${old.sampled_at}`);
    }
    if (this.frame === null) {
      this.frame = requestAnimationFrame(() => {
        this.frame = null;
        if (!this.closed) this.onChange(this.sorted());
      });
    }
  }

  sorted() {
    return [...this.samples.values()].sort((a, b) => Date.parse(a.sampled_at) - Date.parse(b.sampled_at) || a.seq - b.seq);
  }

  close() {
    this.closed = true;
    if (this.source) this.source.close();
    if (this.timer) clearTimeout(this.timer);
    if (this.frame !== null) cancelAnimationFrame(this.frame);
  }
}

const METRICS = [
  { key: "gpu_util_pct", title: "Utilization", unit: "%", yMax: 100, digits: 0 },
  { key: "memory_used_mib", title: "Memory used", unit: "GiB", scale: 1 / 1024, digits: 1 },
  { key: "temperature_c", title: "Temperature", unit: "°C", yMax: 90, digits: 0 },
  { key: "power_draw_w", title: "Power", unit: "W", digits: 0 },
];

/** The samples taken in [start, end] (ISO times; a null bound is open). */
export function insideWindow(samples, { start = null, end = null } = {}) {
  const from = start ? Date.parse(start) : -Infinity;
  const until = end ? Date.parse(end) : Infinity;
  return samples.filter((sample) => {
    const at = Date.parse(sample.sampled_at);
    return at >= from && at <= until;
  });
}

const STATUS_TEXT = {
  connecting: "Connecting to the live stream…",
  live: "Live: new samples appear as the host reports them.",
  reconnecting: "The live stream dropped; reconnecting…",
  polling: "Updating every few seconds.",
  error: "Telemetry could not be loaded; retrying.",
};

/**
 * Live charts (utilization, memory, temperature, power) of a host's GPUs, or only of the
 * GPUs whose UUIDs are given (a rental's), and only samples inside window() ({start, end}: ISO
 * times or null, read at each redraw: a rental's own time). Returns {el, close}.
 */
export function gpuCharts(hostId, { uuids = null, heading = "Live GPU telemetry", window = null } = {}) {
  const wanted = uuids ? new Set(uuids) : null;
  const charts = METRICS.map((m) => ({ metric: m, chart: new LineChart({ title: m.title, unit: m.unit, yMax: m.yMax ?? null, digits: m.digits }) }));
  const status = h("p", { class: "hint telemetry-status" }, STATUS_TEXT.connecting);
  const latest = h("p", { class: "hint" });
  const el = h("section", { class: "telemetry", "aria-label": heading },
    h("h2", {}, heading), status, h("div", { class: "chart-grid" }, charts.map((c) => c.chart.el)), latest);

  const render = (all) => {
    const samples = window ? insideWindow(all, window()) : all;
    const names = new Map(); // uuid → label
    for (const sample of samples) {
      for (const gpu of sample.gpus) {
        if (wanted && !wanted.has(gpu.uuid)) continue;
        if (!names.has(gpu.uuid)) names.set(gpu.uuid, `GPU ${gpu.index ?? names.size}`);
      }
    }
    const order = [...names.keys()].sort((a, b) => names.get(a).localeCompare(names.get(b), undefined, { numeric: true }));
    for (const { metric, chart } of charts) {
      chart.update(order.map((uuid) => ({
        name: names.get(uuid),
        points: samples.map((sample) => {
          const gpu = sample.gpus.find((g) => g.uuid === uuid);
          const raw = gpu ? gpu[metric.key] : null;
          const value = raw === null || raw === undefined ? null : Number(raw) * (metric.scale ?? 1);
          return [Date.parse(sample.sampled_at), Number.isFinite(value) ? value : null];
        }),
      })));
    }
    const last = samples[samples.length - 1];
    latest.textContent = last ? `Latest sample #${last.seq} at ${new Date(last.sampled_at).toLocaleTimeString()} · ${samples.length} samples shown.` : "";
  };
  const feed = new TelemetryFeed(hostId, render, (state) => {
    status.textContent = STATUS_TEXT[state] || "";
  });
  return { el, close: () => feed.close() };
}
