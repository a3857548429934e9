// Colibri Edge dashboard: polls /v1/dashboard/state and draws each model's numbers, routing heat map
// (a canvas cell per (MoE layer, expert), brightness = routing count) and memory bar. No libraries,
// nothing fetched but this server's own API. ?interval=MS sets the polling period (default 1000).
"use strict";
const KEY = "colibri-api-key";
const interval = Number(new URLSearchParams(location.search).get("interval")) || 1000;
const cards = {};
let timer = null;

function headers(extra) {
  const h = Object.assign({}, extra || {});
  const key = sessionStorage.getItem(KEY);
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n) + " " + u[i];
}
const num = (x, d) => (x === null || x === undefined) ? "–" : Number(x).toFixed(d || 0);
const ms = (s) => (s === null || s === undefined) ? "–" : (s * 1000).toFixed(1) + " ms";

function askKey(wrong) {
  const f = document.getElementById("key-form");
  f.hidden = false;
  document.getElementById("status").textContent = wrong ? "the API key was refused: enter it again" : "needs the API key";
  document.getElementById("api-key").focus();
}

async function api(path, opts) {
  const r = await fetch(path, Object.assign({}, opts, { headers: headers(opts && opts.headers) }));
  if (r.status === 401) { stop(); askKey(true); throw new Error("unauthorized"); }
  return r;
}

function drawHeat(canvas, heat) {
  const L = heat.counts.length, E = heat.experts || 0;
  const w = Math.max(3, Math.min(16, Math.floor(480 / Math.max(E, 1))));
  const h = Math.max(3, Math.min(16, Math.floor(240 / Math.max(L, 1))));
  canvas.width = w * E; canvas.height = h * L;
  canvas.dataset.cellW = w; canvas.dataset.cellH = h;
  const ctx = canvas.getContext("2d");
  let max = 0;
  for (const row of heat.counts) for (const c of row) max = Math.max(max, c);
  canvas.dataset.max = max;
  for (let j = 0; j < L; j++) {
    for (let e = 0; e < E; e++) {
      const v = max ? heat.counts[j][e] / max : 0;
      ctx.fillStyle = `rgb(${Math.round(28 + 227 * v)},${Math.round(35 + 165 * v)},${Math.round(43 + 20 * v)})`;
      ctx.fillRect(e * w, j * h, w - 1, h - 1);
    }
  }
  canvas.title = `${L} MoE layers (rows: ${heat.layers.join(", ")}) x ${E} experts, ${heat.tokens} tokens`;
}

const PARTS = [["weights", "#4f8fd6"], ["slots", "#d69a4f"], ["kv", "#5fb86a"], ["arena", "#a46fd1"]];

function drawMemory(box, mem) {
  // against the engine's --memory-budget when it has one, else against what it holds plus what is free
  const held = mem.weights + mem.slots + mem.kv + mem.arena;
  const total = Math.max(mem.budget ? Math.max(mem.budget, held) : held + mem.available, 1);
  const bar = box.querySelector(".membar"), legend = box.querySelector(".legend");
  bar.replaceChildren(); legend.replaceChildren();
  for (const [k, color] of PARTS) {
    const s = el("span", { title: `${k} ${bytes(mem[k])}` });
    s.style.width = (100 * mem[k] / total) + "%"; s.style.background = color;
    if (mem[k] > 0) s.style.minWidth = "3px";       // a part too small for the scale stays visible
    bar.append(s);
    const l = el("span"); const i = el("i"); i.style.background = color;
    l.append(i, `${k} ${bytes(mem[k])}`); legend.append(l);
  }
  legend.append(el("span", {}, (mem.budget ? `budget ${bytes(mem.budget)}; ` : "") +
                              `free ${bytes(mem.available)} (${mem.available_limit}); weights ${mem.weights_where}`));
}

const PHASE_COLORS = { attention: "#5aa9e6", experts: "#f2a541", lm_head: "#9b7fd1", other: "#6c7a89",
                       host: "#e15554" };

function drawPhases(div, step) {                  // the step-time breakdown: a bar of phases and their ms
  div.replaceChildren();
  const p = step.phases;
  if (!p || !p.phases_ms) { div.textContent = "step-time breakdown: " + (step.phases_note || "no steps yet"); return; }
  const total = Object.values(p.phases_ms).reduce((a, b) => a + b, 0) || 1;
  const bar = el("div", { class: "membar phase-bar" }), legend = el("div", { class: "legend" });
  for (const [k, v] of Object.entries(p.phases_ms)) {
    const s = el("span", { title: `${k} ${v.toFixed(3)} ms` });
    s.style.width = (100 * v / total) + "%"; s.style.background = PHASE_COLORS[k] || "#888";
    bar.append(s);
    const l = el("span"); const i = el("i"); i.style.background = PHASE_COLORS[k] || "#888";
    l.append(i, `${k} ${v.toFixed(3)} ms`); legend.append(l);
  }
  div.append(`step time by phase (median of ${p.decode_steps} decode steps, ${p.step_ms.toFixed(3)} ms a step)`,
             bar, legend);
}

