// The page for one of your own jobs (/jobs/<uid>/watch): its state and live previews over the job's
// websocket (/ws/jobs/<uid>: "job" updates, each unfinished one followed by an "eta" message with the
// engine's estimate, and "preview" messages in step order), then its result.
import { showEta } from "./eta.js";

const TERMINAL = ["completed", "failed", "cancelled", "expired"];
const root = document.getElementById("watch");
const uid = root.dataset.uid;
const kind = root.dataset.kind;

function showState(job) {
  const p = document.getElementById("watch-state");
  p.textContent = "";
  const st = document.createElement("span");
  st.className = `state ${job.state}`;
  st.textContent = job.state;
  p.append(`${job.workflow} · `, st, ` · ${+job.progress}%${job.stage ? ` · ${job.stage}` : ""}`);
  if (TERMINAL.includes(job.state)) showEta(document.getElementById("watch-eta"), null);  // done: no ETA
  if (job.state === "completed") showResult();
}

function showPreview(preview) {
  document.getElementById("watch-preview").hidden = false;
  const img = document.getElementById("watch-preview-img");
  img.src = preview.image;
  img.dataset.step = String(preview.step);
  document.getElementById("watch-preview-step").textContent =
    `preview after step ${preview.step} of ${preview.total} (${preview.stage})`;
}

function showResult() {
  const box = document.getElementById("watch-result");
  if (box.firstChild) return;
  const src = `/api/v1/jobs/${encodeURIComponent(uid)}/result`;
  const media = document.createElement(kind === "video" ? "video" : "img");
  media.src = src;
  if (kind === "video") media.controls = true; else media.alt = `result of ${uid}`;
  box.append(media);
}

function connect() {
  const ws = new WebSocket(`${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/ws/jobs/${encodeURIComponent(uid)}`);
  ws.onmessage = (ev) => {
    const msg = JSON.parse(ev.data);
    if (msg.type === "job") showState(msg.job);
    else if (msg.type === "eta") showEta(document.getElementById("watch-eta"), msg);
    else if (msg.type === "preview") showPreview(msg.preview);
  };
  ws.onclose = (ev) => { if (ev.code !== 4404 && ev.code !== 4401) setTimeout(connect, 2000); };
}
connect();
