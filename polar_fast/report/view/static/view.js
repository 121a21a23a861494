// polar_fast view: three pages over the JSON API of app.py. Plain DOM and hand-written SVG.
"use strict";

const main = document.getElementById("main");
const PAGE_ROWS = 50;
const COLORS = ["#3070d0", "#d0602f", "#3fa66a", "#9b59b6", "#c0392b", "#16a2a2", "#7f8c8d"];

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined) continue;
    if (k === "class") node.className = v; else if (k === "text") node.textContent = v; else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}

async function api(path) {
  const r = await fetch(path, { credentials: "same-origin" });
  const body = await r.json().catch(() => ({ error: `HTTP ${r.status}`, detail: "" }));
  if (!r.ok) throw Object.assign(new Error(body.error || `HTTP ${r.status}`), { detail: body.detail || "" });
  return body;
}

function showError(e) {
  main.replaceChildren(el("div", { class: "error-page" },
    el("h1", { id: "error-title", text: e.message }), el("p", { id: "error-detail", text: e.detail || "" })));
}

function fmt(v, digits = 3) {
  if (v === null || v === undefined) return "–";
  if (typeof v === "number" && !Number.isInteger(v)) return v.toFixed(digits);
  return String(v);
}

function showNotes(run) {
  const notes = document.getElementById("notes");
  notes.replaceChildren();
  document.getElementById("run-dir").textContent = run.run_dir;
  if (run.torn) notes.append(el("div", { class: "note torn", id: "torn-note",
    text: `records.log ends in a torn frame (${run.torn.bytes} bytes: ${run.torn.reason}). ` +
          "Every record before it is shown; the rest is either still being written or was cut off by a crash." }));
  for (const n of run.notes) notes.append(el("div", { class: "note", text: n }));
}

// ------------------------------------------------------------------------------------ run page

const CHARTS = [
  ["reward", "Reward per step", k => /^reward\/(mean|std|group_std_mean)$/.test(k)],
  ["pass", "Held-out pass@k", k => k.includes("pass@") || k === "eval/mean_reward"],
  ["busy", "Pool busy fraction", k => /^pools\/.*\/busy_fraction$/.test(k)],
  ["queues", "Pool queue depth and running", k => /^pools\/.*\/(queued|running)$/.test(k)],
  ["tokens", "Tokens: sampled vs forwarded", k => ["proxy/sampled_tokens", "merge/tokens_forwarded", "proxy/call_tokens"].includes(k)],
  ["staleness", "Staleness", k => k.startsWith("staleness/")],
  ["learner", "Learner", k => ["learner/loss", "learner/grad_norm", "learner/clip_frac", "learner/ratio_mean",
                               "learner/is_weight_mean"].includes(k)],
  ["mismatch", "Engine/learner mismatch, before each update", k => /^learner\/(mismatch_|is_corrected$)/.test(k)],
];