const FIELDS = [
  ["tokens_in", "tokens in", (m) => num(m.tokens_in)], ["tokens_out", "tokens out", (m) => num(m.tokens_out)],
  ["in_per_s", "in tok/s", (m) => num(m.tokens_in_per_s, 1)], ["out_per_s", "out tok/s", (m) => num(m.tokens_out_per_s, 1)],
  ["ttft", "TTFT p50 / p99", (m) => ms(m.ttft_s.p50) + " / " + ms(m.ttft_s.p99)],
  ["itl", "ITL p50 / p99", (m) => ms(m.itl_s.p50) + " / " + ms(m.itl_s.p99)],
  ["queue", "queued", (m) => num(m.queue_depth)], ["running", "running", (m) => num(m.running_requests)],
  ["kv", "KV blocks", (m) => `${num(m.kv_blocks_used)} / ${num(m.kv_blocks_total)}`],
  ["state", "state slots", (m) => `${num(m.state_slots_used)} / ${num(m.state_slots_total)}`],
  ["slots", "expert slots", (m) => m.expert_slots ? `hit ${(100 * m.expert_slots.hit_rate).toFixed(1)}%, ` +
    `${num(m.expert_slots.misses_per_s, 1)} misses/s (${m.expert_slots.slots} slots)` : "all resident"],
  ["read", "read from storage", (m) => m.read_bytes === null ? "– (all resident)" : bytes(m.read_bytes)],
  ["step", "decode step p50 / p99", (m) => m.step.decode_ms.p50 === null ? "–" :
    `${num(m.step.decode_ms.p50, 2)} / ${num(m.step.decode_ms.p99, 2)} ms`],
];

function card(m) {
  if (cards[m.name]) return cards[m.name];
  const box = el("section", { class: "panel model", "data-model": m.name });
  box.append(el("h2", { class: "model-name" }, m.name),
             el("div", { class: "note" }, `${m.model_type} on ${m.backend}`));
  const dl = el("dl", { class: "grid" });
  for (const [key, label] of FIELDS) dl.append(el("dt", {}, label), el("dd", { "data-field": key }));
  box.append(dl, el("div", { class: "note heat-note" }), el("canvas", { class: "heat", width: 0, height: 0 }),
             el("div", { class: "note" }, "memory"), el("div", { class: "membar" }), el("div", { class: "legend note" }),
             el("div", { class: "note phases" }));
  document.getElementById("models").append(box);
  const opt = el("option", { value: m.name }, m.name);
  document.getElementById("chat-model").append(opt);
  cards[m.name] = box;
  return box;
}

function render(state) {
  for (const m of state.models) {
    const box = card(m);
    for (const [key, , fmt] of FIELDS) box.querySelector(`[data-field="${key}"]`).textContent = fmt(m);
    box.querySelector(".heat-note").textContent =
      `routing heat: ${m.heat.layers.length} MoE layers x ${m.heat.experts} experts, last ${m.heat.tokens} tokens`;
    drawHeat(box.querySelector("canvas.heat"), m.heat);
    drawMemory(box, m.memory);
    drawPhases(box.querySelector(".phases"), m.step);
  }
  document.getElementById("status").textContent = "live, " + new Date(state.time * 1000).toLocaleTimeString();
}

async function poll() {
  try {
    const r = await api("/v1/dashboard/state");
    if (!r.ok) throw new Error("state API answered " + r.status);
    render(await r.json());
  } catch (err) {
    if (err.message !== "unauthorized") document.getElementById("status").textContent = "no data: " + err.message;
  }
}

function start() { if (!timer) { poll(); timer = setInterval(poll, interval); } }
function stop() { clearInterval(timer); timer = null; }

document.getElementById("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem(KEY, document.getElementById("api-key").value);
  document.getElementById("key-form").hidden = true;
  start();
});

document.getElementById("chat-send").addEventListener("click", async () => {
  const out = document.getElementById("chat-output");
  out.textContent = "";
  const body = { model: document.getElementById("chat-model").value, stream: true, max_tokens: 64,
                 messages: [{ role: "user", content: document.getElementById("chat-input").value }] };
  try {
    const r = await api("/v1/chat/completions", { method: "POST", body: JSON.stringify(body),
                                                  headers: { "Content-Type": "application/json" } });
    if (!r.ok) { out.textContent = (await r.json()).error.message; return; }
    const reader = r.body.getReader(), dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      const lines = buf.split("\n"); buf = lines.pop();
      for (const line of lines) {
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
        const ev = JSON.parse(line.slice(6));
        if (ev.error) out.textContent += "\n[" + ev.error.message + "]";
        for (const c of ev.choices || []) out.textContent += (c.delta && c.delta.content) || "";
      }
    }
  } catch (err) {
    if (err.message !== "unauthorized") out.textContent = "failed: " + err.message;
  }
});

document.getElementById("trace-file").addEventListener("change", async (ev) => {
  const file = ev.target.files[0], info = document.getElementById("trace-info");
  if (!file) return;
  try {
    const r = await api("/v1/dashboard/trace", { method: "POST", body: file,
                                                 headers: { "Content-Type": "application/octet-stream" } });
    const j = await r.json();
    if (!r.ok) { info.textContent = j.error.message; return; }
    info.textContent = `${file.name}: ${j.model || "?"}, ${j.tokens} tokens, ${j.layers.length} MoE layers x ${j.experts} experts`;
    drawHeat(document.getElementById("trace-heat"), j);
  } catch (err) {
    if (err.message !== "unauthorized") info.textContent = "failed: " + err.message;
  }
});

fetch("/dashboard/config.json").then((r) => r.json()).then((cfg) => {
  if (cfg.auth && !sessionStorage.getItem(KEY)) askKey(false); else start();
});
