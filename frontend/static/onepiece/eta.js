// The engine's ETA of an unfinished job as a line of text, shared by the dashboard's job view and the
// owner's watch page: {eta_s, eta_p90_s, provisional, queue_ahead} (the job status's "eta", or the job
// socket's "eta" message) -> "ETA ~3.2s (p90 5.1s) · provisional"; "" where there is none (a finished job).
const sec = (s) => (s < 1 ? `${(+s).toFixed(2)}s` : s < 10 ? `${(+s).toFixed(1)}s` : `${Math.round(s)}s`);

export function etaText(eta) {
  if (!eta || eta.eta_s == null) return "";
  const ahead = eta.queue_ahead ? ` · ${+eta.queue_ahead} ahead` : "";
  return `ETA ~${sec(eta.eta_s)} (p90 ${sec(eta.eta_p90_s)})${eta.provisional ? " · provisional" : ""}${ahead}`;
}

/** Shows ``eta`` in element ``node`` (hidden when there is none); returns the text shown. */
export function showEta(node, eta) {
  const text = etaText(eta);
  node.textContent = text;
  node.hidden = !text;
  node.dataset.provisional = eta && eta.provisional ? "1" : "0";
  return text;
}
