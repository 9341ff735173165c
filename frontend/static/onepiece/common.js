// Shared by the dashboard's views: escaping, formatting, render timing, REST, the workflows' stages.
// Node and job fields come from outside: every one is escaped before it reaches HTML.

export const STAGES = JSON.parse(document.getElementById("workflow-stages").textContent);
export const CSRF = document.querySelector('meta[name="csrf-token"]').content;
window.__renderTimes = {};  // ms spent in each render, read by the browser tests

export function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k === "text") e.textContent = v; else e.setAttribute(k, v);
  }
  for (const c of children) if (c != null) e.append(c);
  return e;
}
const ESC = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
export const esc = (v) => String(v ?? "").replace(/[&<>"']/g, (c) => ESC[c]);
export const pct = (x) => (x == null ? "–" : `${Math.round(x)}%`);
export const gib = (b) => (b == null ? "–" : `${(b / 2 ** 30).toFixed(1)} GiB`);
export const secs = (s) => (s ? `${s.toFixed(3)} s` : "–");
export const temp = (t) => (t == null ? "–" : `${Math.round(t)} °C`);

export function timed(name, fn) {
  const t0 = performance.now();
  try { return fn(); } finally {
    const ms = performance.now() - t0;
    window.__renderTimes[name] = ms;
    const out = document.getElementById(`render-${name}-ms`);
    if (out) out.textContent = `(rendered in ${ms.toFixed(0)} ms)`;
  }
}

export async function getJSON(url, opts) {
  const r = await fetch(url, { credentials: "same-origin", ...opts });
  const body = await r.json().catch(() => ({}));
  if (!r.ok) throw new Error(body.error || `${r.status} ${r.statusText}`);
  return body;
}
