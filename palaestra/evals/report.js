
(function () {
"use strict";
const D = JSON.parse(document.getElementById("report-data").textContent);
const T = D.texts, R = D.rollouts, PAGE = D.page_size;
const $ = (id) => document.getElementById(id);
function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}
const fmt = (v) => (typeof v === "number" && !Number.isInteger(v)) ? String(+v.toPrecision(4)) : String(v);
const outcomeOf = (r) => (r.o === null ? "-" : r.o);
const categoryOf = (r) => (r.c === null ? "-" : r.c);
const DEFAULTS = {source: "", step: "", outcome: "", category: "", order: "file", k: "10", q: "", page: "1",
  diffa: "", diffb: "", diffsrc: "", dpage: "1"};
const S = Object.assign({}, DEFAULTS);
const KEYS = Object.keys(S);

function readHash() {
  Object.assign(S, DEFAULTS);
  if (D.diff) { S.diffa = String(D.diff_default[0]); S.diffb = String(D.diff_default[1]); }
  const h = new URLSearchParams(location.hash.replace(/^#/, ""));
  for (const k of KEYS) { if (h.has(k)) S[k] = h.get(k); }
}
function writeHash() {
  const base = Object.assign({}, DEFAULTS);
  if (D.diff) { base.diffa = String(D.diff_default[0]); base.diffb = String(D.diff_default[1]); }
  const h = new URLSearchParams();
  for (const k of KEYS) { if (S[k] !== base[k]) h.set(k, S[k]); }
  const s = h.toString();
  history.replaceState(null, "", s ? "#" + s : location.pathname + location.search);
}
const textOf = (r) => r.m.map((m) => T[m[1]]).join("\n");
function passes(r, skip) {
  if (S.source && r.src !== S.source) return false;
  if (S.step !== "" && String(r.s) !== S.step) return false;
  if (skip !== "outcome" && S.outcome && outcomeOf(r) !== S.outcome) return false;
  if (skip !== "category" && S.category && categoryOf(r) !== S.category) return false;
  if (S.q) {
    const q = S.q.toLowerCase();
    if (String(r.id).toLowerCase() !== q && !textOf(r).toLowerCase().includes(q)) return false;
  }
  return true;
}
function selected() {
  let rows = R.filter((r) => passes(r, ""));
  if (S.order === "top" || S.order === "bottom") {
    const sign = S.order === "top" ? -1 : 1;
    rows = rows.map((r, i) => [r, i]).sort((a, b) => sign * (a[0].r - b[0].r) || a[1] - b[1]);
    rows = rows.map((x) => x[0]);
    const k = parseInt(S.k, 10);
    if (k > 0) rows = rows.slice(0, k);
  }
  return rows;
}
function chips(boxId, kind) {
  const box = $(boxId);
  box.textContent = "";
  box.appendChild(el("span", "lead", kind));
  const counts = new Map();
  for (const r of R) {
    if (!passes(r, kind)) continue;
    const v = kind === "outcome" ? outcomeOf(r) : categoryOf(r);
    counts.set(v, (counts.get(v) || 0) + 1);
  }
  for (const v of (kind === "outcome" ? D.outcomes : D.categories)) {
    const on = S[kind] === v;
    const b = el("button", "chip" + (on ? " on" : ""), v);
    b.type = "button"; b.dataset.kind = kind; b.dataset.value = v;
    b.setAttribute("aria-pressed", on ? "true" : "false");
    b.appendChild(el("b", null, counts.get(v) || 0));
    if (!counts.get(v) && !on) b.disabled = true;
    box.appendChild(b);
  }
}
function where(r) {
  const w = [];
  if (r.s !== null) w.push("step " + r.s);
  w.push(r.src);
  if (r.id !== null) w.push("id " + r.id);
  if (r.g !== null) w.push("group " + r.g + " #" + r.i);
  else if (r.i !== null) w.push("sample " + r.i);
  return w.join(" \u00b7 ");
}
// one sampled turn: each token coloured by its probability (background: red = unlikely, green = likely) and
// underlined by its entropy (darker = more uncertain); hover shows the numbers
function tokens(toks, turnReward) {
  const w = el("div", "tokens");
  let sum = 0, known = 0;
  for (const [t, lp, h] of toks) if (lp !== null) { sum += lp; known += 1; }
  let head = toks.length + " tokens" + (known ? ", logprob sum " + fmt(sum) : "");
  if (turnReward !== null && turnReward !== undefined) head += ", turn reward " + fmt(turnReward);
  w.appendChild(el("div", "tokhead", head));
  for (const [t, lp, h] of toks) {
    const s = el("span", "tok", t);
    const p = lp === null ? null : Math.exp(Math.min(lp, 0));
    if (p !== null) s.style.backgroundColor = "hsla(" + Math.round(120 * p) + ",75%,55%,0.35)";
    if (h !== null) s.style.borderBottomColor = "rgba(40,40,160," + Math.min(1, h / 2).toFixed(2) + ")";
    s.dataset.lp = lp === null ? "" : lp;
    s.dataset.h = h === null ? "" : h;
    s.title = "logprob " + (lp === null ? "?" : fmt(lp)) + (p === null ? "" : " (p " + fmt(p) + ")") +
      (h === null ? "" : ", entropy " + fmt(h));
    w.appendChild(s);
  }
  return w;
}
function card(r) {
  const a = el("article", "card");
  a.dataset.uid = r.u; a.dataset.step = r.s === null ? "" : r.s; a.dataset.source = r.src;
  a.dataset.outcome = outcomeOf(r); a.dataset.category = categoryOf(r); a.dataset.reward = r.r;
  const h = el("header");
  h.appendChild(el("span", "where", where(r)));
  h.appendChild(el("span", "badge " + (r.r > 0 ? "good" : "bad"), "reward " + fmt(r.r)));
  if (r.o !== null) h.appendChild(el("span", "badge", r.o));
  if (r.c !== null && r.c !== r.o) h.appendChild(el("span", "badge cat cat-" + r.c, r.c));
  if (r.a !== null) h.appendChild(el("span", "badge", "advantage " + (r.a > 0 ? "+" : "") + fmt(r.a)));
  a.appendChild(h);
  for (const m of r.m) {
    const d = el("div", "msg role-" + m[0]);
    d.appendChild(el("span", "role", m[0]));
    const p = el("pre", null, T[m[1]]);
    if (m[2]) p.appendChild(el("div", "call", m[2]));
    const box = el("div");
    box.appendChild(p);
    if (m[3]) box.appendChild(tokens(m[3], m[4]));
    else if (m[4] !== null && m[4] !== undefined) box.appendChild(el("div", "tokhead", "turn reward " + fmt(m[4])));
    d.appendChild(box);
    a.appendChild(d);
  }
  if (r.x) a.appendChild(el("div", "extra", r.x));
  if (r.n) a.appendChild(el("div", "note", "note: " + r.n));
  return a;
}
function pager(id, page, pages, onGo) {
  const p = $(id);
  p.textContent = "";
  if (pages <= 1) return;
  const prev = el("button", null, "\u2190 prev");
  prev.type = "button"; prev.disabled = page <= 1; prev.dataset.go = "prev";
  prev.addEventListener("click", () => onGo(page - 1));
  const next = el("button", null, "next \u2192");
  next.type = "button"; next.disabled = page >= pages; next.dataset.go = "next";
  next.addEventListener("click", () => onGo(page + 1));
  p.append(prev, el("span", "muted", "page " + page + " of " + pages), next);
}
function clampPage(key, n) {
  const pages = Math.max(1, Math.ceil(n / PAGE));
  const page = Math.min(Math.max(parseInt(S[key], 10) || 1, 1), pages);
  S[key] = String(page);
  return [page, pages];
}
function renderList() {
  const rows = selected();
  const [page, pages] = clampPage("page", rows.length);
  const mc = $("match-count");
  mc.dataset.n = rows.length;
  mc.textContent = rows.length + " rollout(s) match, of " + R.length + " embedded";
  const list = $("list");
  list.textContent = "";
  const frag = document.createDocumentFragment();
  for (const r of rows.slice((page - 1) * PAGE, page * PAGE)) frag.appendChild(card(r));
  list.appendChild(frag);
  const go = (n) => { S.page = String(n); update(); $("rollouts").scrollIntoView(); };
  pager("pager-top", page, pages, go);
  pager("pager-bottom", page, pages, go);
}
function syncControls() {
  for (const k of ["source", "step", "order"]) $("f-" + k).value = S[k];
  $("f-k").value = S.k; $("f-q").value = S.q; $("f-k").disabled = S.order === "file";
}
function update() {
  syncControls();
  chips("chips-category", "category");
  chips("chips-outcome", "outcome");
  renderList();
  if (D.diff) renderDiff();
  writeHash();
}
function keyOf(r) {
  if (r.id !== null) return "id:" + r.id;
  return "p:" + r.m.filter((m) => m[0] === "user").map((m) => m[1]).join(",");
}
const mean = (xs) => xs.reduce((s, r) => s + r.r, 0) / xs.length;
const VERDICTS = ["improved", "regressed", "changed", "same"];
function verdict(a, b) {
  const ra = mean(a), rb = mean(b);
  if (rb > ra) return "improved";
  if (rb < ra) return "regressed";
  const texts = (xs) => xs.map((r) => textOf(r)).sort().join("\u0000");
  return texts(a) === texts(b) ? "same" : "changed";
}
function groupBy(step, src) {
  const m = new Map();
  for (const r of R) {
    if (String(r.s) !== step || r.src !== src) continue;
    const k = keyOf(r);
    if (!m.has(k)) m.set(k, []);
    m.get(k).push(r);
  }
  return m;
}
function side(label, r) {
  const s = el("div", "side");
  const asst = r.m.filter((m) => m[0] === "assistant").pop();
  const tail = "   \u2192 reward " + fmt(r.r) + (r.o !== null ? " " + r.o + " (" + r.c + ")" : "");
  s.append(el("span", "muted", label), el("pre", null, (asst ? T[asst[1]] : "") + tail));
  return s;
}
function renderDiff() {
  for (const k of ["diffa", "diffb", "diffsrc"]) $("d-" + k).value = S[k];
  const sa = S.diffa, sb = S.diffb, box = $("diff-list"), sum = $("diff-summary");
  box.textContent = "";
  const has = (s, src) => R.some((r) => String(r.s) === s && r.src === src);
  const src = S.diffsrc || ["val", "train"].find((x) => has(sa, x) && has(sb, x)) || "";
  const A = groupBy(sa, src), B = groupBy(sb, src);
  let pairs = [];
  for (const [k, b] of B) { if (A.has(k)) pairs.push({a: A.get(k), b: b, v: verdict(A.get(k), b)}); }
  pairs.sort((x, y) => VERDICTS.indexOf(x.v) - VERDICTS.indexOf(y.v));
  if (S.outcome || S.category) {
    const hit = (r) => (!S.outcome || outcomeOf(r) === S.outcome) &&
      (!S.category || categoryOf(r) === S.category);
    pairs = pairs.filter((p) => p.a.concat(p.b).some(hit));
  }
  const counts = VERDICTS.map((v) => v + " " + pairs.filter((p) => p.v === v).length).join(", ");
  sum.dataset.n = pairs.length;
  sum.textContent = "step " + sa + " \u2192 " + sb + " on " + (src || "no shared") + " rollouts: " +
    pairs.length + " embedded prompt(s) in both (" + counts + ")" +
    (S.outcome || S.category ? "; outcome/category filter applied" : "");
  const [page, pages] = clampPage("dpage", pairs.length);
  for (const p of pairs.slice((page - 1) * PAGE, page * PAGE)) {
    const d = el("div", "pair");
    d.dataset.verdict = p.v;
    const h = el("div");
    h.appendChild(el("b", "v-" + p.v, p.v));
    const who = p.b[0].id !== null ? "id " + p.b[0].id : "";
    const change = "  reward " + fmt(mean(p.a)) + " \u2192 " + fmt(mean(p.b));
    h.appendChild(el("span", "muted", "  " + who + change));
    d.appendChild(h);
    const user = p.b[0].m.find((m) => m[0] === "user");
    if (user) {
      const s = el("div", "side");
      s.append(el("span", "muted", "prompt"), el("pre", null, T[user[1]]));
      d.appendChild(s);
    }
    for (const r of p.a) d.appendChild(side("step " + sa, r));
    for (const r of p.b) d.appendChild(side("step " + sb, r));
    box.appendChild(d);
  }
  pager("diff-pager", page, pages, (n) => { S.dpage = String(n); update(); });
}
function onControl(id, key, event, value) {
  $(id).addEventListener(event, (e) => { S[key] = value(e.target); S.page = "1"; update(); });
}
function bind() {
  for (const k of ["source", "step", "order"]) onControl("f-" + k, k, "change", (t) => t.value);
  onControl("f-k", "k", "input", (t) => t.value);
  onControl("f-q", "q", "input", (t) => t.value.trim());
  $("f-reset").addEventListener("click", () => {
    for (const k of ["source", "step", "outcome", "category", "q", "order", "page"]) S[k] = DEFAULTS[k];
    update();
  });
  document.addEventListener("click", (e) => {
    const b = e.target.closest("button[data-kind], [data-filter-category], [data-goto-step]");
    if (!b) return;
    if (b.dataset.kind) {
      S[b.dataset.kind] = S[b.dataset.kind] === b.dataset.value ? "" : b.dataset.value;
    } else if (b.dataset.filterCategory !== undefined) {
      S.category = S.category === b.dataset.filterCategory ? "" : b.dataset.filterCategory;
      $("rollouts").scrollIntoView();
    } else {
      S.step = b.dataset.gotoStep; S.source = b.dataset.gotoSource || "";
      $("rollouts").scrollIntoView();
    }
    S.page = "1";
    update();
  });
  if (D.diff) {
    for (const k of ["diffa", "diffb", "diffsrc"]) {
      $("d-" + k).addEventListener("change", (e) => { S[k] = e.target.value; S.dpage = "1"; update(); });
    }
  }
  window.addEventListener("hashchange", () => { readHash(); update(); });
}
readHash();
bind();
update();
document.body.dataset.ready = "1";
document.body.dataset.readyMs = String(Math.round(performance.now()));
})();