function lineChart(id, title, metrics, keys) {
  const W = 440, H = 190, L = 48, R = 10, T = 10, B = 24;
  const steps = metrics.map(m => m.step);
  const values = keys.flatMap(k => metrics.filter(m => k in m).map(m => m[k]));
  let lo = Math.min(0, ...values), hi = Math.max(...values);
  if (hi === lo) hi = lo + 1;
  const s0 = Math.min(...steps), s1 = Math.max(...steps);
  const x = s => s1 === s0 ? L + (W - L - R) / 2 : L + (s - s0) / (s1 - s0) * (W - L - R);
  const y = v => T + (1 - (v - lo) / (hi - lo)) * (H - T - B);
  const plot = svg("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}` });
  plot.append(svg("line", { x1: L, y1: T, x2: L, y2: H - B, stroke: "#999" }),
              svg("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#999" }));
  for (const [v, yy] of [[hi, y(hi)], [lo, y(lo)]]) {
    const t = svg("text", { x: L - 4, y: yy + 3, "text-anchor": "end" }); t.textContent = fmt(v); plot.append(t);
  }
  for (const s of [...new Set([s0, s1])]) {
    const anchor = s0 === s1 ? "middle" : s === s0 ? "start" : "end";
    const t = svg("text", { x: x(s), y: H - 8, "text-anchor": anchor }); t.textContent = `step ${s}`; plot.append(t);
  }
  const legend = el("div", { class: "legend" });
  keys.forEach((k, i) => {
    const color = COLORS[i % COLORS.length];
    const points = metrics.filter(m => k in m).map(m => [m.step, m[k]]);
    const g = svg("g", { "data-key": k });
    g.append(svg("polyline", { points: points.map(([s, v]) => `${x(s)},${y(v)}`).join(" "), fill: "none", stroke: color, "stroke-width": 1.5 }));
    for (const [s, v] of points) {
      const c = svg("circle", { cx: x(s), cy: y(v), r: 3, fill: color, "data-step": s, "data-value": v });
      const tip = svg("title"); tip.textContent = `${k} at step ${s}: ${v}`; c.append(tip); g.append(c);
    }
    plot.append(g);
    legend.append(el("span", {}, el("i", { style: `background:${color}` }), k));
  });
  return el("figure", { class: "chart", "data-chart": id }, el("figcaption", { text: title }), plot, legend);
}

async function runPage() {
  const run = await api("/api/run");
  showNotes(run);
  const counts = el("table", { id: "outcomes" }, el("tr", {}, el("th", { text: "outcome" }), el("th", { text: "rollouts" })));
  for (const [k, v] of Object.entries(run.outcomes)) counts.append(el("tr", { "data-outcome": k }, el("td", { text: k }), el("td", { class: "num", text: v })));
  const charts = el("div", { class: "charts", id: "charts" });
  const keys = [...new Set(run.metrics.flatMap(m => Object.keys(m)))].filter(k => k !== "step").sort();
  for (const [id, title, pick] of CHARTS) {
    const mine = keys.filter(pick);
    if (mine.length) charts.append(lineChart(id, title, run.metrics, mine));
  }
  if (!run.metrics.length) charts.append(el("p", { class: "muted", id: "no-metrics", text: "No steps yet: curves appear after the first learner step." }));
  main.replaceChildren(
    el("h2", { text: `Run: ${run.steps} step(s), ${run.rollouts} rollout(s)` }),
    el("p", { id: "run-state", "data-live": run.live ? 1 : 0, text: run.state }), charts,
    el("h2", { text: "Outcomes" }), counts,
    el("h2", { text: "Config" }), el("details", {}, el("summary", { text: "config.json" }),
      el("pre", { id: "config", text: run.config ? JSON.stringify(run.config, null, 2) : "no config.json" })));
}

// ------------------------------------------------------------------------------- rollouts page

const COLUMNS = [
  ["rollout_id", "rollout"], ["task_id", "task"], ["harness", "harness"], ["reward", "reward"], ["outcome", "outcome"],
  ["n_calls", "calls"], ["sampled_tokens", "sampled tokens"], ["duration_s", "duration s"], ["version_max", "policy versions"],
  ["rendered_calls", "re-rendered calls"],
];

