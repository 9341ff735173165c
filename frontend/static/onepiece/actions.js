// The Actions view: scale a stage, scheduling mode, warm-up, drain, undrain, move an instance. Each asks
// for confirmation, shows the outcome (the Node Manager's verdict, or the warm-up task's), and lands in
// the audit list (/dashboard/api/actions). The choices follow the latest cluster snapshot.
import { CSRF, STAGES, el, getJSON } from "./common.js";

let lastCluster = null;

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

export async function refreshActions() {
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

/** The forms' choices from a cluster snapshot (the last one when none is given). */
export function fillActionChoices(snap) {
  if (snap) lastCluster = snap;
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
form("scale-form").workflow.addEventListener("change", () => fillActionChoices());

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

// Each form: the action's arguments and the question the operator confirms (the action's name is the
// form's data-action, from the template).
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
