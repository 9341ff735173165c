// OnePiece operator dashboard: plain JS, no library, nothing fetched from outside this site.
// Live state arrives over /ws/cluster (session auth); jobs and the audit list come from
// /dashboard/api/*, re-fetched after every reconnect because pushes missed while away are gone.
"use strict";

(function () {
  const STAGES = JSON.parse(document.getElementById("workflow-stages").textContent);
  const CSRF = document.querySelector('meta[name="csrf-token"]').content;
  const JOBS_POLL_MS = 2000;  // the jobs list has no push channel of its own yet
  let lastCluster = null;

  // -- small DOM helpers (textContent only: node and job fields come from outside) ----------------
  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") e.className = v; else if (k === "text") e.textContent = v; else e.setAttribute(k, v);
    }
    for (const c of children) if (c != null) e.append(c);
    return e;
  }
  const pct = (x) => (x == null ? "–" : `${Math.round(x)}%`);
  const gib = (b) => (b == null ? "–" : `${(b / 2 ** 30).toFixed(1)} GiB`);
  const secs = (s) => (s ? `${s.toFixed(3)} s` : "–");

  // -- views ------------------------------------------------------------------------------------------
  function show(view) {
    for (const s of document.querySelectorAll(".view")) s.hidden = s.id !== `view-${view}`;
    for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.view === view);
  }
  window.addEventListener("hashchange", () => show(location.hash.slice(1) || "cluster"));
  show(location.hash.slice(1) || "cluster");

  // -- cluster ----------------------------------------------------------------------------------------
  function deviceRows(node) {
    const devices = node.devices || [];
    if (!devices.length) return [el("p", { class: "muted", text: "no device telemetry reported" })];
    return devices.map((d) => {
      const cpu = d.kind !== "gpu";
      // Never show CPU load as if it were a GPU's: say so on the row itself.
      return el("div", { class: `device ${cpu ? "cpu" : "gpu"}` },
        el("span", { class: "dev-name", text: `${d.kind.toUpperCase()} ${d.index}: ${d.name}` }),
        cpu ? el("span", { class: "badge", text: "CPU figures (no GPU)" }) : null,
        el("span", { text: `util ${pct(d.utilisation)}` }),
        el("span", { text: `mem ${gib(d.memory_used)} / ${gib(d.memory_total)}` }));
    });
  }

  function renderNodes(nodes) {
    const box = document.getElementById("nodes");
    const names = Object.keys(nodes).sort();
    if (!names.length) { box.replaceChildren(el("p", { class: "empty", text: "No node has registered." })); return; }
    box.replaceChildren(...names.map((name) => {
      const n = nodes[name] || {};
      const inst = n.instances || {};
      const rows = Object.keys(inst).sort().map((id) => {
        const i = inst[id];
        return el("tr", { "data-instance": id },
          el("td", { text: id }), el("td", { text: i.stage }),
          el("td", { text: pct(i.utilisation == null ? null : i.utilisation * 100) }),
          el("td", { text: secs(i.last_stage_s) }), el("td", { text: String(i.requests ?? "–") }),
          el("td", { text: i.ready === false ? "starting" : "ready" }));
      });
      return el("article", { class: "node", "data-node": name },
        el("h3", { text: name }),
        ...deviceRows(n),
        el("table", { class: "instances" },
          el("thead", {}, el("tr", {}, ...["instance", "stage", "util", "last stage", "requests", "state"]
            .map((h) => el("th", { text: h })))),
          el("tbody", {}, ...rows)));
    }));
  }

  // Per stage: instances across nodes and their mean measured service time. Throughput is
  // instances / service time; the bottleneck is the stage with the largest service time per instance.
  function stageStats(nodes, wf) {
    const out = {};
    for (const stage of STAGES[wf] || []) out[stage] = { instances: 0, times: [] };
    for (const n of Object.values(nodes)) {
      for (const i of Object.values(n.instances || {})) {
        if (i.workflow !== wf) continue;
        const s = (out[i.stage] ||= { instances: 0, times: [] });
        s.instances += 1;
        if (i.last_stage_s > 0) s.times.push(i.last_stage_s);
      }
    }
    let worst = null, worstLoad = -1;
    const deployed = Object.values(out).some((s) => s.instances > 0);
    for (const [stage, s] of Object.entries(out)) {
      s.service = s.times.length ? s.times.reduce((a, b) => a + b, 0) / s.times.length : null;
      s.throughput = s.service && s.instances ? s.instances / s.service : null;
      // A stage with no instance at all starves the chain: it is the bottleneck before any slow one.
      const load = s.instances ? (s.service || 0) / s.instances : Infinity;
      if (load > worstLoad) { worst = stage; worstLoad = load; }
    }
    // A workflow with no instance anywhere is not deployed, which is not the same as a bottleneck.
    return { stats: out, deployed, bottleneck: deployed && worstLoad > 0 ? worst : null };
  }

  function renderWorkflows(snap) {
    const nodes = snap.nodes || {};
    const box = document.getElementById("workflows");
    box.replaceChildren(...Object.keys(STAGES).map((wf) => {
      const { stats, deployed, bottleneck } = stageStats(nodes, wf);
      const inflight = (snap.inflight || {})[wf] || {};
      return el("article", { class: "workflow", "data-workflow": wf },
        el("h3", {}, wf, el("small", { text: ` in flight: ${inflight.jobs ?? 0} jobs, ${inflight.gpu_s ?? 0} GPU·s` }),
          deployed ? null : el("span", { class: "badge", text: "no instances" })),
        el("div", { class: "chain" }, ...Object.entries(stats).map(([stage, s]) =>
          el("div", { class: `stage${stage === bottleneck ? " bottleneck" : ""}`, "data-stage": stage },
            el("strong", { text: stage }),
            el("span", { class: "count", text: `${s.instances} instance${s.instances === 1 ? "" : "s"}` }),
            el("span", { text: `service ${secs(s.service)}` }),
            el("span", { text: `throughput ${s.throughput ? s.throughput.toFixed(2) + "/s" : "–"}` }),
            stage === bottleneck ? el("span", { class: "badge", text: "bottleneck" }) : null))));
    }));
  }

  function renderCluster(snap) {
    lastCluster = snap;
    document.getElementById("snapshot-ts").textContent = snap.ts ? new Date(snap.ts * 1000).toLocaleTimeString() : "–";
    document.getElementById("cluster-error").textContent = snap.error || "";
    renderNodes(snap.nodes || {});
    renderWorkflows(snap);
    fillActionChoices();
    const counts = snap.jobs || {};
    document.getElementById("jobs-counts").textContent =
      Object.entries(counts).map(([k, v]) => `${k}: ${v}`).join(" · ");
  }

  // -- jobs and actions (REST) -----------------------------------------------------------------------
  async function getJSON(url, opts) {
    const r = await fetch(url, { credentials: "same-origin", ...opts });
    const body = await r.json().catch(() => ({}));
    if (!r.ok) throw new Error(body.error || `${r.status} ${r.statusText}`);
    return body;
  }

  async function refreshJobs() {
    try {
      const { jobs } = await getJSON("/dashboard/api/jobs");
      document.querySelector("#jobs-table tbody").replaceChildren(...jobs.map((j) => el("tr", { "data-uid": j.uid },
        el("td", { class: "mono", text: j.uid }), el("td", { text: j.owner }), el("td", { text: j.workflow }),
        el("td", { class: `state ${j.state}`, text: j.state }),
        el("td", {}, el("progress", { max: "100", value: String(j.progress) }), ` ${j.progress}%`),
        el("td", { text: j.stage || "–" }), el("td", { text: j.queue_position ?? "–" }),
        el("td", { text: new Date(j.created_at).toLocaleString() }))));
    } catch (e) { /* shown as stale; the next poll or reconnect tries again */ }
  }

  function verdictText(v) {
    if (!v) return "–";  // the leader has not answered yet
    if (v.error) return v.error;
    return v.ok ? `ok${v.fence_token != null ? ` (fence ${v.fence_token})` : ""}` : JSON.stringify(v);
  }
  function renderActions(list) {
    document.querySelector("#actions-table tbody").replaceChildren(...list.map((a) => el("tr", { "data-action-id": String(a.id) },
      el("td", { text: new Date(a.created_at).toLocaleString() }), el("td", { text: a.actor || "–" }),
      el("td", { text: a.action }), el("td", { class: "mono", text: JSON.stringify(a.args) }),
      el("td", { class: `status ${a.status}`, text: a.status }),
      el("td", { class: "mono", text: verdictText(a.verdict) }))));
  }
  async function refreshActions() {
    try { renderActions((await getJSON("/dashboard/api/actions")).actions); } catch (e) { /* next time */ }
  }

  function setOptions(select, values) {
    const keep = select.value;
    if ([...select.options].map((o) => o.value).join() === values.join()) return;
    select.replaceChildren(...values.map((v) => el("option", { value: v, text: v })));
    if (values.includes(keep)) select.value = keep;
  }
  function fillActionChoices() {
    const scale = document.getElementById("scale-form");
    setOptions(scale.workflow, Object.keys(STAGES));
    setOptions(scale.stage, STAGES[scale.workflow.value] || []);
    setOptions(document.getElementById("drain-form").node, Object.keys((lastCluster || {}).nodes || {}).sort());
  }
  document.getElementById("scale-form").workflow.addEventListener("change", fillActionChoices);

  async function submitAction(action, args, question) {
    const outcome = document.getElementById("action-outcome");
    if (!window.confirm(question)) { outcome.textContent = "Cancelled."; return; }
    outcome.textContent = "Sent; waiting for the Node Manager's verdict…";
    try {
      const { action: a } = await getJSON("/dashboard/api/actions", {
        method: "POST", body: JSON.stringify({ action, args }),
        headers: { "Content-Type": "application/json", "X-CSRFToken": CSRF },
      });
      const why = a.verdict && a.verdict.error ? `: ${a.verdict.error}` : "";
      outcome.textContent = `${a.action} ${JSON.stringify(a.args)}: ${a.status}${why}`;
      outcome.className = a.status === "refused" ? "error" : "ok";
    } catch (e) {
      outcome.textContent = `Not sent: ${e.message}`;
      outcome.className = "error";
    }
    refreshActions();
  }
  document.getElementById("scale-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const f = ev.target, n = parseInt(f.instances.value, 10);
    submitAction("scale_stage", { workflow: f.workflow.value, stage: f.stage.value, instances: n },
      `Pin ${f.workflow.value}/${f.stage.value} to ${n} instance(s)?`);
  });
  document.getElementById("drain-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const node = ev.target.node.value;
    submitAction("drain_node", { node }, `Drain node ${node}? Its instances move elsewhere.`);
  });

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
    };
    ws.onmessage = (ev) => {
      const msg = JSON.parse(ev.data);
      if (msg.type === "cluster") renderCluster(msg.cluster);
    };
    ws.onclose = async (ev) => {
      // A refusal during the handshake reaches a browser only as 1006, like a dead server: ask over
      // HTTP whether the session is still staff's before retrying (logged out: retrying cannot help).
      if (ev.code === 4401 || ev.code === 4403) { refusedAs("refused (log in as staff)"); return; }
      if (!opened) {
        const r = await fetch("/dashboard/api/jobs", { credentials: "same-origin" }).catch(() => null);
        if (r && r.status === 403) { refusedAs("session ended (log in as staff)"); return; }
      }
      conn.textContent = `reconnecting in ${backoff / 1000}s`;
      conn.className = "conn down"; conn.dataset.state = "reconnecting";
      setTimeout(connect, backoff);
      backoff = Math.min(backoff * 2, 15000);
    };
  }
  connect();
  setInterval(refreshJobs, JOBS_POLL_MS);
})();