async function rolloutsPage() {
  const params = new URLSearchParams(location.search);
  const state = { offset: +(params.get("offset") || 0), sort: params.get("sort") || "order", desc: params.get("desc") === "1",
                  q: params.get("q") || "", outcome: params.get("outcome") || "" };
  showNotes(await api("/api/run"));
  const go = patch => {
    Object.assign(state, patch);
    const p = new URLSearchParams({ offset: state.offset, sort: state.sort, desc: state.desc ? 1 : 0, q: state.q, outcome: state.outcome });
    history.replaceState(null, "", `/rollouts?${p}`);
    load();
  };
  const q = el("input", { id: "filter", placeholder: "filter: task, harness, rollout or group id", size: 40, value: state.q });
  q.addEventListener("change", () => go({ q: q.value, offset: 0 }));
  const outcome = el("select", { id: "outcome-filter" });
  for (const o of ["", "ok", "agent_error", "timeout", "diff_too_large", "infra_error", "running", "retried", "abandoned"]) outcome.append(el("option", { value: o, text: o || "any outcome" }));
  outcome.value = state.outcome;
  outcome.addEventListener("change", () => go({ outcome: outcome.value, offset: 0 }));
  const info = el("span", { id: "page-info" });
  const prev = el("button", { id: "prev", text: "◀ prev" }), next = el("button", { id: "next", text: "next ▶" });
  prev.onclick = () => go({ offset: Math.max(0, state.offset - PAGE_ROWS) });
  next.onclick = () => go({ offset: state.offset + PAGE_ROWS });
  const table = el("table", { id: "rollouts" });
  main.replaceChildren(el("h2", { text: "Rollouts" }), el("div", { class: "controls" }, q, outcome, prev, next, info), table);

  async function load() {
    const p = new URLSearchParams({ offset: state.offset, limit: PAGE_ROWS, sort: state.sort, desc: state.desc ? 1 : 0, q: state.q, outcome: state.outcome });
    const page = await api(`/api/rollouts?${p}`);
    const head = el("tr");
    for (const [key, label] of COLUMNS) {
      const th = el("th", { "data-sort": key, text: label, class: state.sort === key ? `sorted${state.desc ? "" : " asc"}` : null });
      th.onclick = () => go({ sort: key, desc: state.sort === key ? !state.desc : false, offset: 0 });
      head.append(th);
    }
    const body = [head];
    for (const r of page.rows) {
      const versions = r.version_min === null ? "–" : r.version_min === r.version_max ? `${r.version_min}` : `${r.version_min}–${r.version_max}`;
      body.push(el("tr", { "data-rollout-id": r.rollout_id },
        el("td", {}, el("a", { href: `/rollouts/${encodeURIComponent(r.rollout_id)}`, text: r.rollout_id })),
        el("td", { text: r.task_id || "–" }), el("td", { text: r.harness || "–" }),
        el("td", { class: "num reward", text: fmt(r.reward) }), el("td", { class: "outcome", text: r.outcome, title: r.error || null }),
        el("td", { class: "num", text: r.n_calls }), el("td", { class: "num", text: r.sampled_tokens }),
        el("td", { class: "num", text: fmt(r.duration_s, 1) }), el("td", { class: "num", text: versions }),
        el("td", { class: "num", text: r.rendered_calls })));
    }
    table.replaceChildren(...body);
    const last = Math.min(page.offset + page.rows.length, page.matching);
    info.textContent = `${page.matching ? page.offset + 1 : 0}–${last} of ${page.matching} matching (${page.total} in the run)`;
    info.dataset.total = page.total; info.dataset.matching = page.matching;
    prev.disabled = state.offset === 0; next.disabled = last >= page.matching;
  }
  await load();
}

// -------------------------------------------------------------------------------- rollout page

function messageView(m) {
  const box = el("div", { class: `msg ${m.role}` }, el("span", { class: "role", text: m.role + (m.tool_call_id ? ` (${m.tool_call_id})` : "") }));
  if (m.reasoning) box.append(el("details", { class: "reasoning", open: "" }, el("summary", { text: "reasoning" }), m.reasoning));
  if (m.content) box.append(m.content);
  for (const c of m.tool_calls || []) box.append(el("div", { class: "toolcall", text: `${c.name}(${c.arguments})` }));
  if (m.role === "system") return el("details", { class: "system" }, el("summary", { text: `system prompt (${m.content.length} chars)` }), box);
  return box;
}

function tokenClass(mask, trained) { return mask ? (trained ? "tok trained" : "tok sampled-untrained") : "tok prompt"; }

