// The console's "Qualification reports" panel (docs/ARCHITECTURE.md#qualification-reports):
// the catalog's newest report of each provider of each model, and two of them compared
// side by side. Reports change only when an operator runs `iopctl qualify`, so the panel
// reads them every 15 s, on its own, with the key the console keeps in this tab.
"use strict";

(() => {
  const KEY_STORAGE = "iop-console-api-key"; // console.js's
  const LATEST = "v1/catalog/qualifications";
  const ONE = "v1/qualifications/";
  const POLL_MS = 15000;
  const picked = [];

  function el(tag, text, attributes = {}) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
    if (text !== undefined) node.textContent = text; // text, never markup
    return node;
  }

  async function get(path) {
    const headers = { Accept: "application/json" };
    let key = "";
    try {
      key = sessionStorage.getItem(KEY_STORAGE) || "";
    } catch {
      key = "";
    }
    if (key) headers.Authorization = `Bearer ${key}`;
    const response = await fetch(new URL(path, document.baseURI), { headers });
    if (response.status === 403) throw new Error("Qualification reports are for operator keys.");
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    return response.json();
  }

  const num = (v, unit = "") => (v === null || v === undefined ? "-" : `${v}${unit}`);
  const engine = (e) => (e && e.name ? `${e.name} ${e.version || "(version unknown)"}` : "-");

  function row(cells) {
    const tr = el("tr");
    for (const cell of cells) tr.append(cell instanceof Node ? el("td").appendChild(cell).parentNode : el("td", String(cell)));
    return tr;
  }

  function renderList(reports) {
    const body = document.getElementById("qualifications");
    if (!body) return;
    body.replaceChildren(
      ...reports.map((r) => {
        const box = el("input", undefined, { type: "checkbox", "data-id": r.id, "aria-label": `compare ${r.id}` });
        box.checked = picked.includes(r.id);
        box.addEventListener("change", () => pick(r.id, box.checked));
        const s = r.summary || {};
        return row([
          box, r.model, `${r.node_id}/${r.provider_id}`, engine(r.engine), (r.engine || {}).device || "-",
          num(s.ttft_p50_ms, " ms"), num(s.tokens_per_s_single), num(s.tokens_per_s_aggregate_best),
          num(s.context_reached_tokens), s.tool_call || "-", s.json_schema || "-",
          s.deterministic ? "yes" : "no", new Date(r.created_ms).toLocaleString(),
        ]);
      }),
    );
  }

  function pick(id, on) {
    const at = picked.indexOf(id);
    if (on && at < 0) picked.push(id);
    if (!on && at >= 0) picked.splice(at, 1);
    while (picked.length > 2) picked.shift();
    for (const box of document.querySelectorAll("#qualifications input[type=checkbox]")) {
      box.checked = picked.includes(box.getAttribute("data-id"));
    }
    if (picked.length === 2) compare(picked[0], picked[1]);
  }

  function perf(report, level, key) {
    const found = (report.performance || []).find((p) => p.concurrency === level);
    return found ? found[key] : null;
  }

  function change(a, b) {
    if (typeof a !== "number" || typeof b !== "number") return a === b ? "-" : "changed";
    if (a === 0) return b === 0 ? "-" : "new";
    const sign = b - a >= 0 ? "+" : "";
    return `${sign}${Number((b - a).toFixed(2))} (${(b / a).toFixed(2)}x)`;
  }

  async function compare(idA, idB) {
    const out = document.getElementById("qualification-compare");
    try {
      const [a, b] = await Promise.all([get(ONE + encodeURIComponent(idA)), get(ONE + encodeURIComponent(idB))]);
      const levels = (a.performance || []).map((p) => p.concurrency).filter((c) => perf(b, c, "concurrency") !== null);
      const metrics = [
        ["provider", (r) => `${r.node_id}/${r.provider_id}`],
        ["engine", (r) => engine(r.engine)],
        ["device", (r) => (r.engine || {}).device || "-"],
        ...levels.flatMap((c) => [
          [`c=${c} ttft p50 ms`, (r) => perf(r, c, "ttft_p50_ms")],
          [`c=${c} tok/s single`, (r) => perf(r, c, "tokens_per_s_single")],
          [`c=${c} tok/s aggregate`, (r) => perf(r, c, "tokens_per_s_aggregate")],
        ]),
        ["context reached", (r) => r.context.reached_tokens],
        ["tool call", (r) => r.summary.tool_call],
        ["JSON schema", (r) => r.summary.json_schema],
        ["distinct answers at t=0", (r) => r.determinism.distinct],
      ];
      const table = el("table", undefined, { class: "grid", "data-testid": "qualification-compare-table" });
      table.append(row([el("b", "Metric"), el("b", `A ${a.id}`), el("b", `B ${b.id}`), el("b", "B vs A")]));
      for (const [name, read] of metrics) table.append(row([name, num(read(a)), num(read(b)), change(read(a), read(b))]));
      out.replaceChildren(table);
    } catch (error) {
      out.replaceChildren(el("p", String(error.message || error), { class: "muted" }));
    }
  }

  async function poll() {
    try {
      renderList((await get(LATEST)).data || []);
    } catch (error) {
      const body = document.getElementById("qualifications");
      if (body) body.replaceChildren(row([String(error.message || error)]));
    }
    setTimeout(poll, POLL_MS);
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", poll);
  else poll();
})();
