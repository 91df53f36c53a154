// The console's history plots: the edge's /iop/v1/history drawn as inline SVG, one plot
// per metric, one line per model and provider. No library and nothing fetched: the
// console polls the data (console.js) and hands it to IOPHistory.render.
"use strict";

window.IOPHistory = (() => {
  // An XML namespace name, not a URL anything is fetched from: SVG elements need it.
  const SVG_NS = "http://www.w3.org/2000/svg";
  const WIDTH = 360;
  const HEIGHT = 140;
  const PAD = { left: 44, right: 8, top: 10, bottom: 20 };
  const METRICS = [
    { key: "requests", title: "Requests", unit: "per step" },
    { key: "tokens_per_s", title: "Output tokens / s", unit: "tokens/s" },
    { key: "ttft_ms", title: "Time to first token", unit: "ms, mean" },
    { key: "queue_depth", title: "Queue depth", unit: "mean" },
    { key: "errors", title: "Errors", unit: "per step" },
  ];
  const COLORS = ["#2563eb", "#db2777", "#16a34a", "#ea580c", "#7c3aed", "#0891b2", "#ca8a04", "#4b5563"];

  function svg(tag, attributes = {}, text) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, String(value));
    if (text !== undefined) node.textContent = text; // text, never markup
    return node;
  }

  function html(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function label(value) {
    if (value >= 1000) return `${(value / 1000).toFixed(value >= 10000 ? 0 : 1)}k`;
    if (value >= 10 || Number.isInteger(value)) return String(Math.round(value));
    return String(Number(value.toFixed(2))); // 0.25, 2.5: a nice top's half, unrounded
  }

  function clock(unixMs) {
    return new Date(unixMs).toLocaleTimeString([], { hour12: false, hour: "2-digit", minute: "2-digit" });
  }

  // A "nice" top for the y axis: 1, 2 or 5 times a power of ten, at least the data's max.
  function niceTop(max) {
    if (!(max > 0)) return 1;
    const power = 10 ** Math.floor(Math.log10(max));
    return [1, 2, 5, 10].map((m) => m * power).find((top) => top >= max);
  }

  // The path of one series: a null value (no TTFT in that step) breaks the line.
  function pathOf(values, x, y) {
    const parts = [];
    let drawing = false;
    values.forEach((value, i) => {
      if (value === null || value === undefined) {
        drawing = false;
        return;
      }
      // "h0" after a move: a lone point (a step between two without a value) is drawn as a
      // dot by the round line cap, where a bare move would draw nothing.
      const at = `${x(i).toFixed(1)},${y(value).toFixed(1)}`;
      parts.push(drawing ? `L${at}` : `M${at}h0`);
      drawing = true;
    });
    return parts.join(" ");
  }

  function plot(metric, history, colorOf) {
    const { buckets, since_ms: since } = history;
    const values = history.data.map((s) => s[metric.key]);
    const max = Math.max(0, ...values.flat().filter((v) => v !== null));
    const top = niceTop(max);
    const plotW = WIDTH - PAD.left - PAD.right;
    const plotH = HEIGHT - PAD.top - PAD.bottom;
    const x = (i) => PAD.left + (buckets > 1 ? (i / (buckets - 1)) * plotW : plotW / 2);
    const y = (v) => PAD.top + plotH - (v / top) * plotH;

    const chart = svg("svg", {
      viewBox: `0 0 ${WIDTH} ${HEIGHT}`,
      class: "plot",
      role: "img",
      "aria-label": `${metric.title}, ${metric.unit}`,
      "data-testid": "history-plot",
      "data-metric": metric.key,
      "data-max": max,
    });
    for (const fraction of [0, 0.5, 1]) {
      const at = y(top * fraction);
      chart.append(svg("line", { x1: PAD.left, x2: WIDTH - PAD.right, y1: at, y2: at, class: "grid-line" }));
      chart.append(svg("text", { x: PAD.left - 4, y: at + 3, class: "axis axis-y" }, label(top * fraction)));
    }
    chart.append(svg("text", { x: PAD.left, y: HEIGHT - 4, class: "axis" }, clock(since)));
    chart.append(
      svg("text", { x: WIDTH - PAD.right, y: HEIGHT - 4, class: "axis axis-end" }, clock(history.until_ms)),
    );
    history.data.forEach((series, n) => {
      const points = values[n].filter((v) => v !== null && v !== undefined).length;
      if (!points) return;
      chart.append(
        svg("path", {
          d: pathOf(values[n], x, y),
          class: "line",
          stroke: colorOf(series),
          "data-testid": "history-line",
          "data-series": `${series.model}/${series.provider_id}`,
          "data-points": points,
        }),
      );
    });
    const card = html("figure", "plot-card");
    const caption = html("figcaption", "", metric.title);
    caption.append(html("span", "muted small", ` ${metric.unit}`));
    card.append(caption, chart);
    return card;
  }

  function legend(history, colorOf) {
    const list = html("div", "legend");
    list.dataset.testid = "history-legend";
    for (const series of history.data) {
      const item = html("span", "legend-item");
      const swatch = svg("svg", { viewBox: "0 0 10 10", class: "swatch" });
      swatch.append(svg("rect", { width: 10, height: 10, fill: colorOf(series) }));
      item.append(swatch, `${series.model} · ${series.provider_id || "no provider"}`);
      list.append(item);
    }
    if (!history.data.length) list.append(html("span", "muted", "No runs in this range yet."));
    return list;
  }

  function render(container, history) {
    const colors = new Map();
    const colorOf = (series) => {
      const id = `${series.model}/${series.provider_id}`;
      if (!colors.has(id)) colors.set(id, COLORS[colors.size % COLORS.length]);
      return colors.get(id);
    };
    history.data.forEach(colorOf); // the legend's order: the series' (model, provider)
    const grid = html("div", "plots");
    grid.append(...METRICS.map((metric) => plot(metric, history, colorOf)));
    container.replaceChildren(legend(history, colorOf), grid);
  }

  return { render };
})();