function heat(v, mode, t) {
  if (mode === "logprob") return t.logprob[v] === null ? "" : `rgba(220,40,40,${Math.min(1, -t.logprob[v] / 4).toFixed(2)})`;
  const key = mode === "version" ? t.version[v] : t.call[v];
  if (mode === "version" && !t.mask[v]) return "";
  return COLORS[((key % COLORS.length) + COLORS.length) % COLORS.length] + "40";
}

function tokensView(t, trained, mode) {
  const box = el("div", { class: "tokens", id: "tokens", "data-layout": t.layout });
  const marks = new Map();
  for (const c of t.calls) for (const p of c.positions || []) marks.set(p, c);
  for (let s = 0; s + 1 < t.offsets.length; s++) {
    const seq = el("div", { class: "seq", "data-seq": s }, el("span", { class: "seq-label", text: `sequence ${s} (${t.offsets[s + 1] - t.offsets[s]} tokens)` }));
    for (let i = t.offsets[s]; i < t.offsets[s + 1]; i++) {
      if (t.layout === "tree" && i > t.offsets[s] && t.parent[i] !== i - 1)
        seq.append(el("span", { class: "branch", text: `\n↳ branch after token ${t.parent[i]}: ` }));
      const c = marks.get(i);
      if (c) seq.append(el("span", { class: "break", "data-cause": c.cause, "data-call": c.call, title: c.break,
        text: `break · call ${c.call}: ${c.cause} (${c.history})` }));
      const span = el("span", { class: tokenClass(t.mask[i], trained) + (t.extra[i] ? " extra" : ""), "data-i": i, "data-id": t.ids[i],
        "data-mask": t.mask[i], "data-call": t.call[i], "data-depth": t.depth[i], "data-version": t.version[i], "data-logprob": t.logprob[i] ?? "",
        title: `#${i} id ${t.ids[i]} · call ${t.call[i]} · ${t.mask[i] ? `sampled, logprob ${t.logprob[i]}, version ${t.version[i]}` : "prompt (mask 0)"}` +
               (t.extra[i] ? ` · sampled ${t.extra[i]} more time(s)` : "") });
      span.textContent = t.text[i];
      const bg = heat(i, mode, t);
      if (bg) span.style.background = bg;
      seq.append(span);
    }
    box.append(seq);
  }
  return box;
}

function callsTable(calls) {
  const table = el("table", { id: "calls" }, el("tr", {}, ...["call", "session#index", "prompt", "sampled", "version", "finish", "proxy prompt", "merge", "what it means"].map(h => el("th", { text: h }))));
  for (const c of calls) table.append(el("tr", { "data-call": c.call, "data-cause": c.cause },
    el("td", { class: "num", text: c.call }), el("td", { text: `${c.session_id.slice(0, 8)}#${c.call_index}` }),
    el("td", { class: "num", text: c.prompt_tokens }), el("td", { class: "num", text: c.sampled_tokens }),
    el("td", { class: "num", text: c.policy_version }), el("td", { text: c.finish_reason }), el("td", { text: c.history }),
    el("td", { text: c.cause }), el("td", { text: c.break || (c.call ? "extends an earlier call" : "first call") })));
  return table;
}

