"""The viewer page's HTML shell, CSS and JavaScript, inlined into every page (no network needed)."""

PAGE_TEMPLATE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{{title}}</title>
<style>{{css}}</style>
</head>
<body>
<header id="top"></header>
<main>
  <aside id="side">
    <div id="filters"></div>
    <div id="count"></div>
    <ol id="list"></ol>
  </aside>
  <section id="detail"><p class="empty">Select a trajectory.</p></section>
</main>
<script type="application/json" id="turnrl-data">{{data}}</script>
<script>{{js}}</script>
</body>
</html>
"""

PAGE_CSS = """
:root {
  --bg: #f6f7f9; --panel: #fff; --line: #dde1e6; --text: #1f2328; --muted: #656d76;
  --accent: #0969da; --good: #1a7f37; --bad: #cf222e; --warn: #9a6700;
  --env-bg: #eef0f3; --env-text: #57606a;
  --mono: ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace;
}
* { box-sizing: border-box; }
html, body { height: 100%; margin: 0; }
body {
  display: flex; flex-direction: column; background: var(--bg); color: var(--text);
  font: 14px/1.45 system-ui, -apple-system, "Segoe UI", "DejaVu Sans", sans-serif;
}
header { background: var(--panel); border-bottom: 1px solid var(--line); padding: 10px 16px; }
header h1 { font-size: 17px; margin: 0 8px 6px 0; display: inline-block; }
header .model { color: var(--muted); font-family: var(--mono); font-size: 13px; }
header details { display: inline-block; margin-left: 10px; font-size: 13px; }
header details pre { position: absolute; z-index: 5; max-height: 60vh; overflow: auto; }
main { flex: 1; display: flex; min-height: 0; }
#side {
  width: 370px; flex: none; display: flex; flex-direction: column;
  border-right: 1px solid var(--line); background: var(--panel); min-height: 0;
}
#filters { padding: 10px 12px; border-bottom: 1px solid var(--line); display: grid; gap: 6px; }
#filters label { display: flex; align-items: center; gap: 6px; font-size: 12px; color: var(--muted); }
#filters label > span { width: 62px; flex: none; }
#filters input, #filters select {
  font: inherit; font-size: 13px; padding: 3px 6px; border: 1px solid var(--line);
  border-radius: 5px; background: #fff; min-width: 0; flex: 1;
}
#filters .pair input { width: 70px; }
#filters .checks { gap: 14px; }
#filters .checks input { flex: none; }
#count { padding: 6px 12px; font-size: 12px; color: var(--muted); border-bottom: 1px solid var(--line); }
#list { list-style: none; margin: 0; padding: 0; overflow-y: auto; flex: 1; }
.traj-row {
  padding: 7px 12px; border-bottom: 1px solid #eef0f2; cursor: pointer;
  display: flex; flex-wrap: wrap; gap: 4px 6px; align-items: center;
}
.traj-row:hover { background: #f3f6fa; }
.traj-row.selected { background: #ddf4ff; box-shadow: inset 3px 0 var(--accent); }
.traj-row .tid { font-family: var(--mono); font-weight: 600; font-size: 13px; margin-right: auto; }
.badge {
  display: inline-block; font-size: 11px; padding: 1px 6px; border-radius: 9px;
  background: #eaeef2; color: #424a53; white-space: nowrap;
}
.badge.good { background: #dafbe1; color: var(--good); }
.badge.bad { background: #ffebe9; color: var(--bad); }
.badge.warn { background: #fff8c5; color: var(--warn); }
.badge.info { background: #ddf4ff; color: #0550ae; }
#detail { flex: 1; overflow-y: auto; padding: 14px 20px 40px; min-width: 0; }
.empty { color: var(--muted); }
.chips { display: flex; flex-wrap: wrap; gap: 6px; margin: 4px 0; }
.chip {
  border: 1px solid var(--line); background: var(--panel); border-radius: 6px;
  padding: 2px 8px; font-size: 12px;
}
.chip b { font-weight: 600; margin-left: 3px; }
#detail h2 { font-family: var(--mono); font-size: 18px; margin: 0 0 6px; }
#detail h3 { font-size: 14px; margin: 18px 0 6px; color: #32383f; }
.box {
  background: var(--panel); border: 1px solid var(--line); border-radius: 8px;
  padding: 8px 12px; margin: 8px 0;
}
.error-box { border-color: #ffcecb; background: #fff5f4; color: var(--bad); font-family: var(--mono); }
.fact { max-height: 190px; overflow-y: auto; }
.check-title { margin-right: 8px; }
header .badge { margin-left: 10px; }
.cols { display: grid; grid-template-columns: repeat(auto-fit, minmax(260px, 1fr)); gap: 10px; }
table.kv { border-collapse: collapse; width: 100%; font-size: 12px; }
table.kv td { padding: 2px 6px; border-bottom: 1px solid #f0f2f4; vertical-align: top; }
table.kv td:first-child { color: var(--muted); white-space: nowrap; }
table.kv td:last-child { font-family: var(--mono); word-break: break-word; }
details > summary { cursor: pointer; color: var(--muted); font-size: 12px; }
pre {
  font-family: var(--mono); font-size: 12px; white-space: pre-wrap; word-break: break-word;
  margin: 4px 0; background: #f6f8fa; border: 1px solid #eef0f2; border-radius: 6px; padding: 6px 8px;
}
.check.bad { border-color: #ffcecb; }
.check.ok { border-color: #aceebb; }
.diff .del { color: var(--bad); }
.diff .add { color: var(--good); }
.diff .at { color: #0550ae; }
.msg { border-left: 3px solid var(--line); padding: 2px 10px; margin: 6px 0; }
.msg .role { font-size: 11px; text-transform: uppercase; letter-spacing: .04em; color: var(--muted); }
.msg.system { border-color: #8c959f; }
.msg.user { border-color: #54aeff; }
.msg.assistant { border-color: #4ac26b; }
.msg.tool { border-color: #d4a72c; }
.msg .text { white-space: pre-wrap; word-break: break-word; }
.msg img, .turn img {
  max-width: 360px; max-height: 260px; min-width: 32px; image-rendering: pixelated;
  border: 1px solid var(--line); border-radius: 4px; }
.turn { background: var(--panel); border: 1px solid var(--line); border-radius: 8px; margin: 10px 0; }
.turn.env { background: #fafbfc; }
.turn-head {
  display: flex; flex-wrap: wrap; gap: 6px; align-items: center; padding: 6px 10px;
  border-bottom: 1px solid #eef0f2; font-size: 12px;
}
.turn-head .tname { font-weight: 600; font-size: 13px; margin-right: 6px; }
.turn-body {
  padding: 8px 10px; font-family: var(--mono); font-size: 12.5px; line-height: 1.75;
  white-space: pre-wrap; word-break: break-word;
}
.tok { border-radius: 2px; padding: 1px 0; box-shadow: inset -1px 0 rgba(0, 0, 0, .08); }
.tok-model { color: #111; }
.tok-env, .tok-prompt { background: var(--env-bg); color: var(--env-text); font-style: italic; }
.tok .nl { color: #8c959f; font-style: normal; }
.tok:hover { outline: 1px solid #333; }
.seg { border-radius: 3px; padding: 1px 2px; }
.seg-env { background: var(--env-bg); color: var(--env-text); font-style: italic; }
.legend { display: flex; align-items: center; gap: 8px; font-size: 12px; color: var(--muted); }
.legend .bar { width: 160px; height: 10px; border-radius: 3px; border: 1px solid var(--line); }
.legend .envkey { background: var(--env-bg); color: var(--env-text); font-style: italic; padding: 0 6px; }
.calls { margin: 0 10px 10px; border: 1px solid #f0d48a; background: #fffbef; border-radius: 6px; }
.call { padding: 6px 10px; border-top: 1px solid #f5e3b0; font-size: 12.5px; }
.call:first-child { border-top: none; }
.call .fn { font-family: var(--mono); font-weight: 600; }
.call .args { font-family: var(--mono); color: #32383f; }
.call .result { font-family: var(--mono); white-space: pre-wrap; margin-top: 3px; }
.call .result::before { content: "→ "; color: var(--muted); }
.call .result.missing { color: var(--muted); font-style: italic; }
"""

PAGE_JS = r"""
"use strict";
const DATA = JSON.parse(document.getElementById("turnrl-data").textContent);
const TRAJS = DATA.trajectories;
const TOKENS = DATA.tokens;
const STATE = { selected: null, shown: [] };
const LP_FLOOR = -6;

function h(tag, attrs, ...kids) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "text") el.textContent = value;
    else if (key === "class") el.className = value;
    else if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else if (key === "style") el.style.cssText = value;
    else el.setAttribute(key, value);
  }
  for (const kid of kids.flat(Infinity)) {
    if (kid === null || kid === undefined || kid === false) continue;
    el.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  }
  return el;
}

function fmt(x) {
  if (x === null || x === undefined) return "—";
  if (typeof x === "number") {
    if (Number.isInteger(x)) return String(x);
    return Math.abs(x) >= 100 ? x.toFixed(1) : String(Number(x.toPrecision(4)));
  }
  if (typeof x === "object") return JSON.stringify(x);
  return String(x);
}

function heat(lp) {
  const t = Math.min(1, Math.max(0, lp / LP_FLOOR));
  return "hsl(" + Math.round(120 * (1 - t)) + ", 80%, " + (88 - 8 * t) + "%)";
}

function rewardClass(r) {
  return r > 0 ? "badge good" : r < 0 ? "badge bad" : "badge";
}

function stopClass(stop) {
  if (stop === "env_error" || stop === "engine_error" || stop === "aborted") return "badge bad";
  if (stop === "max_turns" || stop === "token_budget" || stop === "length") return "badge warn";
  return "badge info";
}

function checkFailed(t) {
  return (t.metrics || {})["check/ok"] === false;
}

function contentText(content) {
  if (typeof content === "string") return content;
  if (content === null || content === undefined) return "";
  if (!Array.isArray(content)) return JSON.stringify(content);
  return content.map((p) => (p && typeof p.text === "string" ? p.text : "")).join(" ");
}

function haystack(t) {
  if (t._hay === undefined) {
    const parts = [t.id, t.error || ""];
    for (const m of t.messages || []) parts.push(contentText(m.content), JSON.stringify(m.tool_calls || ""));
    for (const turn of t.turns) parts.push(turn.text || "");
    t._hay = parts.join("\n").toLowerCase();
  }
  return t._hay;
}

/* ---------- header: run facts and summary.json ---------- */

function flatten(obj, prefix, out) {
  for (const [key, value] of Object.entries(obj)) {
    const name = prefix ? prefix + "." + key : key;
    if (value && typeof value === "object" && !Array.isArray(value)) flatten(value, name, out);
    else out.push([name, value]);
  }
  return out;
}

function renderHeader() {
  const top = document.getElementById("top");
  const run = DATA.run;
  top.append(h("h1", { text: run.name, title: run.path }));
  if (run.model) top.append(h("span", { class: "model", text: "model: " + run.model }));
  if (DATA.config) {
    top.append(h("details", {}, h("summary", { text: "config.yaml" }), h("pre", { text: DATA.config })));
  }
  if (!TOKENS) top.append(h("span", { class: "badge warn", text: "no tokenizer: per-turn view" }));
  // first what a reader looks for: how many, reward, stop reasons, turns, errors; the rest folded
  const chips = h("div", { class: "chips", id: "summary" });
  const more = h("div", { class: "chips" });
  const FIRST = /^(trajectories|failed|reward\/(mean|std)|stop_reasons|turns\/mean|errors?|check\/mism)/;
  if (DATA.summary) {
    for (const [key, value] of flatten(DATA.summary, "", [])) {
      const chip = h("span", { class: "chip" }, key, h("b", { text: fmt(value) }));
      (FIRST.test(key) ? chips : more).append(chip);
    }
  } else {
    chips.append(h("span", { class: "chip", text: "no summary.json" }));
  }
  top.append(chips);
  if (more.childElementCount) {
    const label = more.childElementCount + " more metrics";
    top.append(h("details", { id: "more-metrics" }, h("summary", { text: label }), more));
  }
}

/* ---------- filters and the list ---------- */

function counted(key) {
  const counts = new Map();
  for (const t of TRAJS) counts.set(String(t[key]), (counts.get(String(t[key])) || 0) + 1);
  return [...counts.entries()].sort();
}

function selectOf(id, key) {
  const options = [h("option", { value: "", text: "all" })];
  for (const [value, n] of counted(key)) options.push(h("option", { value, text: value + " (" + n + ")" }));
  return h("select", { id, onchange: applyFilters }, options);
}

function numberInput(id, placeholder) {
  return h("input", { id, type: "number", step: "any", placeholder, oninput: applyFilters });
}

function checkbox(id, label) {
  return h("label", {}, h("input", { id, type: "checkbox", onchange: applyFilters }), label);
}

function renderFilters() {
  const f = document.getElementById("filters");
  const row = (label, ...kids) => h("label", { class: "pair" }, h("span", { text: label }), kids);
  f.append(
    row("search", h("input", { id: "f-search", type: "search", placeholder: "text in messages…",
      oninput: applyFilters })),
    row("stop", selectOf("f-stop", "stop_reason")),
    row("source", selectOf("f-source", "data_source")),
    row("reward", numberInput("f-rmin", "min"), numberInput("f-rmax", "max")),
    row("turns", numberInput("f-tmin", "min"), numberInput("f-tmax", "max")),
    h("label", { class: "checks" }, h("span", { text: "only" }),
      checkbox("f-mismatch", "check failed"), checkbox("f-error", "errors")),
    row("sort", h("select", { id: "f-sort", onchange: applyFilters },
      ["file order", ...Object.keys(SORTS)].map((s) => h("option", { text: s })))),
  );
}

function value(id) {
  return document.getElementById(id).value;
}

function numberOr(id, fallback) {
  const v = value(id);
  return v === "" || isNaN(Number(v)) ? fallback : Number(v);
}

function matches(t, f) {
  if (f.stop && String(t.stop_reason) !== f.stop) return false;
  if (f.source && String(t.data_source) !== f.source) return false;
  const reward = t.reward === null || t.reward === undefined ? NaN : t.reward;
  if (reward < f.rmin || reward > f.rmax) return false;
  if (t.num_turns < f.tmin || t.num_turns > f.tmax) return false;
  if (f.mismatch && !checkFailed(t)) return false;
  if (f.error && !t.error) return false;
  return !f.search || haystack(t).includes(f.search);
}

const SORTS = {
  "reward ↓": (a, b) => b.reward - a.reward,
  "reward ↑": (a, b) => a.reward - b.reward,
  "turns ↓": (a, b) => b.num_turns - a.num_turns,
  "tokens ↓": (a, b) => b.response_ids.length - a.response_ids.length,
};

function applyFilters() {
  const f = {
    search: value("f-search").trim().toLowerCase(), stop: value("f-stop"), source: value("f-source"),
    rmin: numberOr("f-rmin", -Infinity), rmax: numberOr("f-rmax", Infinity),
    tmin: numberOr("f-tmin", -Infinity), tmax: numberOr("f-tmax", Infinity),
    mismatch: document.getElementById("f-mismatch").checked,
    error: document.getElementById("f-error").checked,
  };
  STATE.shown = TRAJS.filter((t) => matches(t, f));
  const sort = SORTS[value("f-sort")];
  if (sort) STATE.shown.sort(sort);
  renderList();
}

function renderRow(t) {
  const row = h("li", { class: "traj-row", "data-id": t.id, onclick: () => select(t) },
    h("span", { class: "tid", text: t.id }),
    h("span", { class: rewardClass(t.reward), title: "reward", text: "r " + fmt(t.reward) }),
    h("span", { class: stopClass(t.stop_reason), text: t.stop_reason }),
    h("span", { class: "badge", text: t.num_turns + (t.num_turns === 1 ? " turn" : " turns") }),
    h("span", { class: "badge", text: t.data_source }),
    checkFailed(t) ? h("span", { class: "badge bad", text: "check ✗" }) : null,
    t.error ? h("span", { class: "badge bad", text: "error" }) : null);
  if (STATE.selected === t) row.classList.add("selected");
  return row;
}

function renderList() {
  const list = document.getElementById("list");
  list.replaceChildren(...STATE.shown.map(renderRow));
  document.getElementById("count").textContent = STATE.shown.length + " of " + TRAJS.length + " trajectories";
}

function select(t) {
  STATE.selected = t;
  for (const row of document.querySelectorAll(".traj-row")) {
    row.classList.toggle("selected", row.dataset.id === t.id);
  }
  history.replaceState(null, "", "#" + encodeURIComponent(t.id));
  renderDetail(t);
}

function step(delta) {
  if (!STATE.shown.length) return;
  const at = STATE.shown.indexOf(STATE.selected);
  const next = STATE.shown[Math.min(STATE.shown.length - 1, Math.max(0, at + delta))];
  select(next);
  const row = document.querySelector('.traj-row.selected');
  if (row) row.scrollIntoView({ block: "nearest" });
}

/* ---------- the selected trajectory ---------- */

function kvTable(obj) {
  const row = ([k, v]) => h("tr", {}, h("td", { text: k }), h("td", { text: fmt(v) }));
  return h("table", { class: "kv" }, Object.entries(obj || {}).map(row));
}

function renderSummary(t) {
  const model = t.loss_mask.reduce((a, b) => a + b, 0);
  const chip = (label, v, cls) => h("span", { class: cls || "chip" }, label, h("b", { text: fmt(v) }));
  return [
    h("h2", { text: t.id }),
    h("div", { class: "chips" },
      h("span", { class: rewardClass(t.reward) + " chip" }, "reward", h("b", { text: fmt(t.reward) })),
      h("span", { class: stopClass(t.stop_reason) + " chip", text: t.stop_reason }),
      chip("turns", t.num_turns), chip("group", t.group_id), chip("sample", t.sample_index),
      chip("source", t.data_source), chip("model tokens", model),
      chip("env tokens", t.response_ids.length - model), chip("prompt tokens", (t.prompt_ids || []).length),
      chip("line", t.line)),
    t.error ? h("div", { class: "box error-box", text: t.error }) : null,
  ];
}

function factBox(title, obj) {
  if (!Object.keys(obj || {}).length) return null;
  const summary = h("summary", { text: title });
  return h("div", { class: "box fact" }, h("details", { open: "" }, summary, kvTable(obj)));
}

function renderFacts(t) {
  const info = Object.fromEntries(Object.entries(t.info || {}).filter(([k]) => k !== "check"));
  const rewards = Object.fromEntries((t.turn_rewards || []).map((r, i) => ["turn " + (i + 1), r]));
  return h("div", { class: "cols" }, factBox("turn rewards", rewards), factBox("metrics", t.metrics),
    factBox("info", info));
}

function diffLines(text) {
  return text.split("\n").map((line) => {
    const kind = line.startsWith("- ") ? "del" : line.startsWith("+ ") ? "add" : "";
    return h("span", { class: line.startsWith("@@") ? "at" : kind, text: line + "\n" });
  });
}

function renderCheck(t) {
  const check = (t.info || {}).check;
  if (!check) return null;
  const ok = check.ok !== false;
  const hunks = (check.hunks || []).map((hk) => h("tr", {},
    h("td", { text: "token " + hk.start }), h("td", { text: hk.kind + (hk.expected ? " (expected)" : "") }),
    h("td", { text: JSON.stringify(hk.incremental) + " → " + JSON.stringify(hk.rerender) })));
  return h("div", { class: "box check " + (ok ? "ok" : "bad"), id: "check" },
    h("b", { class: "check-title",
      text: ok ? "sanity check passed" : "sanity check: " + fmt(check.mismatches) + " mismatch(es)" }),
    h("span", { class: "badge", text: "mode " + check.mode }),
    hunks.length ? h("table", { class: "kv hunks" }, hunks) : null,
    check.diff ? h("pre", { class: "diff" }, diffLines(check.diff)) : null);
}

function renderImage(src) {
  if (typeof src === "string" && src.startsWith("data:image/")) return h("img", { src, alt: "image" });
  return h("span", { class: "badge", text: "[image: " + (typeof src === "string" ? src : "embedded") + "]" });
}

function renderPart(part) {
  if (typeof part === "string") return h("div", { class: "text", text: part });
  if (!part || typeof part !== "object") return h("div", { class: "text", text: fmt(part) });
  if (part.type === "text") return h("div", { class: "text", text: part.text });
  if (part.type === "image") return renderImage(part.image !== undefined ? part.image : part.url);
  if (part.type === "image_url") {
    const url = part.image_url;
    return renderImage(url && typeof url === "object" ? url.url : url);
  }
  return h("pre", { text: JSON.stringify(part) });
}

function renderContent(content) {
  if (Array.isArray(content)) return content.map(renderPart);
  return h("div", { class: "text", text: typeof content === "string" ? content : fmt(content) });
}

function hasImage(m) {
  const isImage = (p) => p && (p.type === "image" || p.type === "image_url");
  return Array.isArray(m.content) && m.content.some(isImage);
}

function renderMessage(m) {
  const label = m.role + (m.name ? " · " + m.name : "");
  const calls = m.tool_calls ? h("pre", { text: JSON.stringify(m.tool_calls, null, 1) }) : null;
  const role = h("div", { class: "role", text: label });
  return h("div", { class: "msg " + m.role }, role, renderContent(m.content), calls);
}

function tokenSpan(id, mask, lp, cls) {
  const text = TOKENS[String(id)] ?? "";
  const origin = mask ? " · logprob " + fmt(lp) : cls === "tok-prompt" ? " · prompt" : " · env (mask 0)";
  const title = "id " + id + " · " + JSON.stringify(text) + origin;
  const attrs = { class: "tok " + cls, title, "data-id": String(id) };
  if (mask) { attrs.style = "background:" + heat(lp); attrs["data-lp"] = String(lp); }
  const lines = text.split("\n");
  const mark = () => h("span", { class: "nl", text: "↵" });
  return h("span", attrs, lines.map((line, i) => (i ? [mark(), "\n", line] : line)));
}

function turnTokens(t, turn) {
  const spans = [];
  for (let i = turn.start; i < turn.end; i++) {
    const mask = t.loss_mask[i];
    spans.push(tokenSpan(t.response_ids[i], mask, t.rollout_logprobs[i], mask ? "tok-model" : "tok-env"));
  }
  return spans;
}

function meanLogprob(t, turn) {
  let sum = 0, n = 0;
  for (let i = turn.start; i < turn.end; i++) if (t.loss_mask[i]) { sum += t.rollout_logprobs[i]; n++; }
  return n ? sum / n : null;
}

function turnSegment(t, turn) {
  const mean = meanLogprob(t, turn);
  if (mean === null) {
    const title = (turn.end - turn.start) + " env tokens";
    return h("span", { class: "seg seg-env", title, text: turn.text });
  }
  return h("span", { class: "seg seg-model", style: "background:" + heat(mean), "data-lp": String(mean),
    title: "mean logprob " + fmt(mean) + " over " + (turn.end - turn.start) + " tokens", text: turn.text });
}

function toolResults(t, index) {
  const next = t.turns[index + 1];
  const span = next && next.role !== "assistant" ? t.turn_messages[index + 1] : null;
  return span ? t.messages.slice(span[0], span[1]).filter((m) => m.role === "tool") : [];
}

function renderCalls(t, index) {
  const span = t.turn_messages[index];
  const msg = span ? t.messages[span[0]] : null;
  if (!msg || !msg.tool_calls || !msg.tool_calls.length) return null;
  const results = toolResults(t, index);
  const calls = msg.tool_calls.map((call, k) => {
    const fn = call.function || call;
    const args = typeof fn.arguments === "string" ? fn.arguments : JSON.stringify(fn.arguments);
    const result = results.find((m) => call.id && m.tool_call_id === call.id) || results[k];
    const shown = result
      ? h("div", { class: "result tool-result", text: contentText(result.content) })
      : h("div", { class: "result missing", text: "no result: the episode ended" });
    return h("div", { class: "call" }, h("span", { class: "fn", text: fn.name }),
      h("span", { class: "args", text: "(" + args + ")" }), shown);
  });
  return h("div", { class: "calls" }, calls);
}

function turnHead(t, turn, index, number) {
  const model = turn.role === "assistant";
  const name = model ? "turn " + number + " · model" : "env · " + turn.role;
  const chips = [h("span", { class: "tname", text: name }),
    h("span", { class: "badge", text: (turn.end - turn.start) + " tokens" })];
  if (model) {
    chips.push(h("span", { class: "badge", style: "background:" + heat(meanLogprob(t, turn) ?? 0),
      text: "mean logprob " + fmt(meanLogprob(t, turn)) }));
    if (turn.finish_reason) chips.push(h("span", { class: "badge", text: "finish " + turn.finish_reason }));
    if (turn.reward !== null && turn.reward !== undefined) {
      chips.push(h("span", { class: rewardClass(turn.reward), text: "reward " + fmt(turn.reward) }));
    }
  }
  if (turn.env_retries) {
    chips.push(h("span", { class: "badge warn", text: turn.env_retries + " env retries" }));
  }
  const final = (turn.info || {}).final_observation;
  if (final) {  // the env's answer that came with done=True was not appended (limits.final_observation)
    chips.push(h("span", { class: "badge warn final-dropped", text: "final observation " + final,
      title: "the env ended the episode with an observation that is not in the sequence" }));
  }
  for (const [k, v] of Object.entries(turn.timings || {})) {
    chips.push(h("span", { class: "badge", text: k + " " + (v * 1000).toFixed(1) + " ms" }));
  }
  return h("div", { class: "turn-head" }, chips);
}

function renderTurn(t, turn, index, number) {
  const model = turn.role === "assistant";
  const span = t.turn_messages[index];
  const images = span && !model ? t.messages.slice(span[0], span[1]).filter(hasImage).map(renderMessage) : [];
  return h("div", { class: "turn " + (model ? "model" : "env"), "data-index": String(index) },
    turnHead(t, turn, index, number),
    h("div", { class: "turn-body" }, TOKENS ? turnTokens(t, turn) : turnSegment(t, turn)),
    model ? renderCalls(t, index) : null, model ? stepInfo(turn) : null, images);
}

function stepInfo(turn) {
  const hidden = ["tool_calls", "final_observation"];  // drawn as calls and as a badge
  const shown = Object.entries(turn.info || {}).filter(([k]) => !hidden.includes(k));
  if (!shown.length) return null;
  const body = h("pre", { text: JSON.stringify(Object.fromEntries(shown), null, 1) });
  const title = h("summary", { text: "step info (" + shown.length + ")" });
  return h("details", { class: "step-info" }, title, body);
}

function legend() {
  const stops = [0, 0.25, 0.5, 0.75, 1].map((x) => heat(x * LP_FLOOR) + " " + x * 100 + "%").join(", ");
  const what = TOKENS ? "logprob" : "mean logprob of each model turn";
  return h("div", { class: "legend" }, what, h("span", { text: "0" }),
    h("span", { class: "bar", style: "background: linear-gradient(to right, " + stops + ")" }),
    h("span", { text: "≤ " + LP_FLOOR }),
    h("span", { class: "envkey", text: "env / template tokens (mask 0)" }));
}

function renderPrompt(t) {
  const prompt = (t.messages || []).slice(0, t.prompt_messages);
  const out = [h("h3", { text: t.turn_messages.length || !t.turns.length ? "Prompt" : "Messages" }),
    h("div", { class: "box prompt" }, prompt.map(renderMessage))];
  if (TOKENS && t.prompt_ids && t.prompt_ids.length) {
    const toks = h("div", { class: "turn-body" });
    const title = h("summary", { text: "prompt tokens (" + t.prompt_ids.length + ")" });
    const details = h("details", { class: "box prompt-tokens" }, title, toks);
    details.addEventListener("toggle", () => {  // drawn on first open: prompts can be long
      if (!details.open || toks.childNodes.length) return;
      toks.append(...t.prompt_ids.map((id) => tokenSpan(id, 0, 0, "tok-prompt")));
    });
    out.push(details);
  }
  return out;
}

function renderTurns(t) {
  let number = 0;
  const turns = t.turns.map((turn, i) => {
    if (turn.role === "assistant") number += 1;
    return renderTurn(t, turn, i, number);
  });
  return [h("h3", { text: "Turns" }), legend(), h("div", { class: "turns" }, turns)];
}

function renderDetail(t) {
  const detail = document.getElementById("detail");
  const parts = [...renderSummary(t), renderCheck(t), renderFacts(t), ...renderPrompt(t), ...renderTurns(t)];
  detail.replaceChildren(...parts.filter((part) => part !== null));
  detail.scrollTop = 0;
}

/* ---------- start ---------- */

function onKey(event) {
  if (event.target.matches("input, select, textarea")) return;
  if (event.key === "ArrowDown" || event.key === "j") { step(1); event.preventDefault(); }
  if (event.key === "ArrowUp" || event.key === "k") { step(-1); event.preventDefault(); }
}

function start() {
  renderHeader();
  renderFilters();
  applyFilters();
  document.addEventListener("keydown", onKey);
  const wanted = decodeURIComponent(location.hash.slice(1));
  const first = TRAJS.find((t) => t.id === wanted) || STATE.shown[0];
  if (first) select(first);
  document.body.dataset.ready = "1";
}

start();
"""
