// The Cluster view: nodes with their devices and instances (what each node reports), and per workflow
// the stage chain with the leading Node Manager's published figures (``capacity/<workflow>``: the stage
// times it allocates with, what Theorem 1 recommends, the throughput and the bottleneck of the instances
// it runs). Nothing of Theorem 1 is computed here: before a leader has published, the service time shown
// is the mean the instances measured ("measured"), and neither a recommendation nor a bottleneck is shown.
import { STAGES, esc, gib, pct, secs, temp, timed } from "./common.js";

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

// LoRA adapters a denoise instance has loaded (engine/adapters/hot.py's report), and those being read.
function adapterCell(a) {
  if (!a) return "–";
  const loaded = (a.loaded || []).map((n) => `<span class="badge adapter">${esc(n)}</span>`).join(" ");
  const loading = (a.loading || []).map((n) => `<span class="badge adapter loading" title="being read">${esc(n)}…</span>`).join(" ");
  return (loaded + (loading ? " " + loading : "")) || "none";
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
        // a stage pool shared across workflows: one instance serves each of them (engine/workflow/pools.py)
        const serves = (i.serves || []).length > 1
          ? ` <span class="badge shared" title="${esc(i.serves.join(", "))}">shared: ${esc(i.serves.map((m) => m.split("/")[0]).join(", "))}</span>`
          : "";
        return `<tr data-instance="${esc(id)}"><td>${esc(id)}</td><td class="serves">${esc(i.stage)}${serves}</td>` +
          `<td>${pct(i.utilisation == null ? null : i.utilisation * 100)}</td><td>${secs(i.last_stage_s)}</td>` +
          `<td class="threads" title="CPU threads this instance may use (its thread budget)">${esc(i.threads || "–")}</td>` +
          `<td class="batch" title="the most requests that may share one step here (step-level batching)">` +
          `${esc(i.max_batch || 1)}</td><td class="nice" title="nice levels below its node">${esc(i.nice ?? "–")}</td>` +
          `<td class="adapters" title="LoRA adapters loaded here (least recently used first; at most ${esc((i.adapters || {}).max ?? "–")})">` +
          `${adapterCell(i.adapters)}</td>` +
          `<td>${esc(i.requests ?? "–")}</td><td>${i.ready === false ? "starting" : "ready"}</td></tr>`;
      }).join("");
      return `<article class="node" data-node="${esc(name)}"><h3>${esc(name)}` +
        `${drained.includes(name) ? ' <span class="badge">drained</span>' : ""}</h3>${deviceRows(n)}` +
        `<table class="instances"><thead><tr><th>instance</th><th>stage</th><th>util</th><th>last stage</th>` +
        `<th>CPU threads</th><th>max batch</th><th>nice</th><th>adapters</th><th>requests</th><th>state</th></tr></thead><tbody>${rows}</tbody></table></article>`;
    }).join("");
  }
  document.getElementById("device-count").textContent = `${names.length} nodes · ${devices} devices`;
}

// Per stage: the instances the nodes report and their rings, beside the leader's published figures.
function stageFigures(nodes, wf, capacity) {
  const out = {};
  for (const stage of STAGES[wf] || []) out[stage] = { instances: 0, times: [], ringMsgs: null, ringFull: null };
  for (const n of Object.values(nodes)) {
    for (const i of Object.values(n.instances || {})) {
      // an instance of a shared pool counts for every workflow it serves, under that workflow's stage
      const member = (i.serves || [`${i.workflow}/${i.stage}`]).find((m) => m.split("/")[0] === wf);
      if (!member) continue;
      const stage = member.split("/")[1];
      const s = (out[stage] ||= { instances: 0, times: [], ringMsgs: null, ringFull: null });
      s.instances += 1;
      if ((i.serves || []).length > 1) s.sharedWith = i.serves.map((m) => m.split("/")[0]).filter((w) => w !== wf);
      const t = (i.service_s || {})[wf] || (i.workflow === wf ? i.last_stage_s : 0);
      if (t > 0) s.times.push(t);
      if (i.ring) {  // the node reads each instance's ring: messages in it and how full its buffer is
        s.ringMsgs = (s.ringMsgs || 0) + i.ring.messages;
        s.ringFull = Math.max(s.ringFull || 0, i.ring.bytes);
      }
    }
  }
  const published = capacity.service_s || null;  // null: no leader has published for this workflow
  const assigned = capacity.instances || {};
  for (const [stage, s] of Object.entries(out)) {
    s.measured = !published;
    s.service = published ? published[stage] ?? null
      : s.times.length ? s.times.reduce((a, b) => a + b, 0) / s.times.length : null;
    s.recommended = (capacity.recommended || {})[stage];
    // the rate of the instances the leader runs at the stage times it uses (its throughput's terms)
    s.throughput = published && assigned[stage] && s.service ? assigned[stage] / s.service : null;
  }
  const deployed = Object.values(out).some((s) => s.instances > 0);
  return { stats: out, deployed, bottleneck: deployed ? capacity.bottleneck ?? null : null };
}

function renderWorkflows(snap) {
  const nodes = snap.nodes || {};
  document.getElementById("workflows").innerHTML = Object.keys(STAGES).map((wf) => {
    const capacity = (snap.capacity || {})[wf] || {};
    const { stats, deployed, bottleneck } = stageFigures(nodes, wf, capacity);
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
        (s.sharedWith ? `<span class="badge shared" title="one pool of instances serves this stage of these workflows too">` +
          `pool shared with ${esc(s.sharedWith.join(", "))}</span>` : "") +
        `<span class="recommended${off ? " off" : ""}" title="instances Theorem 1 recommends for the live slots">Theorem 1: ${esc(rec)}</span>` +
        `<span class="service" title="${s.measured ? "mean of the instances' last measured stage times (no leader has published)" : "the stage time the Node Manager allocates with"}">` +
        `service ${secs(s.service)}${s.measured && s.service ? " (measured)" : ""}</span>` +
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

// onepiece up's children as its supervisor reports them: one badge each, marked while down or restarting
// (absent where compose, Kubernetes or systemd supervise the processes).
function renderProcesses(processes) {
  const box = document.getElementById("processes");
  const names = Object.keys(processes || {}).sort();
  box.hidden = !names.length;
  const down = names.filter((n) => processes[n].state !== "up");
  box.className = `processes${down.length ? " degraded" : ""}`;
  box.innerHTML = (down.length ? `<strong class="error">degraded: ${esc(down.join(", "))}</strong> · ` : "Processes: ") +
    names.map((n) => {
      const p = processes[n];
      const title = `${p.state}; restarts: ${p.restarts ?? 0}${p.last_exit == null ? "" : `; last exit ${p.last_exit}`}`;
      return `<span class="process ${p.state === "up" ? "ok" : "error"}" data-process="${esc(n)}" ` +
        `data-state="${esc(p.state)}" title="${esc(title)}">${esc(n)}${p.state === "up" ? "" : ` (${esc(p.state)})`}</span>`;
    }).join(" ");
}

export function renderCluster(snap) {
  timed("cluster", () => {
    document.getElementById("snapshot-ts").textContent = snap.ts ? new Date(snap.ts * 1000).toLocaleTimeString() : "–";
    document.getElementById("cluster-error").textContent = snap.error || "";
    renderProcesses(snap.processes);
    renderNodes(snap.nodes || {}, (snap.overrides || {}).drained || []);
    renderWorkflows(snap);
  });
  window.__clusterRendered = performance.now();
}