async function rolloutPage(id) {
  showNotes(await api("/api/run"));
  const r = await api(`/api/rollouts/${encodeURIComponent(id)}`);
  const row = r.row, g = r.group;
  const members = el("ul", { id: "group" });
  for (const [rid, reward] of Object.entries(g.rewards)) members.append(el("li", {},
    rid === row.rollout_id ? el("strong", { text: rid }) : el("a", { href: `/rollouts/${encodeURIComponent(rid)}`, text: rid }), `: reward ${fmt(reward)}`));
  const conv = el("div", { id: "conversation" });
  for (const c of r.conversations) {
    conv.append(el("h3", { text: `session ${c.session_id.slice(0, 8)}, ${c.messages.length} messages, tools: ${c.tools.join(", ") || "none"}` }));
    for (const m of c.messages) conv.append(messageView(m));
  }
  if (!r.conversations.length) conv.append(el("p", { class: "muted", text: "no exchanges recorded for this rollout" }));
  const tokenBox = el("div", { id: "token-view" }, el("p", { class: "muted", text: "merging…" }));
  const layoutSel = el("select", { id: "layout" }); for (const l of ["", "tree", "paths"]) layoutSel.append(el("option", { value: l, text: l || "run's layout" }));
  const colorSel = el("select", { id: "color" }); for (const m of ["logprob", "version", "call"]) colorSel.append(el("option", { value: m, text: `heat: ${m}` }));
  main.replaceChildren(
    el("h2", { id: "rollout-title", text: `Rollout ${row.rollout_id}` }),
    el("p", {}, `task ${row.task_id || "–"} · harness ${row.harness || "–"} · outcome `, el("strong", { id: "outcome", text: row.outcome }),
      " · reward ", el("strong", { id: "reward", text: fmt(row.reward) }), ` · ${row.n_calls} calls · ${row.sampled_tokens} sampled tokens · ${fmt(row.duration_s, 1)} s`,
      row.error ? ` · error: ${row.error}` : ""),
    el("p", {}, el("span", { id: "group-status", class: `status ${g.trained ? "trained" : "untrained"}`, "data-trained": g.trained ? 1 : 0, text: `Group ${row.group_id}: ${g.text}` }),
      " ", el("a", { id: "sft", href: `/api/rollouts/${encodeURIComponent(id)}/sft`, download: `${row.rollout_id}.sft.json`, text: "export as SFT JSON" })),
    members,
    el("h2", { text: "Conversation" }), conv,
    el("h2", { text: "Tokens" }), el("div", { class: "controls" }, layoutSel, colorSel,
      el("span", { class: "muted", text: "outlined green: sampled and trained · dashed: sampled, group did not train · grey: prompt (mask 0)" })),
    tokenBox);
  let tokens = null;
  const draw = () => {
    tokenBox.replaceChildren(el("p", { id: "merge-stats", text: `${tokens.tokens} tokens in ${tokens.offsets.length - 1} sequence(s), layout ${tokens.layout}; ` +
      `${tokens.stats.n_samples} sampled; breaks ${tokens.stats.n_breaks} (new_root ${tokens.stats.new_root}, in_completion ${tokens.stats.in_completion}, in_prompt ${tokens.stats.in_prompt}); ` +
      `retries: ${tokens.stats.completion_fork} forks, ${tokens.stats.duplicate} duplicates` }), callsTable(tokens.calls), tokensView(tokens, g.trained, colorSel.value));
  };
  const loadTokens = async () => {
    try {
      tokens = await api(`/api/rollouts/${encodeURIComponent(id)}/tokens` + (layoutSel.value ? `?layout=${layoutSel.value}` : ""));
      draw();
    } catch (e) { tokenBox.replaceChildren(el("p", { class: "note torn", text: `${e.message} ${e.detail}` })); }
  };
  layoutSel.value = new URLSearchParams(location.search).get("layout") || "";
  layoutSel.onchange = loadTokens;
  colorSel.onchange = () => tokens && draw();
  await loadTokens();
}

// ------------------------------------------------------------------------------------- routing

async function route() {
  const path = location.pathname;
  try {
    if (path === "/" || path === "") await runPage();
    else if (path === "/rollouts") await rolloutsPage();
    else if (path.startsWith("/rollouts/")) await rolloutPage(decodeURIComponent(path.slice("/rollouts/".length)));
    else throw Object.assign(new Error(`No page at ${path}`), { detail: "" });
    document.body.dataset.ready = "1";
  } catch (e) {
    showError(e);
    document.body.dataset.ready = "error";
  }
}

route();
