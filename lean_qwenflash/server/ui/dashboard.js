// The lean-qwenflash dashboard: polls /v1/stats, keeps a short history, draws on <canvas>.
// No libraries, no build step. Each chart records how much it drew (data-points / data-cells /
// data-bars) so a headless browser test can check that the charts have data.
"use strict";

const POLL_MS = 1000;
const HISTORY = 300;                      // polls kept (5 minutes at 1 s)
const COLORS = { a: "#4fb3ff", b: "#ffb347", c: "#7ddc7d", d: "#ff6b6b", grid: "#2a3642", text: "#8a96a3" };
const polls = [];
const key = new URLSearchParams(location.hash.slice(1)).get("key");

function fmtBytes(n) {
  if (n == null) return "–";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${u[i]}`;
}
const pct = (x) => (x == null || isNaN(x) ? "–" : `${(100 * x).toFixed(1)}%`);
const num = (x, d = 1) => (x == null || isNaN(x) ? "–" : Number(x).toFixed(d));

// A canvas sized to its CSS box at the device's pixel ratio; returns [ctx, width, height].
function surface(canvas) {
  const r = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || 400, h = canvas.clientHeight || 200;
  canvas.width = Math.round(w * r); canvas.height = Math.round(h * r);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(r, 0, 0, r, 0, 0);
  ctx.clearRect(0, 0, w, h);
  ctx.font = "11px system-ui, sans-serif";
  return [ctx, w, h];
}

function empty(ctx, w, h, text) {
  ctx.fillStyle = COLORS.text;
  ctx.textAlign = "center";
  ctx.fillText(text, w / 2, h / 2);
}

// series: [{label, color, points: [[t, y], ...]}]; hline: {y, label, color}
function lineChart(canvas, series, opts = {}) {
  const [ctx, w, h] = surface(canvas);
  const pts = series.flatMap((s) => s.points);
  canvas.dataset.points = String(pts.length);
  if (!pts.length) { empty(ctx, w, h, opts.empty || "no data yet"); return; }
  const L = 48, R = 10, T = 18, B = 22;
  let t0 = Math.min(...pts.map((p) => p[0])), t1 = Math.max(...pts.map((p) => p[0]));
  if (t1 - t0 < 10) { t0 = t1 - 10; }
  const ymax = Math.max(...pts.map((p) => p[1]), opts.hline ? opts.hline.y : 0, opts.minY || 1e-9) * 1.1;
  const x = (t) => L + ((t - t0) / (t1 - t0)) * (w - L - R);
  const y = (v) => h - B - (v / ymax) * (h - T - B);
  ctx.strokeStyle = COLORS.grid; ctx.fillStyle = COLORS.text; ctx.lineWidth = 1; ctx.textAlign = "right";
  for (let i = 0; i <= 4; i++) {
    const v = (ymax * i) / 4, yy = y(v);
    ctx.beginPath(); ctx.moveTo(L, yy); ctx.lineTo(w - R, yy); ctx.stroke();
    ctx.fillText(v >= 100 ? v.toFixed(0) : v.toPrecision(2), L - 4, yy + 4);
  }
  ctx.textAlign = "center";
  ctx.fillText(`${Math.round(t1 - t0)} s`, (L + w - R) / 2, h - 6);
  if (opts.hline) {
    ctx.strokeStyle = opts.hline.color; ctx.setLineDash([5, 4]);
    ctx.beginPath(); ctx.moveTo(L, y(opts.hline.y)); ctx.lineTo(w - R, y(opts.hline.y)); ctx.stroke();
    ctx.setLineDash([]); ctx.fillStyle = opts.hline.color; ctx.textAlign = "left";
    ctx.fillText(opts.hline.label, L + 4, y(opts.hline.y) - 4);
  }
  let lx = L + 4;
  for (const s of series) {
    ctx.strokeStyle = s.color; ctx.fillStyle = s.color; ctx.lineWidth = 2;
    ctx.beginPath();
    s.points.forEach((p, i) => (i ? ctx.lineTo(x(p[0]), y(p[1])) : ctx.moveTo(x(p[0]), y(p[1]))));
    ctx.stroke();
    for (const p of s.points) { ctx.beginPath(); ctx.arc(x(p[0]), y(p[1]), 2.5, 0, 7); ctx.fill(); }
    ctx.textAlign = "left"; ctx.fillText(s.label, lx, 12); lx += ctx.measureText(s.label).width + 16;
  }
}

// Rows: layers; columns: [since start, then each poll interval with lookups]; colour: hit rate.
function heatmap(canvas, layers, columns) {
  const [ctx, w, h] = surface(canvas);
  let cells = 0;
  if (!layers.length || !columns.length) { canvas.dataset.cells = "0"; empty(ctx, w, h, "no expert lookups yet"); return; }
  const L = 56, R = 40, T = 6, B = 18;
  const cw = (w - L - R) / 60, ch = (h - T - B) / layers.length;      // 60 columns across
  const cols = columns.length > 60 ? [columns[0], ...columns.slice(-59)] : columns;
  const color = (v) => `hsl(${Math.round(120 * v)}, 70%, ${30 + 20 * v}%)`;
  cols.forEach((col, ci) => {
    layers.forEach((layer, li) => {
      const v = col[layer];
      if (v == null) return;
      ctx.fillStyle = color(v);
      ctx.fillRect(L + ci * cw, T + li * ch, Math.max(1, cw - 1), Math.max(1, ch - 1));
      cells++;
    });
  });
  ctx.fillStyle = COLORS.text; ctx.textAlign = "right";
  const every = Math.ceil(layers.length / Math.max(1, Math.floor((h - T - B) / 12)));
  layers.forEach((layer, li) => { if (li % every === 0) ctx.fillText(`layer ${layer}`, L - 4, T + li * ch + ch / 2 + 4); });
  for (let i = 0; i <= 4; i++) {                       // legend: 0% .. 100%
    ctx.fillStyle = color(i / 4);
    ctx.fillRect(w - R + 8, T + (1 - i / 4) * (h - T - B - 10), 12, 10);
  }
  ctx.fillStyle = COLORS.text; ctx.textAlign = "left";
  ctx.fillText("100%", w - R + 4, T - 1 + 22); ctx.fillText("0%", w - R + 8, h - B + 10);
  ctx.textAlign = "center"; ctx.fillText("since start | per interval →", (L + w - R) / 2, h - 4);
  canvas.dataset.cells = String(cells);
}

// bars: [{label, used, pinned, slots, bytes}]
function bars(canvas, items) {
  const [ctx, w, h] = surface(canvas);
  canvas.dataset.bars = String(items.length);
  if (!items.length) { empty(ctx, w, h, "experts are resident: no caches"); return; }
  const L = 70, R = 10, rowH = Math.min(50, (h - 10) / items.length);
  items.forEach((it, i) => {
    const y0 = 8 + i * rowH, bw = w - L - R, bh = rowH * 0.5;
    ctx.fillStyle = COLORS.grid; ctx.fillRect(L, y0, bw, bh);
    ctx.fillStyle = COLORS.a; ctx.fillRect(L, y0, (bw * it.used) / it.slots, bh);
    ctx.fillStyle = COLORS.b; ctx.fillRect(L, y0, (bw * it.pinned) / it.slots, bh);
    ctx.fillStyle = COLORS.text; ctx.textAlign = "right"; ctx.fillText(it.label, L - 6, y0 + bh / 2 + 4);
    ctx.textAlign = "left";
    ctx.fillText(`${it.used} / ${it.slots} slots used (${pct(it.used / it.slots)}), ${it.pinned} pinned, ` +
                 `${fmtBytes(it.bytes)}`, L, y0 + bh + 13);
  });
}

function rate(a, b, f) {                               // per-second change of f between two polls
  const dt = b.time - a.time;
  return dt > 0 ? (f(b) - f(a)) / dt : null;
}

function render() {
  const last = polls[polls.length - 1];
  if (!last) return;
  const $ = (id) => document.getElementById(id);
  const s = last.stats, tok = s.tokens, ex = s.experts;
  const decode = s.series.decode.filter((d) => d[2] > 0).map((d) => [d[0], d[1] / d[2]]);
  const ttft = s.series.ttft.map((d) => [d[0], d[1]]);
  $("tile-active").textContent = s.requests.active;
  $("tile-queued").textContent = s.requests.queued;
  $("tile-tps").textContent = decode.length ? num(decode[decode.length - 1][1]) : "–";
  $("tile-ttft").textContent = ttft.length ? `${num(ttft[ttft.length - 1][1], 2)} s` : "–";
  $("tile-hit").textContent = ex ? pct(ex.total.hit_rate) : "resident";
  const reused = tok.prefill_reused, computed = tok.prefill_computed;
  $("tile-prefix").textContent = reused + computed ? pct(reused / (reused + computed)) : "–";

  lineChart($("chart-tps"), [{ label: "decode tok/s", color: COLORS.a, points: decode }], { empty: "no finished generation yet" });
  lineChart($("chart-ttft"), [{ label: "TTFT s", color: COLORS.b, points: ttft }], { empty: "no finished generation yet" });

  const io = [];
  for (let i = 1; i < polls.length; i++) {
    const r = rate(polls[i - 1], polls[i], (p) => (p.stats.experts ? p.stats.experts.total.bytes_read : 0));
    if (r != null) io.push([polls[i].time, r / 1e6]);
  }
  const disk = s.disk_gbps;
  lineChart($("chart-io"), [{ label: "read MB/s", color: COLORS.c, points: io }],
            { hline: disk ? { y: disk * 1000, label: `disk ${num(disk, 2)} GB/s (measured)`, color: COLORS.d } : null,
              empty: "waiting for a second poll" });

  const layers = ex ? Object.keys(ex.layers).map(Number).sort((a, b) => a - b) : [];
  const columns = [];
  if (ex) {
    const all = {};
    for (const l of layers) {
      const c = ex.layers[l];
      if (c.lookups) all[l] = (c.hits_host + c.hits_device) / c.lookups;
    }
    columns.push(all);
    for (let i = 1; i < polls.length; i++) {
      const a = polls[i - 1].stats.experts, b = polls[i].stats.experts, col = {};
      let any = false;
      for (const l of layers) {
        const ca = a.layers[l], cb = b.layers[l], n = cb.lookups - ca.lookups;
        if (n > 0) { col[l] = (cb.hits_host + cb.hits_device - ca.hits_host - ca.hits_device) / n; any = true; }
      }
      if (any) columns.push(col);
    }
  }
  heatmap($("heatmap"), layers, columns);

  const caches = Object.entries(s.caches || {}).map(([name, c]) => ({ label: name, ...c }));
  bars($("chart-caches"), caches);

  lineChart($("chart-requests"), [
    { label: "active", color: COLORS.a, points: polls.map((p) => [p.time, p.stats.requests.active]) },
    { label: "queued", color: COLORS.b, points: polls.map((p) => [p.time, p.stats.requests.queued]) },
  ], { minY: 1 });

  const rows = [
    ["uptime", `${num(s.uptime_s, 0)} s`],
    ["prompt tokens / generated", `${tok.prompt} / ${tok.generated}`],
    ["decode rate (all generations)", tok.decode_seconds ? `${num(tok.decode / tok.decode_seconds)} tok/s` : "–"],
    ["prefix cache", `${s.prefix_cache.entries} snapshots, ${fmtBytes(s.prefix_cache.bytes)}; ` +
                     `${reused} prompt tokens reused, ${computed} computed`],
    ["requests cancelled / refused (429)", `${s.requests.cancelled} / ${s.requests.rejected}`],
  ];
  if (ex) {
    const t = ex.total;
    rows.push(["expert lookups", `${t.lookups} (host hits ${t.hits_host}, device hits ${t.hits_device}, misses ${t.misses})`],
              ["expert bytes read", `${fmtBytes(t.bytes_read)} at ${num(t.read_gbps, 2)} GB/s per read`],
              ["stall", `${num(t.stall_time_s, 3)} s`],
              ["disk (measured)", disk ? `${num(disk, 2)} GB/s` : "measuring…"]);
  }
  $("summary").tBodies[0].innerHTML = rows.map(([k, v]) => `<tr><td>${k}</td><td>${v}</td></tr>`).join("");
}

async function poll() {
  const status = document.getElementById("status");
  try {
    const r = await fetch("/v1/stats", { headers: key ? { Authorization: `Bearer ${key}` } : {}, cache: "no-store" });
    if (!r.ok) throw new Error(r.status === 401 ? "401: open /ui#key=YOUR_KEY" : `HTTP ${r.status}`);
    const stats = await r.json();
    polls.push({ time: stats.time, stats });
    if (polls.length > HISTORY) polls.shift();
    status.textContent = `live · ${new Date(stats.time * 1000).toLocaleTimeString()}`;
    status.className = "status ok";
    render();
  } catch (e) {
    status.textContent = `cannot read /v1/stats: ${e.message}`;
    status.className = "status err";
  }
}

window.addEventListener("resize", render);
poll();
setInterval(poll, POLL_MS);
