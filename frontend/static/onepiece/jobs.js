// The Jobs view: the 1,000 newest jobs (/dashboard/api/jobs), polled; a click opens a job's detail
// (/dashboard/api/jobs/<uid>): a Gantt bar per stage, the engine's ETA while it is unfinished, and the
// result in <img> or <video controls>.
import { el, esc, getJSON, timed } from "./common.js";
import { showEta } from "./eta.js";

export const JOBS_POLL_MS = 1000;  // the jobs list has no push channel of its own: polled while shown
export const JOBS_IDLE_POLL_MS = 5000;  // ...and slower behind another view (its counts stay fresh)
let openJob = null;  // uid shown in the detail panel

function renderJobs(list, total) {
  timed("jobs", () => {
    document.querySelector("#jobs-table tbody").innerHTML = list.map((j) =>
      `<tr data-uid="${esc(j.uid)}" class="${j.uid === openJob ? "open" : ""}"><td class="mono">${esc(j.uid)}</td>` +
      `<td>${esc(j.owner)}</td><td>${esc(j.workflow)}</td><td class="state ${esc(j.state)}">${esc(j.state)}</td>` +
      `<td><progress max="100" value="${+j.progress || 0}"></progress> ${+j.progress || 0}%</td>` +
      `<td>${esc(j.stage || "–")}</td><td class="queue">${esc(j.queue_position ?? "–")}</td>` +
      `<td>${esc(new Date(j.created_at).toLocaleString())}</td></tr>`).join("");
    document.getElementById("jobs-shown").textContent =
      list.length < total ? `(newest ${list.length} of ${total})` : `(${total})`;
  });
  window.__jobsRendered = performance.now();
}

export async function refreshJobs() {
  try {
    const { jobs, total } = await getJSON("/dashboard/api/jobs");
    renderJobs(jobs, total);
    if (openJob) refreshDetail();
  } catch (e) { /* shown as stale; the next poll or reconnect tries again */ }
}

/** The job counts by state that come with every cluster snapshot. */
export function renderCounts(counts) {
  document.getElementById("jobs-counts").textContent =
    Object.entries(counts || {}).map(([k, v]) => `${k}: ${v}`).join(" · ");
}

// A job's timeline: one bar per stage from its stage_started to its stage_finished event.
function gantt(job) {
  const t0 = job.created_ts;
  const now = Date.now() / 1000;
  const end = Math.max(job.finished_at || 0, ...job.stages.map((s) => s.finished || s.started || 0),
    job.finished_at ? 0 : now) || now;
  const span = Math.max(1e-3, end - t0);
  const W = 580, L = 110, R = 90, row = 22, H = 26 + row * (job.stages.length + 1);
  const x = (t) => L + (W - L - R) * ((t - t0) / span);
  let body = `<text x="4" y="14" class="title">0 s</text><text x="${W - R}" y="14" text-anchor="end" class="title">${span.toFixed(2)} s</text>`;
  const first = job.stages.map((s) => s.started).filter(Boolean).sort((a, b) => a - b)[0];
  const rows = [{ stage: "waiting", started: t0, finished: first || (job.finished_at || now), wait: true }, ...job.stages];
  rows.forEach((s, i) => {
    const y = 22 + i * row;
    body += `<text x="4" y="${y + 14}">${esc(s.stage)}</text>`;
    if (!s.started) { body += `<text x="${L}" y="${y + 14}" class="muted">not started</text>`; return; }
    // No finish event: still running, or (a finished job) the stage ended with the job: the last
    // stage reports the job's end, not a stage_finished of its own.
    const running = !s.finished && !job.finished_at;
    const fin = s.finished || (job.finished_at || now);
    const w = Math.max(2, x(fin) - x(s.started));
    body += `<rect data-stage="${esc(s.stage)}" class="${s.wait ? "wait" : running ? "running" : "done"}" x="${x(s.started).toFixed(1)}" y="${y + 3}" width="${w.toFixed(1)}" height="${row - 8}" rx="2"/>` +
      `<text x="${(x(s.started) + w + 4).toFixed(1)}" y="${y + 14}">${(fin - s.started).toFixed(3)} s${running ? " (running)" : ""}</text>`;
  });
  return `<svg class="gantt" viewBox="0 0 ${W} ${H}" width="${W}" height="${H}" role="img" aria-label="stage timeline">${body}</svg>`;
}

function renderDetail(job) {
  document.getElementById("job-detail-uid").textContent = job.uid;
  document.getElementById("job-detail-summary").innerHTML =
    `${esc(job.workflow)} · owner ${esc(job.owner)} · <span class="state ${esc(job.state)}">${esc(job.state)}</span> · ` +
    `${+job.progress}%${job.stage ? ` · stage ${esc(job.stage)}` : ""}${job.detail ? ` · ${esc(job.detail)}` : ""}` +
    `${job.cost_measured_gpu_s != null ? ` · ${(+job.cost_measured_gpu_s).toFixed(3)} GPU·s measured` : ""}`;
  showEta(document.getElementById("job-eta"), job.eta);  // refreshed with the panel (polled)
  document.getElementById("job-gantt").innerHTML = gantt(job);
  renderPreview(job.preview);
  const box = document.getElementById("job-result");
  const src = job.result && job.result.url;
  const shown = box.querySelector("[data-src]");
  if (!src) { box.innerHTML = `<p class="muted">${job.state === "completed" ? "" : "No result yet."}</p>`; return; }
  if (shown && shown.dataset.src === src) return;  // keep a playing video playing across refreshes
  box.replaceChildren(job.result.kind === "video"
    ? el("video", { controls: "", src, "data-src": src, preload: "metadata" })
    : el("img", { src, "data-src": src, alt: `result of ${job.uid}` }));
}

// The job's latest live preview (a job submitted with preview_every), refreshed with the panel while it runs.
function renderPreview(preview) {
  const box = document.getElementById("job-preview");
  if (!preview) { box.hidden = true; return; }
  box.hidden = false;
  const img = document.getElementById("job-preview-img");
  const src = `${preview.url}?step=${encodeURIComponent(preview.step)}`;
  if (img.getAttribute("src") !== src) img.setAttribute("src", src);
  img.dataset.step = String(preview.step);
  document.getElementById("job-preview-step").textContent =
    `live preview after step ${+preview.step} of ${+preview.total} (${preview.stage})`;
}

async function refreshDetail() {
  const uid = openJob;
  try {
    const { job } = await getJSON(`/dashboard/api/jobs/${encodeURIComponent(uid)}`);
    if (uid === openJob) renderDetail(job);
  } catch (e) { document.getElementById("job-detail-summary").textContent = `Could not load: ${e.message}`; }
}

function openDetail(uid) {
  openJob = uid;
  document.getElementById("job-detail").hidden = false;
  document.getElementById("job-result").replaceChildren();
  for (const r of document.querySelectorAll("#jobs-table tr.open")) r.classList.remove("open");
  document.querySelector(`#jobs-table tr[data-uid="${CSS.escape(uid)}"]`)?.classList.add("open");
  refreshDetail();
}

document.querySelector("#jobs-table tbody").addEventListener("click", (ev) => {
  const row = ev.target.closest("tr[data-uid]");
  if (row) openDetail(row.dataset.uid);
});
document.getElementById("job-detail-close").addEventListener("click", () => {
  openJob = null; document.getElementById("job-detail").hidden = true;
});
