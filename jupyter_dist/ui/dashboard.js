// jupyter-dist live dashboard (anywidget front-end).
//
// plotly.js is loaded once per page: from the kernel's single PlotlyLibrary widget (its bytes arrive once per
// kernel), evaluated as a CommonJS module and cached on globalThis, so ten dashboards cost one copy.
// Whole figures arrive as state (line_figs, small_figs); new points arrive as "extend" messages with float64
// buffers and are applied with one Plotly.extendTraces per figure per animation frame.

function bytesOf(value) {
  if (value instanceof DataView) return new Uint8Array(value.buffer, value.byteOffset, value.byteLength);
  if (value instanceof ArrayBuffer) return new Uint8Array(value);
  if (ArrayBuffer.isView(value)) return new Uint8Array(value.buffer, value.byteOffset, value.byteLength);
  return null;
}

function loadPlotly(model) {
  if (globalThis.Plotly && globalThis.Plotly.extendTraces) return Promise.resolve(globalThis.Plotly);
  if (!globalThis.__jdPlotly) {
    globalThis.__jdPlotly = (async () => {
      const lib = await model.widget_manager.get_model(model.get("lib"));
      const bytes = bytesOf(lib.get("src"));
      if (!bytes || bytes.length === 0) throw new Error("plotly.js was not sent by the kernel");
      const text = new TextDecoder().decode(bytes);
      const module = { exports: {} };
      new Function("module", "exports", text)(module, module.exports);
      return module.exports;
    })();
    globalThis.__jdPlotly.catch(() => {
      globalThis.__jdPlotly = null;
    });
  }
  return globalThis.__jdPlotly;
}

const DASH = { solid: "solid", dot: "dot", dash: "dash" };

function baseLayout(fig) {
  return {
    title: { text: fig.title, font: { size: 13 }, x: 0.02, xanchor: "left" },
    margin: { l: 55, r: 12, t: 34, b: 64 },
    height: 280,
    autosize: true,
    font: { size: 11 },
    legend: { orientation: "h", y: -0.32, yanchor: "top", font: { size: 10 } },
    showlegend: true,
    paper_bgcolor: "rgba(0,0,0,0)",
    plot_bgcolor: "rgba(0,0,0,0)",
    xaxis: { title: { text: fig.x_title || "" }, automargin: true, gridcolor: "rgba(128,128,128,0.2)" },
    yaxis: { title: { text: fig.y_title || "" }, automargin: true, gridcolor: "rgba(128,128,128,0.2)" },
  };
}

function hlineShapes(layout, hlines) {
  layout.shapes = [];
  layout.annotations = layout.annotations || [];
  for (const h of hlines || []) {
    layout.shapes.push({
      type: "line", xref: "paper", x0: 0, x1: 1, y0: h.y, y1: h.y,
      line: { color: h.color || "#888", dash: DASH[h.dash] || "dash", width: 1.5 },
    });
    layout.annotations.push({
      xref: "paper", x: 1, y: h.y, xanchor: "right", yanchor: "bottom", showarrow: false,
      text: h.name, font: { size: 10, color: h.color || "#888" },
    });
  }
}

function toPlotly(fig) {
  const layout = baseLayout(fig);
  let data = [];
  if (fig.kind === "line") {
    data = fig.traces.map((t) => ({
      type: "scatter", mode: "lines", name: t.name,
      // copies: Plotly keeps these arrays, and flush() pushes new points into the figure dict's own arrays
      x: t.x.slice(), y: t.y.map((v) => (v === null ? NaN : v)), opacity: t.opacity,
      line: { color: t.color, width: t.width, dash: DASH[t.dash] || "solid" },
    }));
    if (fig.y_log) layout.yaxis.type = "log";
    // steps and "time since start" both begin at 0: keep 0 in view, so a short run's points (a few ms apart)
    // do not autoscale into a microsecond-wide axis, and startup time shows as what it is
    layout.xaxis.autorangeoptions = { include: [0] };
    hlineShapes(layout, fig.hlines);
    for (const v of fig.vlines || []) {
      layout.shapes.push({ type: "line", yref: "paper", y0: 0, y1: 1, x0: v.x, x1: v.x,
                           line: { color: v.color || "#6a1b9a", dash: "dash", width: 1.5 } });
      layout.annotations.push({ yref: "paper", y: 1, x: v.x, xanchor: "left", yanchor: "top", showarrow: false,
                                text: v.name, font: { size: 10, color: v.color || "#6a1b9a" } });
    }
    layout.showlegend = data.length > 1;
  } else if (fig.kind === "bar") {
    data = fig.series.map((s) => ({
      type: "bar", name: s.name, x: fig.categories, y: s.values,
      marker: { color: fig.bar_colors && fig.series.length === 1 ? fig.bar_colors : s.color },
      text: fig.labels && fig.series.length === 1 ? fig.labels : undefined,
      textposition: "auto", cliponaxis: false,
    }));
    layout.barmode = "group";
    layout.showlegend = data.length > 1;
    hlineShapes(layout, fig.hlines);
    if (fig.labels && fig.series.length > 1) {
      layout.annotations = (layout.annotations || []).concat(fig.categories.map((c, i) => ({
        x: c, y: 0, yanchor: "bottom", showarrow: false, text: fig.labels[i] || "", font: { size: 9 },
      })));
    }
  } else if (fig.kind === "heatmap") {
    data = [{ type: "heatmap", x: fig.x, y: fig.y, z: fig.z, colorscale: "Viridis",
              colorbar: { title: { text: fig.z_title || "" }, thickness: 10 } }];
    layout.showlegend = false;
  }
  const empty = fig.kind === "line" ? fig.traces.every((t) => t.x.length === 0)
    : fig.kind === "bar" ? fig.series.every((s) => s.values.every((v) => v === null))
    : fig.z.length === 0 || fig.z.every((row) => row.length === 0);
  if (empty && fig.note) {
    layout.annotations = (layout.annotations || []).concat([{
      xref: "paper", yref: "paper", x: 0.5, y: 0.5, showarrow: false, text: fig.note, font: { size: 11, color: "#888" },
    }]);
  }
  return { data, layout };
}

