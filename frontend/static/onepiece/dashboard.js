// OnePiece operator dashboard: plain JS modules, no library, nothing fetched from outside this site.
// This module switches the views and keeps the websocket: live state arrives over /ws/cluster (session
// auth); jobs, traffic, a job's detail and the audit list come from /dashboard/api/*, re-fetched after
// every reconnect because pushes missed while away are gone. One module per view: cluster.js,
// traffic.js, jobs.js, actions.js; common.js holds what they share.
// Lists are built as one HTML string (escaped) and set in one go: 1,000 job rows or 50 devices cost
// one parse and one layout, not thousands of DOM insertions.
import { fillActionChoices, refreshActions } from "./actions.js";
import { renderCluster } from "./cluster.js";
import { JOBS_IDLE_POLL_MS, JOBS_POLL_MS, refreshJobs, renderCounts } from "./jobs.js";
import { TRAFFIC_POLL_MS, refreshTraffic } from "./traffic.js";

let current = "cluster";
function show(view) {
  current = view;
  for (const s of document.querySelectorAll(".view")) s.hidden = s.id !== `view-${view}`;
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.view === view);
  if (view === "traffic") refreshTraffic();
  if (view === "jobs") refreshJobs();
}
window.addEventListener("hashchange", () => show(location.hash.slice(1) || "cluster"));

function onCluster(snap) {
  renderCluster(snap);
  fillActionChoices(snap);
  renderCounts(snap.jobs);
}

// -- the websocket, with reconnect ------------------------------------------------------------------
const conn = document.getElementById("conn");
let backoff = 500;
function refusedAs(text) {
  conn.textContent = text; conn.className = "conn down"; conn.dataset.state = "refused";
}
function connect() {
  const ws = new WebSocket(`${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/ws/cluster`);
  let opened = false;
  ws.onopen = () => {
    opened = true;
    backoff = 500;
    conn.textContent = "live"; conn.className = "conn up"; conn.dataset.state = "live";
    refreshJobs(); refreshActions();  // resync what changed while the socket was down
    if (current === "traffic") refreshTraffic();
  };
  ws.onmessage = (ev) => {
    const msg = JSON.parse(ev.data);
    if (msg.type === "cluster") onCluster(msg.cluster);
  };
  ws.onclose = async (ev) => {
    // A refusal during the handshake reaches a browser only as 1006, like a dead server: ask over
    // HTTP whether the session is still staff's before retrying (logged out: retrying cannot help).
    if (ev.code === 4401 || ev.code === 4403) { refusedAs("refused (log in as staff)"); return; }
    if (!opened) {
      const r = await fetch("/dashboard/api/jobs?limit=1", { credentials: "same-origin" }).catch(() => null);
      if (r && r.status === 403) { refusedAs("session ended (log in as staff)"); return; }
    }
    conn.textContent = `reconnecting in ${backoff / 1000}s`;
    conn.className = "conn down"; conn.dataset.state = "reconnecting";
    setTimeout(connect, backoff);
    backoff = Math.min(backoff * 2, 15000);
  };
}
show(location.hash.slice(1) || "cluster");
connect();
let lastJobsPoll = 0;
setInterval(() => {
  const due = current === "jobs" ? JOBS_POLL_MS : JOBS_IDLE_POLL_MS;
  if (performance.now() - lastJobsPoll >= due - 50) { lastJobsPoll = performance.now(); refreshJobs(); }
}, JOBS_POLL_MS);
setInterval(() => { if (current === "traffic") refreshTraffic(); }, TRAFFIC_POLL_MS);
