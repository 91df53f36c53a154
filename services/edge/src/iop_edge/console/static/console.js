// The IOP operator console: reads the edge's documented catalog and history endpoints
// once a second and redraws. Read-only by design (D06): it only ever sends GET.
"use strict";

(() => {
  const POLL_MS = 1000;
  const REQUEST_TIMEOUT_MS = 5000;
  const RUNS_LIMIT = 20;
  const KEY_STORAGE = "iop-console-api-key";
  // Relative to /iop/console, so they also work under a reverse proxy's prefix.
  const ENDPOINTS = {
    providers: "v1/catalog/providers",
    models: "v1/catalog/models",
    runs: `v1/runs?limit=${RUNS_LIMIT}`,
    usage: "v1/usage",
    // The trailing 15 minutes in 10 s steps (the endpoint's defaults): operators only.
    history: "v1/history",
  };
  const USAGE_COLUMNS = 8;

  class Unauthorized extends Error {}
  class Forbidden extends Error {} // a key the endpoint is not for (the history: operators')

  const $ = (id) => document.getElementById(id);

  // Builds DOM nodes; text always goes through textContent, never innerHTML, so a
  // provider id or error detail can never inject markup.
  function el(tag, props = {}, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(props)) {
      if (value === undefined || value === null || value === false) continue;
      if (name === "class") node.className = value;
      else node.setAttribute(name, String(value));
    }
    for (const child of children.flat()) {
      if (child === undefined || child === null || child === false) continue;
      node.append(child instanceof Node ? child : String(child));
    }
    return node;
  }

  function storedKey() {
    try {
      return sessionStorage.getItem(KEY_STORAGE) || "";
    } catch {
      return ""; // storage disabled: the key lives only in the field
    }
  }

  function storeKey(key) {
    try {
      if (key) sessionStorage.setItem(KEY_STORAGE, key);
      else sessionStorage.removeItem(KEY_STORAGE);
    } catch {
      /* storage disabled */
    }
  }

  let apiKey = storedKey();

  // The body's "data", or the whole body when ``whole`` (the history's range comes with it).
  async function getData(path, whole = false) {
    const headers = { Accept: "application/json" };
    if (apiKey) headers.Authorization = `Bearer ${apiKey}`;
    const response = await fetch(new URL(path, document.baseURI), {
      headers,
      cache: "no-store",
      signal: AbortSignal.timeout(REQUEST_TIMEOUT_MS),
    });
    if (response.status === 401) {
      // The edge says why (an unknown or revoked key, or no keys and a non-loopback client).
      let reason = "";
      try {
        reason = String((await response.json()).error.message || "");
      } catch {
        /* not an OpenAI error object */
      }
      throw new Unauthorized(reason);
    }
    if (response.status === 403) throw new Forbidden(path);
    if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
    const body = await response.json();
    return whole ? body : body.data;
  }

  // ------------------------------------------------------------------ formatting

  function ms(value, zeroMeansNone) {
    if (!value && zeroMeansNone) return "—";
    if (value < 1000) return `${value} ms`;
    return `${(value / 1000).toFixed(2)} s`;
  }

  function clock(unixMs) {
    if (!unixMs) return "—";
    return new Date(unixMs).toLocaleTimeString([], { hour12: false });
  }

  function healthBadge(provider) {
    const known = ["available", "unavailable", "unknown"];
    const kind = known.includes(provider.health) ? provider.health : "other";
    const title = [provider.connected ? "connected" : "node disconnected", provider.detail]
      .filter(Boolean)
      .join(": ");
    return el(
      "span",
      { class: `badge health-${kind}`, "data-testid": "health", title },
      provider.health,
    );
  }

  // The edge's own verdict beside the node's health: ejected for failing run after run
  // (until when), or on trial (the next run decides). Nothing while in selection.
  function ejectionBadge(provider) {
    if (provider.outlier_state === "ejected") {
      const title = `${provider.consecutive_failures} provider failures in a row`;
      return el(
        "span",
        { class: "badge health-unavailable", "data-testid": "ejection", title },
        `ejected until ${clock(provider.ejected_until_ms)}`,
      );
    }
    if (provider.outlier_state === "half_open") {
      const title = "the cooldown is over: the next run decides";
      return el("span", { class: "badge health-other", "data-testid": "ejection", title }, "on trial");
    }
    return null;
  }

  // A provider an operator holds (disabled, draining, drained) has no capacity while held,
  // so its load would read 100%: show the capacity it serves with once enabled and its
  // state instead (the catalog's JSON keeps the zero; docs/ARCHITECTURE.md#runtime-control).
  function heldState(provider) {
    const control = provider.control;
    if (control?.held_capacity == null) return null;
    return el("span", { class: "badge health-other", "data-testid": "held-state" }, control.state);
  }

  function loadBar(ratio) {
    const percent = Math.round(Math.max(0, ratio) * 100);
    const level = ratio >= 1 ? "full" : ratio >= 0.5 ? "busy" : "ok";
    const fill = el("div", { class: `bar-fill bar-${level}` });
    fill.style.width = `${Math.min(100, percent)}%`; // CSSOM: allowed by the page's CSP
    return el(
      "div",
      { class: "load" },
      el(
        "div",
        {
          class: "bar",
          "data-testid": "load-bar",
          role: "meter",
          "aria-valuemin": 0,
          "aria-valuemax": 100,
          "aria-valuenow": percent,
          "aria-label": "load ratio",
        },
        fill,
      ),
      el("span", { class: "load-text", "data-testid": "load-ratio" }, `${percent}%`),
    );
  }

  function servedModels(provider, modelsById) {
    const names = provider.serves.map((modelId) => {
      const served = modelsById.get(modelId)?.providers?.[provider.provider_id];
      return served && served !== modelId ? `${modelId} (as ${served})` : modelId;
    });
    return names.length ? names.join(", ") : provider.models.join(", ") || "—";
  }

  function lifecycleTags(provider) {
    const flags = Object.entries(provider.lifecycle_capabilities || {})
      .filter(([, on]) => on)
      .map(([flag]) => el("span", { class: "tag" }, flag.replaceAll("_", " ")));
    return flags.length ? flags : el("span", { class: "muted" }, "—");
  }

  // The share of the provider's prompt tokens its engine served from its prompt cache
  // (the node's last snapshot); a dash before any was reported.
  function cacheHits(cache) {
    if (!cache || cache.hit_rate === null || cache.hit_rate === undefined) {
      return el("span", { class: "muted" }, "—");
    }
    return el(
      "span",
      { title: `${cache.cached_tokens} of ${cache.prompt_tokens} prompt tokens from the cache` },
      `${Math.round(cache.hit_rate * 100)}%`,
    );
  }

  // Each served model warm (in memory) or cold, with its last load time, for a provider
  // that loads models on demand (Ollama); "always" for one that holds every model.
  function warmth(w) {
    if (!w) return el("span", { class: "muted" }, "—");
    if (!w.on_demand) return el("span", { class: "muted" }, "always");
    return w.models.map((m) =>
      el(
        "span",
        { class: m.warm ? "tag" : "tag muted", title: m.mean_load_ms ? `mean load ${m.mean_load_ms} ms over ${m.loads}` : "" },
        `${m.name} ${m.warm ? "warm" : "cold"}${m.last_load_ms ? ` · ${(m.last_load_ms / 1000).toFixed(1)}s` : ""}`,
      ),
    );
  }

  // ------------------------------------------------------------------ rendering

  const PROVIDER_COLUMNS = [
    "Provider", "Node", "Health", "Capacity", "In flight", "Load", "Queued",
    "Cache hits", "Warm", "Served models", "Lifecycle",
  ];

  function providerTable(providers, modelsById, emptyText) {
    const rows = providers.map((p) =>
      el(
        "tr",
        { "data-testid": "provider-row", "data-provider-id": p.provider_id },
        el(
          "td",
          {},
          el("span", { class: "mono" }, p.provider_id),
          el("div", { class: "muted small" }, [p.type, p.category].filter(Boolean).join(" · ")),
        ),
        el("td", { class: "mono" }, p.node_id),
        el("td", {}, [healthBadge(p), ejectionBadge(p)].filter(Boolean)),
        el("td", { class: "num", "data-testid": "capacity" }, p.control?.held_capacity ?? p.capacity),
        el("td", { class: "num", "data-testid": "in-flight" }, p.in_flight),
        el("td", {}, heldState(p) || loadBar(p.load_ratio)),
        el("td", { class: "num", "data-testid": "queued" }, p.queued),
        el("td", { class: "num", "data-testid": "cache-hit-rate" }, cacheHits(p.cache)),
        el("td", { "data-testid": "warmth" }, warmth(p.warmth)),
        el("td", { "data-testid": "served-models" }, servedModels(p, modelsById)),
        el("td", { "data-testid": "lifecycle" }, lifecycleTags(p)),
      ),
    );
    if (!rows.length) {
      rows.push(el("tr", {}, el("td", { colspan: PROVIDER_COLUMNS.length, class: "muted" }, emptyText)));
    }
    return el(
      "table",
      { class: "grid providers" },
      el("thead", {}, el("tr", {}, PROVIDER_COLUMNS.map((c) => el("th", {}, c)))),
      el("tbody", {}, rows),
    );
  }

  function stat(label, value, testid, warn) {
    return el(
      "span",
      { class: warn ? "stat stat-warn" : "stat" },
      el("span", { class: "stat-label" }, label),
      el("span", { class: "stat-value", "data-testid": testid }, value),
    );
  }

  function renderSummary(providers, models) {
    const available = providers.filter((p) => p.health === "available").length;
    const inFlight = providers.reduce((n, p) => n + p.in_flight, 0);
    const capacity = providers.reduce((n, p) => n + p.capacity, 0);
    const queued = models.reduce((n, m) => n + m.queued, 0);
    $("summary").replaceChildren(
      stat("providers available", `${available} / ${providers.length}`, "summary-available",
        available < providers.length),
      stat("in flight / capacity", `${inFlight} / ${capacity}`, "summary-in-flight", false),
      stat("queued", queued, "summary-queued", queued > 0),
      stat("models", models.length, "summary-models", false),
    );
  }

  function renderModels(providers, models, modelsById) {
    const byId = new Map(providers.map((p) => [p.provider_id, p]));
    const sections = models.map((m) => {
      const ids = Object.keys(m.providers);
      const total = ids.length;
      const available = m.available_providers.length;
      const title = m.display_name && m.display_name !== m.id
        ? [el("span", {}, m.display_name), " ", el("span", { class: "muted mono" }, m.id)]
        : el("span", { class: "mono" }, m.id);
      return el(
        "article",
        { class: "card", "data-testid": "model-section", "data-model-id": m.id },
        el(
          "header",
          { class: "card-head" },
          el("h3", {}, title),
          stat("queue", m.queued, "model-queued", m.queued > 0),
          stat("available", `${available} / ${total}`, "model-available", available === 0),
        ),
        providerTable(
          ids.map((id) => byId.get(id)).filter(Boolean),
          modelsById,
          "None of this model's providers has registered.",
        ),
      );
    });
    $("models").replaceChildren(
      ...(sections.length ? sections : [el("p", { class: "muted" }, "No models configured.")]),
    );
  }

  function renderNodes(providers, modelsById) {
    const nodes = new Map();
    for (const p of providers) {
      if (!nodes.has(p.node_id)) nodes.set(p.node_id, []);
      nodes.get(p.node_id).push(p);
    }
    const sections = [...nodes].map(([nodeId, rows]) => {
      const connected = rows.some((p) => p.connected);
      const inFlight = rows.reduce((n, p) => n + p.in_flight, 0);
      const capacity = rows.reduce((n, p) => n + p.capacity, 0);
      return el(
        "article",
        { class: "card", "data-testid": "node-section", "data-node-id": nodeId },
        el(
          "header",
          { class: "card-head" },
          el("h3", { class: "mono" }, nodeId),
          el(
            "span",
            { class: `badge ${connected ? "health-available" : "health-unavailable"}` },
            connected ? "connected" : "disconnected",
          ),
          stat("in flight", `${inFlight} / ${capacity}`, "node-in-flight", false),
        ),
        providerTable(rows, modelsById, ""),
      );
    });
    $("nodes").replaceChildren(
      ...(sections.length ? sections : [el("p", { class: "muted" }, "No node has registered yet.")]),
    );
  }

  function renderRuns(runs) {
    const rows = runs.map((r) => {
      const outcome = [r.outcome, r.status ? `${r.status}` : "", r.error_code]
        .filter(Boolean)
        .join(" · ");
      // A run that failed over: the attempts before the one that answered (or failed last).
      const tried = (r.attempts || [])
        .slice(0, -1)
        .map((a) => `${a.provider_id} ${a.error_code || a.outcome}`)
        .join(", ");
      return el(
        "tr",
        { "data-testid": "run-row", "data-run-id": r.run_id },
        el("td", { class: "mono" }, clock(r.received_ms)),
        el("td", { class: "mono small", title: r.run_id }, r.run_id.slice(0, 12)),
        el("td", { class: "mono", "data-testid": "run-model" }, r.model),
        el(
          "td",
          { class: "mono", "data-testid": "run-provider", title: tried && `failed over from ${tried}` },
          r.provider_id || "—",
          tried && el("span", { class: "muted small", "data-testid": "run-failover" }, ` ← ${tried}`),
        ),
        el("td", { class: "num" }, ms(r.queue_wait_ms, false)),
        el("td", { class: "num" }, ms(r.ttft_ms, true)),
        el("td", { class: "num" }, ms(r.duration_ms, true)),
        el(
          "td",
          { class: "num", "data-testid": "run-tokens" },
          `${r.prompt_tokens} → ${r.completion_tokens}`,
          r.cached_tokens ? el("span", { class: "muted small" }, ` (${r.cached_tokens} cached)`) : null,
        ),
        el(
          "td",
          {},
          el("span", { class: `badge outcome-${r.outcome}`, "data-testid": "run-outcome" }, outcome),
        ),
      );
    });
    if (!rows.length) {
      rows.push(el("tr", {}, el("td", { colspan: 9, class: "muted" }, "No runs yet.")));
    }
    $("runs").replaceChildren(...rows);
  }

  // "used / limit"; a limit of 0 is no limit, shown as such. Past the limit: a warning.
  function against(used, limit, testid) {
    const over = limit > 0 && used >= limit;
    return el(
      "td",
      { class: over ? "num stat-warn" : "num", "data-testid": testid },
      `${used} / ${limit > 0 ? limit : "unlimited"}`,
    );
  }

  function byApi(split) {
    const parts = Object.entries(split).map(([api, c]) =>
      el("span", { class: "tag", "data-testid": "usage-api", "data-api": api || "unknown" },
        `${api || "(unknown)"} ${c.requests} · ${c.tokens}`),
    );
    return parts.length ? parts : el("span", { class: "muted" }, "—");
  }

  function renderUsage(keys) {
    const rows = [];
    for (const k of keys) {
      const limits = k.limits || {};
      const name = k.name || (k.in_fleet ? "" : k.key_id ? "not in the fleet" : "no key (open API)");
      const period = k.period;
      rows.push(
        el(
          "tr",
          { "data-testid": "usage-row", "data-key-id": k.key_id },
          el(
            "td",
            {},
            el("span", { class: "mono" }, k.key_id || "—"),
            el("div", { class: "muted small" }, [name, k.operator ? "operator" : ""].filter(Boolean).join(" · ")),
          ),
          against(k.minute.requests, limits.requests_per_minute || 0, "usage-rpm"),
          against(k.minute.input_tokens, limits.input_tokens_per_minute || 0, "usage-input-tpm"),
          against(k.minute.output_tokens, limits.output_tokens_per_minute || 0, "usage-output-tpm"),
          against(k.in_flight, k.max_concurrent, "usage-in-flight"),
          el(
            "td",
            { class: "num", "data-testid": "usage-today" },
            `${k.day.requests} · ${k.day.tokens} · ${k.day.errors}`,
          ),
          el(
            "td",
            { class: "num", "data-testid": "usage-budget" },
            `${period.tokens} / ${limits.token_budget > 0 ? limits.token_budget : "unlimited"} (${period.period})`,
          ),
          el("td", { "data-testid": "usage-by-api" }, byApi(k.day.by_api)),
        ),
      );
      for (const m of k.models) {
        rows.push(
          el(
            "tr",
            { class: "muted", "data-testid": "usage-model-row", "data-model-id": m.model },
            el("td", { class: "mono small" }, `  ${m.model}`),
            against(m.minute.requests, m.limits.requests_per_minute, "usage-rpm"),
            against(m.minute.input_tokens, m.limits.input_tokens_per_minute, "usage-input-tpm"),
            against(m.minute.output_tokens, m.limits.output_tokens_per_minute, "usage-output-tpm"),
            el("td", { class: "num" }, m.limits.max_concurrent > 0 ? `max ${m.limits.max_concurrent}` : "—"),
            el("td", {}, ""),
            el(
              "td",
              { class: "num" },
              `${m.period.tokens} / ${m.limits.token_budget > 0 ? m.limits.token_budget : "unlimited"} (${m.period.period})`,
            ),
            el("td", {}, ""),
          ),
        );
      }
    }
    if (!rows.length) {
      rows.push(el("tr", {}, el("td", { colspan: USAGE_COLUMNS, class: "muted" }, "No keys.")));
    }
    $("usage").replaceChildren(...rows);
  }

  function render(providers, models, runs, usage, history) {
    const modelsById = new Map(models.map((m) => [m.id, m]));
    renderSummary(providers, models);
    renderModels(providers, models, modelsById);
    renderNodes(providers, modelsById);
    renderUsage(usage);
    renderRuns(runs);
    if (history) window.IOPHistory.render($("history"), history);
    else {
      $("history").replaceChildren(
        el("p", { class: "muted", "data-testid": "history-forbidden" }, "The history is for operator keys."),
      );
    }
  }

  function clearData() {
    for (const id of ["summary", "models", "nodes", "usage", "runs", "history"]) $(id).replaceChildren();
  }

  function setStatus(kind, text) {
    const status = $("status");
    status.className = `status status-${kind}`;
    status.textContent = text;
  }

  function setAuthMessage(text) {
    const banner = $("auth");
    banner.textContent = text;
    banner.hidden = !text;
  }

  // ------------------------------------------------------------------ polling

  let timer = 0;
  let polling = false;
  let pollAgain = false;

  async function poll() {
    clearTimeout(timer);
    if (polling) {
      pollAgain = true; // a new key while a poll is out: poll again when it ends
      return;
    }
    polling = true;
    try {
      const [providers, models, runs, usage, history] = await Promise.all([
        getData(ENDPOINTS.providers),
        getData(ENDPOINTS.models),
        getData(ENDPOINTS.runs),
        getData(ENDPOINTS.usage),
        // Another key than an operator's still sees the rest of the page.
        getData(ENDPOINTS.history, true).catch((error) => {
          if (error instanceof Forbidden) return null;
          throw error;
        }),
      ]);
      setAuthMessage("");
      render(providers, models, runs, usage, history);
      setStatus("live", `live · updated ${clock(Date.now())}`);
    } catch (error) {
      if (error instanceof Unauthorized) {
        // Nothing stale stays on screen for a caller the API has just refused.
        clearData();
        const reason = error.message ? ` The edge said: ${error.message}` : "";
        setAuthMessage(
          (apiKey
            ? "API key required: the key entered was not accepted."
            : "API key required: enter a key above.") + reason,
        );
        setStatus("error", "API key required");
      } else {
        setStatus("error", `edge unreachable, retrying (${error.message || error})`);
      }
    } finally {
      // One request set at a time: the next poll starts only after this one ends.
      polling = false;
      if (pollAgain) {
        pollAgain = false;
        poll();
      } else {
        timer = setTimeout(poll, POLL_MS);
      }
    }
  }

  function useKey(event) {
    if (event) event.preventDefault();
    const key = $("api-key").value.trim();
    if (key === apiKey) return;
    apiKey = key;
    storeKey(key);
    poll();
  }

  $("api-key").value = apiKey;
  $("key-form").addEventListener("submit", useKey);
  $("api-key").addEventListener("change", useKey);
  poll();
})();
