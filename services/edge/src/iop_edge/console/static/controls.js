// The runtime control page (docs/ARCHITECTURE.md#runtime-control), linked from the console:
// the controls in force, the audit trail, and disable / drain / enable buttons per provider
// and node. The console's one writer, a page of its own so the console stays read-only: it
// POSTs to /iop/v1/controls with the key the console keeps in this tab, which the edge
// accepts from operator keys only (any other gets 403, shown here).
"use strict";

(() => {
  const POLL_MS = 2000;
  const AUDIT_SHOWN = 20;
  const KEY_STORAGE = "iop-console-api-key"; // console.js keeps the typed key there
  // Relative to /iop/console/static/controls.html, so a reverse proxy's prefix works too.
  const CONTROLS = "../../v1/controls";
  const $ = (id) => document.getElementById(id);

  function el(tag, props = {}, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(props)) {
      if (value === undefined || value === null || value === false) continue;
      if (name === "class") node.className = value;
      else if (name === "onclick") node.addEventListener("click", value);
      else node.setAttribute(name, String(value));
    }
    for (const child of children.flat()) {
      if (child === undefined || child === null) continue;
      node.append(child instanceof Node ? child : String(child)); // text, never markup
    }
    return node;
  }

  function headers() {
    let key = "";
    try {
      key = sessionStorage.getItem(KEY_STORAGE) || "";
    } catch {
      /* storage disabled */
    }
    const h = { Accept: "application/json", "Content-Type": "application/json" };
    if (key) h.Authorization = `Bearer ${key}`;
    return h;
  }

  async function call(method, path, body) {
    const response = await fetch(new URL(path, document.baseURI), {
      method,
      headers: headers(),
      cache: "no-store",
      body: body === undefined ? undefined : JSON.stringify(body),
      signal: AbortSignal.timeout(15000),
    });
    const payload = await response.json().catch(() => ({}));
    if (!response.ok) {
      const message = (payload.error && payload.error.message) || `HTTP ${response.status}`;
      throw Object.assign(new Error(message), { status: response.status });
    }
    return payload;
  }

  const when = (ms) => new Date(ms).toISOString().replace("T", " ").slice(0, 19) + "Z";
  const shown = (value) => value || "—";

  function button(label, target, value) {
    return el(
      "button",
      {
        type: "button",
        "data-testid": `control-${label}-${target}`,
        onclick: async () => {
          try {
            await call("POST", CONTROLS, { kind: "state", target, value, reason: "console" });
            $("controls-error").hidden = true;
          } catch (error) {
            $("controls-error").textContent = error.message;
            $("controls-error").hidden = false;
          }
          refresh();
        },
      },
      label,
    );
  }

  function targets(providers) {
    const rows = [];
    const nodes = [...new Set(providers.map((p) => p.node_id))];
    for (const node of nodes) rows.push({ target: node, state: "" });
    for (const p of providers) {
      rows.push({ target: `${p.node_id}/${p.provider_id}`, state: (p.control || {}).state || "" });
    }
    return rows;
  }

  function render(listing, providers) {
    const box = $("controls");
    box.replaceChildren(
      el(
        "table",
        { class: "grid", "data-testid": "controls-targets" },
        el("thead", {}, el("tr", {}, ["Target", "State", ""].map((h) => el("th", {}, h)))),
        el(
          "tbody",
          {},
          targets(providers).map((t) =>
            el(
              "tr",
              {},
              el("td", {}, t.target),
              el("td", {}, t.state || (t.target.includes("/") ? "serving" : "")),
              el(
                "td",
                {},
                button("disable", t.target, "disabled"),
                button("drain", t.target, "draining"),
                button("enable", t.target, ""),
              ),
            ),
          ),
        ),
      ),
      el("h3", {}, "In force"),
      listing.controls.length
        ? el(
            "ul",
            { "data-testid": "controls-in-force" },
            listing.controls.map((c) =>
              el("li", {}, `${c.kind} ${c.target} = ${c.value} · ${c.changed_by} · ${when(c.changed_at_ms)} · ${c.change_id}${c.reason ? " · " + c.reason : ""}`),
            ),
          )
        : el("p", { class: "muted" }, "None: the fleet file rules."),
      el("h3", {}, "Audit"),
      el(
        "table",
        { class: "grid", "data-testid": "controls-audit" },
        el("thead", {}, el("tr", {}, ["At", "Change", "By", "What", "Before", "After", "Reason"].map((h) => el("th", {}, h)))),
        el(
          "tbody",
          {},
          listing.audit.slice(0, AUDIT_SHOWN).map((c) =>
            el(
              "tr",
              {},
              [when(c.at_ms), c.change_id, c.changed_by, `${c.kind} ${c.target}`, shown(c.before), shown(c.after), c.reason || (c.reverts ? `reverts ${c.reverts}` : "")].map((v) => el("td", {}, v)),
            ),
          ),
        ),
      ),
    );
  }

  async function refresh() {
    try {
      const [listing, providers] = await Promise.all([
        call("GET", `${CONTROLS}?audit=${AUDIT_SHOWN}`),
        call("GET", "../../v1/catalog/providers"),
      ]);
      render(listing, providers.data);
    } catch (error) {
      const forbidden = error.status === 403 || error.status === 401;
      $("controls").replaceChildren(
        el("p", { class: "muted", "data-testid": "controls-forbidden" }, forbidden ? "Runtime control is for operator keys." : error.message),
      );
    }
  }

  document.addEventListener("DOMContentLoaded", () => {
    refresh();
    setInterval(refresh, POLL_MS);
  });
})();