const CSS = `
.jd-dash { width: 100%; box-sizing: border-box; font-family: var(--jp-ui-font-family, sans-serif); }
.jd-dash .jd-status-wrap { font-size: 12px; padding: 2px 4px 4px 4px; }
.jd-dash .jd-grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(340px, 1fr)); gap: 6px; }
.jd-dash .jd-panel { min-width: 0; border: 1px solid rgba(128,128,128,0.25); border-radius: 4px; }
.jd-dash .jd-loading { color: #888; font-size: 12px; padding: 4px; }
`;

async function render({ model, el }) {
  el.classList.add("jd-dash");
  const style = document.createElement("style");
  style.textContent = CSS;
  const status = document.createElement("div");
  status.className = "jd-status-wrap";
  const grid = document.createElement("div");
  grid.className = "jd-grid";
  const loading = document.createElement("div");
  loading.className = "jd-loading";
  loading.textContent = "loading plotly.js...";
  el.append(style, status, loading, grid);

  const showStatus = () => { status.innerHTML = model.get("status_html") || ""; };
  showStatus();
  model.on("change:status_html", showStatus);

  let Plotly;
  try {
    Plotly = await loadPlotly(model);
  } catch (err) {
    loading.textContent = "jupyter-dist: could not load plotly.js (" + err + ")";
    return () => {};
  }
  loading.remove();

  const divs = {};
  const figs = {};
  const config = { responsive: true, displaylogo: false, modeBarButtonsToRemove: ["lasso2d", "select2d"] };
  const order = () => model.get("layout_ids") || [];

  function panel(id) {
    if (!divs[id]) {
      const d = document.createElement("div");
      d.className = "jd-panel";
      d.dataset.figure = id;
      divs[id] = d;
      const ids = order();
      const after = ids.slice(ids.indexOf(id) + 1).map((k) => divs[k]).find((x) => x && x.parentNode === grid);
      grid.insertBefore(d, after || null);
    }
    return divs[id];
  }

  function draw(fig) {
    figs[fig.id] = fig;
    const { data, layout } = toPlotly(fig);
    Plotly.react(panel(fig.id), data, layout, config);
  }

  let queue = [];
  let scheduled = false;
  function flush() {
    scheduled = false;
    const batches = {};
    for (const [msg, buffers] of queue) {
      const fig = figs[msg.fig];
      if (!fig || fig.kind !== "line") continue;
      const b = (batches[msg.fig] = batches[msg.fig] || {});
      msg.traces.forEach((trace, i) => {
        const x = new Float64Array(bytesOf(buffers[2 * i]).slice().buffer);
        const y = new Float64Array(bytesOf(buffers[2 * i + 1]).slice().buffer);
        const cur = (b[trace] = b[trace] || { x: [], y: [] });
        cur.x.push(...x);
        cur.y.push(...y);
        // keep the figure dict current too, for redraws after a resize or a state refresh
        if (fig.traces[trace]) {
          fig.traces[trace].x.push(...x);
          fig.traces[trace].y.push(...Array.from(y, (v) => (Number.isNaN(v) ? null : v)));
        }
      });
    }
    queue = [];
    for (const [id, b] of Object.entries(batches)) {
      const idx = Object.keys(b).map(Number);
      if (!idx.length || !divs[id]) continue;
      Plotly.extendTraces(divs[id], { x: idx.map((i) => b[i].x), y: idx.map((i) => b[i].y) }, idx);
    }
    el.dataset.extends = String(Number(el.dataset.extends || 0) + Object.keys(batches).length);
  }

  function onMsg(msg, buffers) {
    if (!msg || msg.type !== "extend") return;
    queue.push([msg, buffers]);
    if (!scheduled) {
      scheduled = true;
      requestAnimationFrame(flush);
    }
  }

  function drawLines() {
    const lines = model.get("line_figs") || [];
    const ids = new Set(lines.map((f) => f.id));
    queue = queue.filter(([msg]) => !ids.has(msg.fig)); // the state already holds those points
    for (const f of lines) draw(JSON.parse(JSON.stringify(f)));
  }
  function drawSmall() {
    for (const f of model.get("small_figs") || []) draw(f);
  }

  drawLines();
  drawSmall();
  model.on("change:line_figs", drawLines);
  model.on("change:small_figs", drawSmall);
  model.on("msg:custom", onMsg);
  el.dataset.ready = "1";

  return () => {
    model.off("change:status_html", showStatus);
    model.off("change:line_figs", drawLines);
    model.off("change:small_figs", drawSmall);
    model.off("msg:custom", onMsg);
    for (const d of Object.values(divs)) Plotly.purge(d);
  };
}

export default { render };
