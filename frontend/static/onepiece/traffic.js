// The Traffic view: accepted and rejected requests per second by reason, latency p50/p99 per workflow
// (/dashboard/api/traffic), drawn as inline SVG line charts; polled while shown.
import { esc, getJSON } from "./common.js";

export const TRAFFIC_POLL_MS = 5000;
const COLOURS = ["#2f6fdd", "#c4342d", "#e08a00", "#7b3fbf", "#1f8a4c", "#555"];

function lineChart(title, series, t0, step, unit) {
  const W = 520, H = 170, L = 44, B = 22, T = 18;
  const n = Math.max(1, ...series.map((s) => s.values.length));
  const top = Math.max(0, ...series.flatMap((s) => s.values.filter((v) => v != null)));
  const ymax = (top > 0 ? top : 1) * 1.1;  // an empty chart keeps a readable 0..1 axis
  const x = (i) => L + (W - L - 6) * (n === 1 ? 0.5 : i / (n - 1));
  const y = (v) => T + (H - T - B) * (1 - v / ymax);
  let body = `<text x="${L}" y="12" class="title">${esc(title)}</text>`;
  for (const f of [0, 0.5, 1]) {
    body += `<line x1="${L}" x2="${W - 6}" y1="${y(ymax * f / 1.1)}" y2="${y(ymax * f / 1.1)}" class="grid"/>` +
      `<text x="${L - 4}" y="${y(ymax * f / 1.1) + 4}" text-anchor="end">${(ymax * f / 1.1).toPrecision(2)}</text>`;
  }
  const tl = (i) => new Date((t0 + i * step) * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
  body += `<text x="${L}" y="${H - 4}">${tl(0)}</text><text x="${W - 6}" y="${H - 4}" text-anchor="end">${tl(n)}</text>`;
  let lx = L + 8;
  series.forEach((s, k) => {
    const colour = COLOURS[k % COLOURS.length];
    let d = "", pen = false;
    s.values.forEach((v, i) => {
      if (v == null) { pen = false; return; }
      d += `${pen ? "L" : "M"}${x(i).toFixed(1)},${y(v).toFixed(1)}`; pen = true;
    });
    body += `<path d="${d}" stroke="${colour}" fill="none" stroke-width="1.6" data-series="${esc(s.name)}"/>`;
    body += `<text x="${lx}" y="${T + 10}" style="fill:${colour}">${esc(s.name)}</text>`;
    lx += 12 + 5.6 * String(s.name).length;  // legend entries side by side, spaced by their length
  });
  return `<svg class="chart" viewBox="0 0 ${W} ${H}" width="${W}" height="${H}" role="img" aria-label="${esc(title)}">${body}</svg>` +
    `<span class="sr-only">${esc(unit)}</span>`;
}

function renderTraffic(t) {
  const box = document.getElementById("traffic");
  box.innerHTML = Object.entries(t.workflows).map(([wf, w]) => {
    const rejected = Object.entries(w.rejected_rps).map(([why, v]) => ({ name: `rejected: ${why}`, values: v }));
    const tot = w.totals;
    return `<article class="workflow traffic" data-workflow="${esc(wf)}"><h3>${esc(wf)} <small>` +
      `accepted ${tot.accepted} · completed ${tot.completed} · rejected ${tot.rejected}</small></h3><div class="charts">` +
      lineChart("requests/s", [{ name: "accepted", values: w.accepted_rps }, ...rejected], t.start, t.step_s, "requests per second") +
      lineChart("latency (s)", [{ name: "p50", values: w.latency_p50_s }, { name: "p99", values: w.latency_p99_s }],
        t.start, t.step_s, "seconds") + "</div></article>";
  }).join("") || '<p class="empty">No workflow.</p>';
}

export async function refreshTraffic() {
  try {
    const minutes = document.getElementById("traffic-minutes").value;
    renderTraffic(await getJSON(`/dashboard/api/traffic?minutes=${minutes}&step=${Math.max(5, +minutes)}`));
  } catch (e) { /* the next poll tries again */ }
}
document.getElementById("traffic-minutes").addEventListener("change", refreshTraffic);
