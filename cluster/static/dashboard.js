// moeray's live stage page: polls GET /v1/stages and draws one series per stage in each chart.
// Rates (hit rate, tokens/s, step time) are taken between two polls from the stages' cumulative
// counters, as Prometheus' rate() does for the Grafana dashboard; the table shows the totals.
// `window.moerayDashboard` holds the state and the uPlot charts (the tests read it).
"use strict";
(function () {
  const params = new URLSearchParams(location.search);
  const POLL_MS = Math.max(0.25, Number(params.get("every") || 2)) * 1000;
  const KEEP = 900; // points kept per series: 30 minutes at the default 2 s
  const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];
  const color = (i) => COLORS[i % COLORS.length];
  const $ = (id) => document.getElementById(id);

  const state = { polls: 0, failures: 0, lastError: null, nStages: 0, charts: {}, t: [], prev: null,
                  rows: { hit: [], predicted: [], tps: [], step: [], kv: [] } };
  window.moerayDashboard = state;

  // KV use as a fraction of the stage's block pool (/v1/stages: kv = {blocks, used, free, ...}),
  // or null when the server reports no KV blocks.
  function kvUse(s) {
    const kv = s.kv || {};
    return kv.used == null || !kv.blocks ? null : kv.used / kv.blocks;
  }

  const pct = (v) => (v == null || isNaN(v) ? "n/a" : (100 * v).toFixed(1) + "%");
  const num = (v, d = 0) => (v == null || isNaN(v) ? "n/a" : Number(v).toFixed(d));

  function chartOptions(el, series, y) {
    return {
      width: Math.max(300, el.clientWidth - 12), height: 220,
      series: [{}, ...series],
      scales: { x: { time: true }, y: y.range ? { range: y.range } : { auto: true } },
      axes: [{}, { values: (u, vals) => vals.map(y.fmt), size: 56 }],
      legend: { live: true },
    };
  }

  function line(label, i, fmt, dash) {
    return { label, stroke: color(i), width: dash ? 1.5 : 2, dash: dash ? [6, 4] : undefined, spanGaps: true,
             value: (u, v) => (v == null ? "n/a" : fmt(v)) };
  }

  // Build the four charts for `n` stages (again if the stage count changes: a new server).
  function build(n) {
    for (const c of Object.values(state.charts)) c.destroy();
    state.nStages = n;
    state.t = [];
    state.rows = { hit: [], predicted: [], tps: [], step: [], kv: [] };
    for (const k of Object.keys(state.rows)) for (let i = 0; i < n; i++) state.rows[k].push([]);
    const stages = [...Array(n).keys()];
    const pctFmt = (v) => (100 * v).toFixed(0) + "%";
    const mk = (id, series, y) => {
      const el = $(id);
      return new uPlot(chartOptions(el, series, y), [[], ...series.map(() => [])], el);
    };
    state.charts.hit = mk("chart-hit", stages.flatMap((i) => [
      line(`stage ${i} measured`, i, (v) => (100 * v).toFixed(1) + "%", false),
      line(`stage ${i} predicted`, i, (v) => (100 * v).toFixed(1) + "%", true)]), { range: [0, 1], fmt: pctFmt });
    state.charts.tps = mk("chart-tps", stages.map((i) => line(`stage ${i}`, i, (v) => v.toFixed(1), false)),
                          { fmt: (v) => v.toFixed(0) });
    state.charts.step = mk("chart-step", stages.map((i) => line(`stage ${i}`, i, (v) => v.toFixed(1) + " ms", false)),
                           { fmt: (v) => v.toFixed(0) });
    state.charts.kv = mk("chart-kv", stages.map((i) => line(`stage ${i}`, i, (v) => (100 * v).toFixed(1) + "%", false)),
                         { range: [0, 1], fmt: pctFmt });
  }

  function redraw() {
    const r = state.rows;
    const n = state.nStages;
    state.charts.hit.setData([state.t, ...[...Array(n).keys()].flatMap((i) => [r.hit[i], r.predicted[i]])]);
    state.charts.tps.setData([state.t, ...r.tps]);
    state.charts.step.setData([state.t, ...r.step]);
    state.charts.kv.setData([state.t, ...r.kv]);
  }

  function drawSplit(stages) {
    const split = $("split");
    split.replaceChildren(...stages.map((s) => {
      const d = document.createElement("div");
      const [a, b] = s.layers || [0, 0];
      d.style.flex = String(Math.max(1, b - a));
      d.style.background = color(s.stage);
      d.textContent = s.layers ? `stage ${s.stage}: layers ${a}-${b - 1}` : `stage ${s.stage}: not loaded`;
      d.title = `${d.textContent} on ${s.device}`;
      return d;
    }));
  }

  function drawTable(stages) {
    const head = ["stage", "layers", "device", "backend", "hit rate", "predicted", "lookups", "experts held",
                  "steps", "KV use"];
    const rows = stages.map((s) => {
      const c = s.cache || {};
      const sw = `<span class="swatch" style="background:${color(s.stage)}"></span>`;
      return [sw + s.stage, s.layers ? `${s.layers[0]}-${s.layers[1] - 1}` : "-", s.device, s.backend || "-",
              s.cache ? pct(c.hit_rate) : "no cache", pct(s.predicted_hit_rate), num(c.lookups),
              s.cache ? `${c.resident} / ${c.slots} slots` : "-", num(s.steps), pct(kvUse(s))];
    });
    const esc = (v) => String(v).replace(/[&<>]/g, (ch) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;" }[ch]));
    $("stages").innerHTML = "<tr>" + head.map((h, j) => `<th class="${j === 2 || j === 3 ? "text" : ""}">${h}</th>`).join("") + "</tr>" + rows.map((r) =>
      "<tr>" + r.map((v, j) => `<td class="${j === 2 || j === 3 ? "text" : ""}">${j === 0 ? v : esc(v)}</td>`).join("")
      + "</tr>").join("");
  }

  // Tokens generated after each request's first: one per decode row, plus the drafted tokens verify rows kept.
  function generated(e) {
    return e.decode_tokens + (e.accepted_tokens || 0);
  }

  function record(report, now) {
    const stages = report.stages;
    if (stages.length !== state.nStages) {
      build(stages.length);
      state.prev = null;
    }
    const prev = state.prev;
    const dt = prev ? now - prev.t : 0;
    const r = state.rows;
    state.t.push(now);
    stages.forEach((s, i) => {
      const c = s.cache || {};
      const p = prev && prev.stages[i];
      const dLook = p ? (c.lookups || 0) - p.lookups : null;
      const dSteps = p ? s.steps - p.steps : null;
      // Measured: hits over lookups since the last poll (the first poll: since the start).
      r.hit[i].push(!s.cache ? null : p ? (dLook > 0 ? ((c.hits || 0) - p.hits) / dLook : null)
                                        : (c.lookups ? c.hit_rate : null));
      r.predicted[i].push(s.predicted_hit_rate ?? null);
      r.tps[i].push(p && dt > 0 ? Math.max(0, s.tokens_in - p.tokens_in) / dt : null);
      r.step[i].push(p && dSteps > 0 ? (1000 * (s.step_s - p.step_s)) / dSteps : null);
      r.kv[i].push(kvUse(s));
    });
    if (state.t.length > KEEP) {
      state.t.shift();
      for (const k of Object.keys(r)) for (const a of r[k]) a.shift();
    }
    state.prev = { t: now, stages: stages.map((s) => ({ lookups: (s.cache || {}).lookups || 0,
      hits: (s.cache || {}).hits || 0, steps: s.steps, step_s: s.step_s, tokens_in: s.tokens_in })),
      decode: generated(report.engine) };
    const e = report.engine;
    const gen = prev && dt > 0 ? ` · ${((generated(e) - prev.decode) / dt).toFixed(1)} generated tokens/s` : "";
    const sp = report.speculation;
    $("spec").textContent = !sp ? "" : sp.mode === "off" && !sp.verify_rows ? "speculation off"
      : `speculation ${sp.mode} · ${sp.verify_rows ? (100 * sp.acceptance_rate).toFixed(0) : "–"}% of drafted tokens accepted`
        + ` · ${sp.verify_rows ? sp.tokens_per_verify_row.toFixed(2) : "–"} tokens per verify row`;
    $("model").textContent = `${report.model} · context ${report.context} tokens · ${stages.length} stages`;
    $("engine").textContent = `running ${e.running} / ${e.max_seqs} · waiting ${e.waiting}${gen}`;
    $("kv-note").textContent = stages.some((s) => kvUse(s) != null) ? "" : "(n/a: this server reports no KV blocks)";
    drawSplit(stages);
    drawTable(stages);
    redraw();
  }

  async function poll() {
    try {
      const res = await fetch("v1/stages", { credentials: "same-origin", cache: "no-store" });
      if (res.status === 401) throw new Error("401: the API key was not accepted; open /dashboard?key=YOUR_API_KEY");
      if (!res.ok) {
        let why = res.statusText;
        try { why = (await res.json()).error.message; } catch (_) { /* not JSON */ }
        throw new Error(`${res.status}: ${why}`);
      }
      record(await res.json(), Date.now() / 1000);
      state.polls += 1;
      state.lastError = null;
      $("status").className = "";
      $("status").textContent = `updated ${new Date().toLocaleTimeString()} (every ${POLL_MS / 1000} s)`;
    } catch (err) {
      state.failures += 1;
      state.lastError = String(err.message || err);
      $("status").className = "bad";
      $("status").textContent = `no data: ${state.lastError}`;
    } finally {
      setTimeout(poll, POLL_MS);
    }
  }

  window.addEventListener("resize", () => {
    for (const [k, c] of Object.entries(state.charts)) {
      c.setSize({ width: Math.max(300, $("chart-" + k).clientWidth - 12), height: 220 });
    }
  });
  poll();
})();
