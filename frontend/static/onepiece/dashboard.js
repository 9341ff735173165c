// OnePiece operator dashboard: plain JS, no library, nothing fetched from outside this site.
// Live state arrives over /ws/cluster (session auth); jobs, traffic, a job's detail and the audit list
// come from /dashboard/api/*, re-fetched after every reconnect because pushes missed while away are gone.
// Lists are built as one HTML string (escaped) and set in one go: 1,000 job rows or 50 devices cost
// one parse and one layout, not thousands of DOM insertions.
"use strict";

(function () {
  const STAGES = JSON.parse(document.getElementById("workflow-stages").textContent);
  const CSRF = document.querySelector('meta[name="csrf-token"]').content;
  const JOBS_POLL_MS = 1000;  // the jobs list has no push channel of its own: polled while shown
  const JOBS_IDLE_POLL_MS = 5000;  // ...and slower behind another view (its counts and choices stay fresh)
  const TRAFFIC_POLL_MS = 5000;
  const SVG = "http://www.w3.org/2000/svg";
  let lastCluster = null;
  let openJob = null;  // uid shown in the detail panel
  window.__renderTimes = {};  // ms spent in each render, read by the browser tests

  // -- small helpers (node and job fields come from outside: always escaped) ------------------------
  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") e.className = v; else if (k === "text") e.textContent = v; else e.setAttribute(k, v);
    }
    for (const c of children) if (c != null) e.append(c);
    return e;
  }
  const ESC = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  const esc = (v) => String(v ?? "").replace(/[&<>"']/g, (c) => ESC[c]);
  const pct = (x) => (x == null ? "–" : `${Math.round(x)}%`);
  const gib = (b) => (b == null ? "–" : `${(b / 2 ** 30).toFixed(1)} GiB`);
  const secs = (s) => (s ? `${s.toFixed(3)} s` : "–");
  const temp = (t) => (t == null ? "–" : `${Math.round(t)} °C`);
  function timed(name, fn) {
    const t0 = performance.now();
    try { return fn(); } finally {
      const ms = performance.now() - t0;
      window.__renderTimes[name] = ms;
      const out = document.getElementById(`render-${name}-ms`);
      if (out) out.textContent = `(rendered in ${ms.toFixed(0)} ms)`;
    }
  }

  // -- views ------------------------------------------------------------------------------------------
  let current = "cluster";
  function show(view) {
    current = view;
    for (const s of document.querySelectorAll(".view")) s.hidden = s.id !== `view-${view}`;
    for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.view === view);
    if (view === "traffic") refreshTraffic();
    if (view === "jobs" && typeof refreshJobs === "function") refreshJobs();
  }
  window.addEventListener("hashchange", () => show(location.hash.slice(1) || "cluster"));

  // -- cluster: nodes and their devices ------------------------------------------------------------------
  function deviceRows(node) {
    const devices = node.devices || [];
    if (!devices.length) return '<p class="muted">no device telemetry reported</p>';
    return `<table class="devices"><thead><tr><th>device</th><th>source</th><th>util</th><th>memory</th><th>temp</th></tr></thead><tbody>${
      devices.map((d) => {
        // Never show CPU load as if it were a GPU's: a sample not from NVML says so on its row.
        const gpu = d.source === "nvml";
        return `<tr class="device ${gpu ? "gpu" : "cpu"}" data-device="${esc(d.kind)}${esc(d.index)}">` +
          `<td class="dev-name">${esc(String(d.kind).toUpperCase())} ${esc(d.index)}: ${esc(d.name)}</td>` +
          `<td>${gpu ? "NVML" : `<span class="badge" title="${esc(d.source)}">CPU figures (no GPU)</span>`}</td>` +
          `<td><span class="bar"><span style="width:${Math.max(0, Math.min(100, +d.utilisation || 0))}%"></span></span> ${pct(d.utilisation)}</td>` +
          `<td>${gib(d.memory_used)} / ${gib(d.memory_total)}</td><td>${temp(d.temperature_c)}</td></tr>`;
      }).join("")}</tbody></table>`;
  }

  function renderNodes(nodes, drained) {
    const box = document.getElementById("nodes");
    const names = Object.keys(nodes).sort();
    let devices = 0;
    if (!names.length) { box.innerHTML = '<p class="empty">No node has registered.</p>'; }
    else {
      box.innerHTML = names.map((name) => {
        const n = nodes[name] || {};
        devices += (n.devices || []).length;
        const inst = n.instances || {};
        const rows = Object.keys(inst).sort().map((id) => {
          const i = inst[id];
          return `<tr data-instance="${esc(id)}"><td>${esc(id)}</td><td>${esc(i.stage)}</td>` +
            `<td>${pct(i.utilisation == null ? null : i.utilisation * 100)}</td><td>${secs(i.last_stage_s)}</td>` +
            `<td class="threads" title="CPU threads this instance may use (its thread budget)">${esc(i.threads || "–")}</td>` +
            `<td>${esc(i.requests ?? "–")}</td><td>${i.ready === false ? "starting" : "ready"}</td></tr>`;
        }).join("");
        return `<article class="node" data-node="${esc(name)}"><h3>${esc(name)}` +
          `${drained.includes(name) ? ' <span class="badge">drained</span>' : ""}</h3>${deviceRows(n)}` +
          `<table class="instances"><thead><tr><th>instance</th><th>stage</th><th>util</th><th>last stage</th>` +
          `<th>CPU threads</th><th>requests</th><th>state</th></tr></thead><tbody>${rows}</tbody></table></article>`;
      }).join("");
    }
    document.getElementById("device-count").textContent = `${names.length} nodes · ${devices} devices`;
  }

  // Per stage: instances across nodes and their mean measured service time (the leader's stage time
  // when it publishes one). Throughput is instances / service time; the bottleneck is the stage with
  // the largest service time per instance.
  function stageStats(nodes, wf, capacity) {
    const out = {};
    for (const stage of STAGES[wf] || []) out[stage] = { instances: 0, times: [], ringMsgs: null, ringFull: null };
    for (const n of Object.values(nodes)) {
      for (const i of Object.values(n.instances || {})) {
        if (i.workflow !== wf) continue;
        const s = (out[i.stage] ||= { instances: 0, times: [], ringMsgs: null, ringFull: null });
        s.instances += 1;
        if (i.last_stage_s > 0) s.times.push(i.last_stage_s);
        if (i.ring) {  // the node reads each instance's ring: messages in it and how full its buffer is
          s.ringMsgs = (s.ringMsgs || 0) + i.ring.messages;
          s.ringFull = Math.max(s.ringFull || 0, i.ring.bytes);
        }
      }
    }
    let worst = null, worstLoad = -1;
    const deployed = Object.values(out).some((s) => s.instances > 0);
    for (const [stage, s] of Object.entries(out)) {
      const measured = s.times.length ? s.times.reduce((a, b) => a + b, 0) / s.times.length : null;
      s.service = measured ?? ((capacity.service_s || {})[stage] || null);
      s.recommended = (capacity.recommended || {})[stage];
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
    document.getElementById("workflows").innerHTML = Object.keys(STAGES).map((wf) => {
      const capacity = (snap.capacity || {})[wf] || {};
      const { stats, deployed, bottleneck } = stageStats(nodes, wf, capacity);
      const inflight = (snap.inflight || {})[wf] || {};
      const waiting = (snap.waiting || {})[wf] || { queued: 0, stages: {} };
      // the mode the leader runs (published with capacity), else what operators set, else the default
      const mode = capacity.mode || ((snap.overrides || {}).modes || {})[wf] || "individual";
      const stages = Object.entries(stats).map(([stage, s]) => {
        const rec = s.recommended == null ? "–" : s.recommended;
        const off = s.recommended != null && s.recommended !== s.instances;
        return `<div class="stage${stage === bottleneck ? " bottleneck" : ""}" data-stage="${esc(stage)}">` +
          `<strong>${esc(stage)}</strong>` +
          `<span class="count">${s.instances} instance${s.instances === 1 ? "" : "s"}</span>` +
          `<span class="recommended${off ? " off" : ""}" title="instances Theorem 1 recommends for the live slots">Theorem 1: ${esc(rec)}</span>` +
          `<span>service ${secs(s.service)}</span>` +
          `<span class="waiting">at stage: ${esc((waiting.stages || {})[stage] || 0)} jobs</span>` +
          (s.ringMsgs == null ? "" : `<span class="ring" title="messages in the instances' rings; fullest buffer">` +
            `rings: ${esc(s.ringMsgs)} msgs, ${esc(Math.round(100 * s.ringFull))}% full</span>`) +
          `<span>throughput ${s.throughput ? s.throughput.toFixed(2) + "/s" : "–"}</span>` +
          `${stage === bottleneck ? '<span class="badge">bottleneck</span>' : ""}</div>`;
      }).join('<span class="arrow">→</span>');
      const cap = capacity.rps != null ? ` · capacity ${(+capacity.rps).toFixed(2)}/s` : "";
      return `<article class="workflow" data-workflow="${esc(wf)}"><h3>${esc(wf)}` +
        `<small> in flight: ${esc(inflight.jobs ?? 0)} jobs, ${esc(inflight.gpu_s ?? 0)} GPU·s · queued: ` +
        `${esc(waiting.queued)} · mode: <span class="mode">${esc(mode)}</span>${esc(cap)}</small>` +
        `${deployed ? "" : ' <span class="badge">no instances</span>'}</h3>` +
        `<div class="chain">${stages}</div></article>`;
    }).join("");
  }

  function renderCluster(snap) {
    lastCluster = snap;
    timed("cluster", () => {
      document.getElementById("snapshot-ts").textContent = snap.ts ? new Date(snap.ts * 1000).toLocaleTimeString() : "–";
      document.getElementById("cluster-error").textContent = snap.error || "";
      renderNodes(snap.nodes || {}, (snap.overrides || {}).drained || []);
      renderWorkflows(snap);
    });
    window.__clusterRendered = performance.now();
    fillActionChoices();
    const counts = snap.jobs || {};
    document.getElementById("jobs-counts").textContent =
      Object.entries(counts).map(([k, v]) => `${k}: ${v}`).join(" · ");
  }

  // -- REST --------------------------------------------------------------------------------------------
  async function getJSON(url, opts) {
    const r = await fetch(url, { credentials: "same-origin", ...opts });
    const body = await r.json().catch(() => ({}));
    if (!r.ok) throw new Error(body.error || `${r.status} ${r.statusText}`);
    return body;
  }

  // -- traffic: inline SVG line charts ------------------------------------------------------------------
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
  async function refreshTraffic() {
    try {
      const minutes = document.getElementById("traffic-minutes").value;
      renderTraffic(await getJSON(`/dashboard/api/traffic?minutes=${minutes}&step=${Math.max(5, +minutes)}`));
    } catch (e) { /* the next poll tries again */ }
  }
  document.getElementById("traffic-minutes").addEventListener("change", refreshTraffic);

  // -- jobs ----------------------------------------------------------------------------------------------
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
  async function refreshJobs() {
    try {
      const { jobs, total } = await getJSON("/dashboard/api/jobs");
      renderJobs(jobs, total);
      if (openJob) refreshDetail();
    } catch (e) { /* shown as stale; the next poll or reconnect tries again */ }
  }
  document.querySelector("#jobs-table tbody").addEventListener("click", (ev) => {
    const row = ev.target.closest("tr[data-uid]");
    if (row) openDetail(row.dataset.uid);
  });

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
    document.getElementById("job-gantt").innerHTML = gantt(job);
    const box = document.getElementById("job-result");
    const src = job.result && job.result.url;
    const shown = box.querySelector("[data-src]");
    if (!src) { box.innerHTML = `<p class="muted">${job.state === "completed" ? "" : "No result yet."}</p>`; return; }
    if (shown && shown.dataset.src === src) return;  // keep a playing video playing across refreshes
    box.replaceChildren(job.result.kind === "video"
      ? el("video", { controls: "", src, "data-src": src, preload: "metadata" })
      : el("img", { src, "data-src": src, alt: `result of ${job.uid}` }));
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
  document.getElementById("job-detail-close").addEventListener("click", () => {
    openJob = null; document.getElementById("job-detail").hidden = true;
  });

  // -- actions -------------------------------------------------------------------------------------------
  function verdictText(v) {
    if (!v) return "–";  // the leader (or the warm-up task) has not answered yet
    if (v.error) return v.error;
    if (v.report) return JSON.stringify(v.report);
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

  function setOptions(select, values, labels) {
    const keep = select.value;
    const want = values.map((v, i) => `${v}=${(labels || values)[i]}`).join();
    if ([...select.options].map((o) => `${o.value}=${o.textContent}`).join() === want) return;
    select.replaceChildren(...values.map((v, i) => el("option", { value: v, text: (labels || values)[i] })));
    if (values.includes(keep)) select.value = keep;
  }
  const form = (id) => document.getElementById(id);
  function fillActionChoices() {
    const nodes = (lastCluster || {}).nodes || {};
    const names = Object.keys(nodes).sort();
    // What can be moved is what the leader assigned (ids it knows); the nodes' reports until it has.
    const assigned = (lastCluster || {}).assignments || {};
    const instances = Object.keys(assigned).length
      ? Object.keys(assigned).sort().flatMap((n) => (assigned[n] || []).slice().sort().map((i) => [i, n]))
      : names.flatMap((n) => Object.keys(nodes[n].instances || {}).sort().map((i) => [i, n]));
    const scale = form("scale-form");
    setOptions(scale.workflow, Object.keys(STAGES));
    setOptions(scale.stage, STAGES[scale.workflow.value] || []);
    setOptions(form("mode-form").workflow, Object.keys(STAGES));
    setOptions(form("warm-form").workflow, Object.keys(STAGES));
    setOptions(form("warm-form").node, ["", ...names], ["every node", ...names]);
    const drained = ((lastCluster || {}).overrides || {}).drained || [];
    setOptions(form("drain-form").node, names);
    setOptions(form("undrain-form").node, [...new Set([...drained, ...names])].sort());
    setOptions(form("move-form").instance, instances.map(([i]) => i), instances.map(([i, n]) => `${i} (on ${n})`));
    setOptions(form("move-form").node, names);
  }
  form("scale-form").workflow.addEventListener("change", fillActionChoices);

  async function submitAction(action, args, question) {
    const outcome = document.getElementById("action-outcome");
    if (!window.confirm(question)) { outcome.textContent = "Cancelled."; outcome.className = ""; return; }
    outcome.textContent = action === "warm_up" ? "Sending the warm-up task…" : "Sent; waiting for the Node Manager's verdict…";
    outcome.className = "";
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
  // Each form: the action's arguments and the question the operator confirms.
  const FORMS = {
    "scale-form": (f) => { const n = parseInt(f.instances.value, 10); return [{ workflow: f.workflow.value, stage: f.stage.value, instances: n }, `Pin ${f.workflow.value}/${f.stage.value} to ${n} instance(s)?`]; },
    "mode-form": (f) => [{ workflow: f.workflow.value, mode: f.mode.value }, `Switch ${f.workflow.value} to ${f.mode.value} scheduling?`],
    "warm-form": (f) => [{ workflows: [f.workflow.value], nodes: f.node.value ? [f.node.value] : [] }, `Warm up ${f.workflow.value} on ${f.node.value || "every node"}? It sends small requests through every stage.`],
    "drain-form": (f) => [{ node: f.node.value }, `Drain node ${f.node.value}? Its instances move elsewhere.`],
    "undrain-form": (f) => [{ node: f.node.value }, `Undrain node ${f.node.value}? It takes instances again.`],
    "move-form": (f) => [{ instance: f.instance.value, node: f.node.value }, `Move ${f.instance.value} to ${f.node.value}?`],
  };
  for (const [id, argsOf] of Object.entries(FORMS)) {
    form(id).addEventListener("submit", (ev) => {
      ev.preventDefault();
      const [args, question] = argsOf(ev.target);
      submitAction(ev.target.dataset.action, args, question);
    });
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
      if (msg.type === "cluster") renderCluster(msg.cluster);
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
})();
