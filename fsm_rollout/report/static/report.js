"use strict";
(function () {
  const INDEX = JSON.parse(document.getElementById("report-index").textContent);
  const COLS = INDEX.columns;
  const C = Object.fromEntries(COLS.map((name, i) => [name, i]));
  const ROWS = INDEX.rows.map((row, i) => ({ i: i, v: row }));
  const app = document.getElementById("app");
  const VIEWS = window.fsmReportViews || { overview: [], stripDeltas: () => null, deltaColour: () => null };
  const cache = new Map();
  const STATE_COLOURS = { pending: "#90a4ae", rendered: "#b0bec5", generating: "#42a5f5", stepping: "#66bb6a",
    observing: "#ab47bc", suspended: "#f0b35a" };

  // h(tag, attributes, ...children): strings become text nodes, never markup
  function h(tag, attrs) {
    const el = document.createElement(tag);
    if (attrs) {
      for (const key of Object.keys(attrs)) {
        const value = attrs[key];
        if (value === null || value === undefined || value === false) continue;
        if (key === "class") el.className = value;
        else if (key === "text") el.textContent = value;
        else if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
        else if (key === "style") el.setAttribute("style", value);
        else el.setAttribute(key, String(value));
      }
    }
    for (let k = 2; k < arguments.length; k++) add(el, arguments[k]);
    return el;
  }
  function add(el, child) {
    if (child === null || child === undefined || child === false) return;
    if (Array.isArray(child)) { for (const c of child) add(el, c); return; }
    el.appendChild(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  function fmt(value, digits) {
    if (value === null || value === undefined) return "\u2013";
    if (typeof value !== "number") return String(value);
    if (Number.isInteger(value)) return value.toLocaleString("en-US");
    if (digits === 0) return Math.round(value).toLocaleString("en-US");
    return value.toFixed(digits === undefined ? 1 : digits);
  }
  function ms(value) {
    if (value === null || value === undefined) return "\u2013";
    return value >= 1000 ? (value / 1000).toFixed(2) + " s" : value.toFixed(1) + " ms";
  }
  function badge(text, cls) { return h("span", { class: "badge " + (cls || text || "") }, text || "\u2013"); }
  function detail(i) {
    if (!cache.has(i) || cache.get(i) === null) {
      const el = document.getElementById("d" + i);
      cache.set(i, el ? JSON.parse(el.textContent) : null);
    }
    return cache.get(i);
  }
  function imageUrl(url) { return typeof url === "string" && url.startsWith("data:image/") ? url : null; }

  // ------------------------------------------------------------------------------------------------ overview
  const S = INDEX.summary;
  function header() {
    const m = INDEX.meta;
    const src = ["trace " + m.trace];
    if (m.tape) src.push("tape " + m.tape);
    if (m.results) src.push("results " + m.results);
    if (m.replay) src.push("replay " + m.replay);
    return h("header", null, h("h1", null, h("a", { href: "#", style: "color:inherit;text-decoration:none" },
      "fsm-rollout report")), h("span", { class: "src" }, src.join(" · ")));
  }
  function cards() {
    const rewards = ROWS.map((r) => r.v[C.reward]).filter((x) => typeof x === "number");
    const mean = rewards.length ? rewards.reduce((a, b) => a + b, 0) / rewards.length : null;
    const t = S.throughput;
    const gen = S.tokens.generated;
    const zero = S.groups.filter((g) => g.zero_variance).length;
    const spread = S.groups.filter((g) => g.members > 1).length;  // a one-member group has no variance
    const list = [
      [fmt(S.runs), "sample runs (" + fmt(S.finished) + " finished, " + fmt(S.unfinished) + " unfinished)"],
      [fmt(S.turns_total), "turns"],
      [gen ? fmt(gen.total) : "\u2013", "tokens generated"],
      [t ? fmt(t.tokens_per_s, 0) : "\u2013", "tokens/s" + (t ? " over " + fmt(t.seconds, 1) + " s" : "")],
      [t ? fmt(t.samples_per_s, 2) : "\u2013", "samples/s"],
    ];
    if (mean !== null) list.push([mean.toFixed(3), "mean reward (" + rewards.length + ")"]);
    if (spread) list.push([zero + "/" + spread, "groups with zero reward variance"]);
    if (S.forks) list.push([fmt(S.forks.transitions), "forks in " + fmt(S.forks.samples) + " samples"]);
    if (S.compactions) list.push([fmt(S.compactions.transitions), "compactions in " + fmt(S.compactions.samples) +
      " samples"]);
    if (S.suspensions) list.push([fmt(S.suspensions.samples), "samples suspended"]);
    return h("div", { class: "cards" }, list.map(([v, k]) => h("div", { class: "card" },
      h("div", { class: "v" }, v), h("div", { class: "k" }, k))));
  }
  function statuses() {
    const max = Math.max(1, ...S.statuses.map((s) => s.count));
    const rows = [];
    for (const s of S.statuses) {
      rows.push(h("tr", null, h("td", null, badge(s.status)), h("td", { class: "n" }, fmt(s.count)),
        h("td", null, h("span", { class: "bar", style: "width:" + (120 * s.count / max) + "px" })),
        h("td", { class: "reasons" }, s.reasons.map(([reason, n]) => h("a", { href: "#", onclick: (e) => {
          e.preventDefault(); setFilter({ reason: reason }); } }, reason + " " + n)))));
    }
    if (S.unfinished) rows.push(h("tr", null, h("td", null, badge("unfinished")), h("td", { class: "n" },
      fmt(S.unfinished))));
    return h("section", null, h("h2", null, "Statuses and reasons"),
      h("table", null, h("tr", null, h("th", null, "status"), h("th", { class: "n" }, "samples"), h("th"),
        h("th", null, "reasons (click to filter)")), rows),
      S.orphans ? h("p", { class: "note" }, S.orphans + " transition(s) without a sample id are not counted") : null);
  }
  function turnsAndTokens() {
    const max = Math.max(1, ...S.turns.map((t) => t[1]));
    const tok = (name, label) => {
      const s = S.tokens[name];
      return h("tr", null, h("td", null, label), ...(s ? [s.n, s.mean, s.p50, s.p95, s.max].map((x) =>
        h("td", { class: "n" }, fmt(x))) : [h("td", { class: "n" }, "\u2013")]));
    };
    return h("section", null, h("h2", null, "Turns and tokens"),
      h("h3", null, "turns per sample"),
      h("table", null, S.turns.map(([turns, n]) => h("tr", null, h("td", { class: "n", style: "width:40px" }, turns),
        h("td", null, h("span", { class: "bar", style: "width:" + (200 * n / max) + "px" }), n)))),
      h("h3", null, "tokens per sample"),
      h("table", null, h("tr", null, ["", "n", "mean", "p50", "p95", "max"].map((x) => h("th",
        { class: x ? "n" : "" }, x))),
        tok("prompt", "prompt"), tok("generated", "generated"), tok("response", "response side")));
  }
  function timeSection() {
    const rows = S.dwell.filter((d) => d.n);
    const total = rows.reduce((a, d) => a + d.total, 0) + (S.queued ? S.queued.total : 0);
    const line = (name, d, cls, note) => h("tr", null, h("td", null, name, note ? h("div", { class: "note" },
      note) : null),
      h("td", { class: "n" }, fmt(d.n)), h("td", { class: "n" }, ms(d.p50)), h("td", { class: "n" }, ms(d.p95)),
      h("td", { class: "n" }, ms(d.total)),
      h("td", null, h("span", { class: "bar " + (cls || ""), style: "width:" + (160 * d.total / Math.max(1,
        total)) + "px" })));
    return h("section", { class: "wide" }, h("h2", null, "Where the time went"),
      h("table", null, h("tr", null, ["state", "n", "p50", "p95", "total", "share"].map((x, k) =>
        h("th", { class: k && k < 5 ? "n" : "" }, x))),
        S.queued ? line("queued for a slot", S.queued, "queue",
          "waiting for a concurrency slot before the rollout starts: not part of pending's own work") : null,
        S.admission ? line("admission wait", S.admission, "queue",
          "adaptive admission: waiting for the engine to take a request (part of the dwell of the state left)") : null,
        S.staleness ? line("staleness wait", S.staleness, "queue",
          "max_staleness: a new group waiting for the trainer to consume, before it queues") : null,
        rows.map((d) => line(d.state, d, "",
          d.state === "pending" ? "the rollout's own start-up (render request)" : null))),
      h("p", { class: "note" }, "dwell: time in a state per transition out of it (trace field dwell_ms). Totals " +
        "add up every sample's time, so with samples running side by side they exceed the run's wall time."));
  }
  const GROUPS_DRAWN = 60;  // beyond this, a chip per group would push the sample table far down
  function groupsSection() {
    if (!S.groups.length) return null;
    const zero = S.groups.filter((g) => g.zero_variance);
    const colour = (r) => "hsl(" + Math.round(120 * Math.max(0, Math.min(1, r))) + ",55%,55%)";
    const shown = S.groups.length <= GROUPS_DRAWN ? S.groups : zero.slice(0, GROUPS_DRAWN);
    return h("section", null, h("h2", null, "Rewards per group"),
      h("p", { class: "note" }, zero.length + " of " + S.groups.filter((g) => g.members > 1).length +
        " groups of two or more have zero reward variance (every member got the same reward: no signal for a " +
        "group-relative update)"),
      shown.length < S.groups.length ? h("p", { class: "note" }, "drawn: " + (shown.length < zero.length ?
        "the first " + shown.length + " of them" : "those " + shown.length) + "; every group is in the sample " +
        "table's group filter") : null,
      h("div", { class: "groups" }, shown.map((g) => h("span", {
        class: "group" + (g.zero_variance ? " zero" : ""), title: "rewards " + g.rewards.join(", "),
        onclick: () => setFilter({ group: g.group }) }, "group " + g.group + " ",
        g.rewards.map((r) => h("span", { class: "r", style: "background:" + colour(r) })),
        " " + g.mean.toFixed(2), g.zero_variance ? h("span", { class: "badge zero" }, "zero variance") : null))));
  }
  function extrasSection() {
    const items = [];
    if (S.forks) items.push(h("p", null, "forks (edges with reason " + S.forks.reason + "): " + S.forks.transitions +
      " in " + S.forks.samples + " sample(s)"));
    if (S.compactions) items.push(h("p", null, "compactions (forks with reason " + S.compactions.reason + "): " +
      S.compactions.transitions + " in " + S.compactions.samples + " sample(s)"));
    for (const g of S.lineages || []) items.push(h("p", null, "session " + g.session + " lineages: " +
      g.lineages.map((l) => l.lineage + " " + l.sequences + " sequence(s)" + (Object.keys(l.forks).length ? " (" +
        Object.keys(l.forks).map((k) => k + " " + l.forks[k]).join(", ") + ")" : "")).join("; ")));
    if (S.suspensions) {
      const c = S.suspensions.counts;
      items.push(h("p", null, "suspensions: " + Object.keys(c).map((k) => k + " " + c[k]).join(", ") + " in " +
        S.suspensions.samples + " sample(s)" + (S.suspensions.suspended_ms ? "; suspended p50 " +
        ms(S.suspensions.suspended_ms.p50) + ", max " + ms(S.suspensions.suspended_ms.max) : "")));
    }
    if (S.problems.length) items.push(h("div", null, h("h3", null, "unreadable lines (skipped)"),
      S.problems.map((p) => h("div", { class: "note" }, p))));
    for (const note of INDEX.meta.notes) items.push(h("p", { class: "note" }, note));
    return items.length ? h("section", null, h("h2", null, "Also"), items) : null;
  }
  function lifecycleSection() {
    const L = INDEX.lifecycle;
    const url = imageUrl(L.svg);
    return h("section", { class: "lifecycle" }, h("h2", null, "The lifecycle, with this run's counts"),
      url ? h("div", { class: "scroll" }, h("img", { src: url, class: "fit",
        alt: "lifecycle diagram with the run's counts", title: "click: natural size / fit the width",
        onclick: (e) => e.target.classList.toggle("fit") }))
        : h("p", { class: "note" }, "diagram not drawn: " + (L.svg_error || "no Graphviz")),
      url ? h("p", { class: "note" }, "click the diagram to see it at its natural size (it scrolls sideways)") : null,
      h("details", null, h("summary", null, "every edge of the table"),
        h("table", null, h("tr", null, ["from", "trigger [guard]", "to", "reason", "transitions", "samples"].map((x,
          k) =>
          h("th", { class: k > 3 ? "n" : "" }, x))),
          L.edges.map((e) => h("tr", { style: e.transitions ? "" : "color:#b0b7bb" }, h("td", null, e.src),
            h("td", null, e.guard ? e.trigger + " [" + e.guard + "]" : e.trigger), h("td", null, e.dst),
            h("td", null, e.reason || ""), h("td", { class: "n" }, fmt(e.transitions)),
            h("td", { class: "n" }, fmt(e.samples)))))),
      L.unmatched.length ? h("p", { class: "err" }, "transitions today's table has no edge for: " +
        L.unmatched.map((u) => u.edge.join(" ") + " \u00d7" + u.transitions).join("; ")) : null);
  }
  function replaySection() {
    const R = INDEX.replay;
    if (!R) return null;
    const failing = ROWS.filter((r) => ["diverged", "illegal", "unfinished", "damaged"].includes(r.v[C.verdict]));
    return h("section", null, h("h2", null, "Replay"),
      h("p", null, Object.keys(R.counts || {}).map((k) => badge(k + " " + R.counts[k], k)),
        R.executed ? " re-executed from the tape" : " checked against today's table only"),
      failing.length ? h("p", null, "not identical: ", failing.slice(0, 50).map((r) =>
        h("a", { href: "#s" + r.i, style: "margin-right:8px" }, r.v[C.label]))) : null,
      R.warnings.map((w) => h("p", { class: "note" }, w)));
  }

  // ------------------------------------------------------------------------------------------------ sample table
  const filter = { text: "", status: "", reason: "", group: "", verdict: "", rmin: "", rmax: "", tmin: "", tmax: "" };
  let sortKey = null, sortDesc = false, view = ROWS, table = null;
  function setFilter(values) {
    Object.assign(filter, values);
    for (const el of document.querySelectorAll("[data-filter]")) el.value = filter[el.dataset.filter];
    if (location.hash) location.hash = "";
    else render();
    if (table) table.refresh(true);
    const el = document.getElementById("samples");
    if (el) el.scrollIntoView();
  }
  function applyFilter() {
    const num = (x) => (x === "" ? null : Number(x));
    const rmin = num(filter.rmin), rmax = num(filter.rmax), tmin = num(filter.tmin), tmax = num(filter.tmax);
    const text = filter.text.toLowerCase();
    view = ROWS.filter((r) => {
      const v = r.v;
      if (text && !String(v[C.label]).toLowerCase().includes(text) && !String(v[C.flags]).includes(text)) return false;
      if (filter.status && v[C.status] !== filter.status) return false;
      if (filter.reason && v[C.reason] !== filter.reason) return false;
      if (filter.group && String(v[C.group]) !== filter.group) return false;
      if (filter.verdict && v[C.verdict] !== filter.verdict) return false;
      if (rmin !== null && !(v[C.reward] >= rmin)) return false;
      if (rmax !== null && !(v[C.reward] <= rmax)) return false;
      if (tmin !== null && !(v[C.turns] >= tmin)) return false;
      if (tmax !== null && !(v[C.turns] <= tmax)) return false;
      return true;
    });
    if (sortKey !== null) {
      const k = C[sortKey];
      view.sort((a, b) => {
        const x = a.v[k], y = b.v[k];
        const c = x === y ? 0 : x === null || x === undefined ? 1 : y === null || y === undefined ? -1 : natural(x, y);
        return (sortDesc ? -c : c) || a.i - b.i;
      });
    }
  }
  // ids and groups in number order ("2" before "10", "7.2" before "7.10"), other text alphabetically
  const collator = new Intl.Collator("en", { numeric: true });
  function natural(x, y) {
    return typeof x === "number" && typeof y === "number" ? x - y : collator.compare(String(x), String(y));
  }
  function options(name) {
    const seen = [...new Set(ROWS.map((r) => r.v[C[name]]).filter((x) => x !== null && x !== ""))].sort(natural);
    return [h("option", { value: "" }, "any"), seen.map((x) => h("option", { value: x }, x))];
  }
  function samplesSection() {
    const ROW_H = 26;
    const count = h("span", { class: "count" });
    const viewport = h("div", { class: "viewport", id: "rows" });
    const spacer = h("div", { style: "height:0px" });
    viewport.appendChild(spacer);
    const heads = {};
    const labels = { label: "sample", group: "group", status: "status", reason: "reason", turns: "turns",
      reward: "reward", response_tokens: "tokens", duration_ms: "time", verdict: "replay", flags: "flags" };
    const head = h("div", { class: "vhead" }, COLS.map((name) => (heads[name] = h("span", {
      onclick: () => { sortDesc = sortKey === name ? !sortDesc : false; sortKey = name; refresh(true); } },
      labels[name] || name))));
    let drawn = new Map();
    function cell(r, name) {
      const x = r.v[C[name]];
      if (name === "status") return badge(x);
      if (name === "verdict") return x ? badge(x) : "";
      if (name === "reward") return typeof x === "number" ? x.toFixed(3) : "\u2013";
      if (name === "duration_ms") return x === null ? "\u2013" : (x / 1000).toFixed(2) + " s";
      return x === null || x === undefined ? "\u2013" : String(x);
    }
    function draw() {
      const top = viewport.scrollTop, height = viewport.clientHeight || 600;
      const first = Math.max(0, Math.floor(top / ROW_H) - 5), last = Math.min(view.length,
        Math.ceil((top + height) / ROW_H) + 5);
      const keep = new Map();
      for (let k = first; k < last; k++) {
        const r = view[k];
        let el = drawn.get(k);
        if (!el || el._row !== r) {
          if (el) el.remove();
          el = h("a", { class: "vrow", href: "#s" + r.i, style: "top:" + k * ROW_H + "px",
            "data-sample": r.v[C.label] },
            COLS.map((name) => h("span", null, cell(r, name))));
          el._row = r;
          viewport.appendChild(el);
        }
        keep.set(k, el);
      }
      for (const [k, el] of drawn) if (!keep.has(k)) el.remove();
      drawn = keep;
    }
    function refresh(reset) {
      applyFilter();
      for (const [, el] of drawn) el.remove();
      drawn = new Map();
      spacer.style.height = view.length * ROW_H + "px";
      if (reset) viewport.scrollTop = 0;
      count.textContent = view.length + " of " + ROWS.length + " sample runs";
      for (const name of COLS) heads[name].className = name === sortKey ? "sorted" + (sortDesc ? " desc" : "") : "";
      draw();
    }
    viewport.addEventListener("scroll", draw, { passive: true });
    const input = (key, attrs) => h("input", Object.assign({ value: filter[key], "data-filter": key,
      oninput: (e) => { filter[key] = e.target.value; refresh(true); } }, attrs));
    const select = (key, name) => {
      const el = h("select", { "data-filter": key,
        onchange: (e) => { filter[key] = e.target.value; refresh(true); } },
        options(name));
      el.value = filter[key];
      return el;
    };
    const filters = h("div", { class: "filters" },
      h("label", null, "sample ", input("text", { type: "search", placeholder: "id or flag", size: 10 })),
      h("label", null, "status ", select("status", "status")), h("label", null, "reason ", select("reason",
        "reason")),
      h("label", null, "group ", select("group", "group")),
      h("label", null, "reward ", input("rmin", { type: "number", step: "any", placeholder: "min" }), " \u2013 ",
        input("rmax", { type: "number", step: "any", placeholder: "max" })),
      h("label", null, "turns ", input("tmin", { type: "number", placeholder: "min" }), " \u2013 ",
        input("tmax", { type: "number", placeholder: "max" })),
      INDEX.replay ? h("label", null, "replay ", select("verdict", "verdict")) : null, count);
    table = { refresh: refresh };
    const sec = h("section", { id: "samples" }, h("h2", null, "Samples"), filters, head, viewport);
    requestAnimationFrame(() => refresh(false));
    return sec;
  }

  // ------------------------------------------------------------------------------------------------ sample page
  function timelineSection(d) {
    const total = d.timeline.reduce((a, e) => a + (e.dwell_ms || 0), 0) || 1;
    const gantt = h("div", { class: "gantt" }, d.timeline.filter((e) => e.dwell_ms).map((e) => h("div", {
      style: "width:" + (100 * e.dwell_ms / total) + "%;background:" + (STATE_COLOURS[e.src] || "#cfd8dc"),
      title: e.src + " " + ms(e.dwell_ms) })));
    const used = [...new Set(d.timeline.map((e) => e.src))].filter((s) => STATE_COLOURS[s]);
    const last = d.timeline[d.timeline.length - 1];
    return h("section", null, h("h2", null, "Timeline"),
      last && last.terminal ? h("p", null, "ended by ", h("b", null,
        last.src + " --" + last.trigger + "--> " + last.dst),
        " with reason ", h("b", null, last.reason || "\u2013")) : h("p", { class: "err" },
          "unfinished: no terminal edge"),
      gantt, h("div", { class: "legend" }, used.map((s) => h("span", null, h("i",
        { style: "background:" + STATE_COLOURS[s] }), s))),
      h("table", { class: "timeline" }, h("tr", null, ["+s", "dwell", "turn", "transition", "reason",
        "fields"].map((x) => h("th", null, x))),
        d.timeline.map((e) => h("tr", { class: e.terminal ? "terminal" : "" }, h("td", { class: "n" },
          e.at === null ? "" : e.at.toFixed(3)),
          h("td", { class: "n" }, ms(e.dwell_ms)), h("td", { class: "n" }, e.turn),
          h("td", null, e.src + " --" + e.trigger + "--> " + e.dst), h("td", null, e.reason || ""),
          h("td", null, e.detail.map(([k, v]) => k + "=" + v).join("  "))))));
  }
  function parts(list) {
    return list.map((p) => {
      if (p.kind === "image") { const url = imageUrl(p.url); return url ? h("img", { src: url,
        alt: "image" }) : null; }
      if (p.kind === "think") return h("span", { class: "part think" }, h("span", { class: "tag" }, "THINKING"),
        p.text);
      if (p.kind === "tool_call") return h("span", { class: "part tool_call" }, h("span", { class: "tag" },
        "TOOL CALL"), p.text);
      return h("span", { class: "part text" }, p.text);
    });
  }
  function conversationSection(d) {
    const c = d.conversation;
    if (!c) return h("section", null, h("h2", null, "Conversation"),
      h("p", { class: "note" }, "no tape or results row for this sample: the trace gives its timeline only"));
    return h("section", null, h("h2", null, "Conversation", h("span", { class: "note" },
      "  (from the " + d.source + ")")),
      c.prompt.map((m) => h("div", { class: "msg " + m.role }, h("span", { class: "role" },
        m.role === "prompt" ? "prompt" : "prompt · " + m.role),
        parts(m.parts))),
      c.label === null || c.label === undefined ? null : h("div", { class: "msg system" },
        h("span", { class: "role" }, "label"), c.label),
      c.turns.map((t) => [
        (t.events || []).map((e) => h("div", { class: "msg system event" }, h("span", { class: "role" },
          "lifecycle"), e)),
        h("div", { class: "msg assistant" }, h("span", { class: "role" },
          t.turn === null ? "model (whole response)" : "model · turn " + t.turn),
          parts(t.parts)),
        t.env ? h("div", { class: "msg env" }, h("span", { class: "role" }, "environment"),
          t.env.error ? h("span", { class: "err" }, "env.step raised " + t.env.error)
            : "done=" + t.env.done + "\n" + t.env.observation) : null,
        t.observation ? h("div", { class: "msg observation" }, h("span", { class: "role" },
          "observation appended · " +
          t.observation.role + (t.observation_tokens !== undefined ? " · " + t.observation_tokens +
            " masked tokens" : "")),
          parts(t.observation.parts)) : null]),
      h("div", { class: "msg system" }, h("span", { class: "role" }, "reward"),
        c.reward === null || c.reward === undefined ? "\u2013" : String(c.reward)),
      c.error ? h("div", { class: "msg system err" }, h("span", { class: "role" }, "error"),
        typeof c.error === "object" ? (c.error.type || "") + ": " +
          (c.error.message || JSON.stringify(c.error)) : String(c.error)) : null);
  }
  function expandRuns(runs, n) {
    const out = new Uint8Array(n);
    let k = 0;
    for (const [v, count] of runs) { out.fill(v, k, Math.min(n, k + count)); k += count; }
    return out;
  }
  function showText(text) { return text.replace(/\n/g, "\u21b5\n").replace(/\t/g, "\u21e5"); }
  function stripSection(d) {
    const T = d.tokens;
    if (!T) return h("section", null, h("h2", null, "Tokens"), h("p", { class: "note" },
      "no token data for this sample"));
    const n = T.ids.length;
    const mask = expandRuns(T.mask, n);
    const kind = new Array(n).fill("");
    const prompt = new Uint8Array(n), image = new Uint8Array(n), eos = new Uint8Array(n);
    for (const [a, b] of T.prompts) prompt.fill(1, a, b);
    for (const [a, b] of T.images) image.fill(1, a, b);
    for (const k of T.eos) eos[k] = 1;
    const version = new Array(n).fill(null);
    for (const [a, b, v] of T.versions) for (let k = a; k < b && k < n; k++) version[k] = v;
    const marks = new Map();
    const mark = (k, cls, text) => { if (!marks.has(k)) marks.set(k, []); marks.get(k).push(h("span",
      { class: "mark " + cls }, text)); };
    for (const [a, , name] of T.sequences) mark(a, "seq", "\u2503 " + name);
    for (const [a, , kindName, turn] of T.segments) mark(a, kindName === "model" ? "turn" : "obs",
      kindName === "model" ? "turn " + turn : "observation");
    let lastVersion = null;
    for (let k = 0; k < n; k++) if (version[k] !== null && version[k] !== lastVersion) { mark(k, "ver",
      "weights " + version[k]); lastVersion = version[k]; }
    for (const [a] of T.images) mark(a, "img", "image");
    const div = d.replay && d.replay.divergence;
    const at = div ? div.strip_index : null;  // the strip runs a forked rollout's sequences end to end
    if (div && at !== null && at !== undefined && at < n) {
      mark(at, "div", "\u2716 replay diverges here");
    }
    const deltas = VIEWS.stripDeltas(d, T, n);  // |Δ logprob| per token with --mismatch
    const info = h("div", { class: "tokinfo" },
      "hover a token: its position, id, decoded text, mask, logprob and weight version");
    const strip = h("div", { class: "strip" });
    let trained = 0, masked = 0, promptCount = 0;
    const showPrompt = h("input", { type: "checkbox" });
    function describe(k) {
      const text = T.texts ? T.texts[String(T.ids[k])] : undefined;
      return "#" + k + "  id " + T.ids[k] + "  text " +
        (text === undefined ? "(no tokenizer)" : JSON.stringify(text)) +
        "  " + (prompt[k] ? "prompt" : mask[k] ? "trained" : "masked") + (eos[k] ? "  inserted EOS" : "") +
          (image[k] ? "  image" : "") +
        (T.logprobs && !prompt[k] ? "  logprob " + T.logprobs[k] : "") + (version[k] !== null ? "  weights " +
          version[k] : "") + (deltas && deltas[k] >= 0 ? "  |\u0394logprob| " + deltas[k] : "");
    }
    function fill() {
      strip.textContent = "";
      const frag = document.createDocumentFragment();
      for (let k = 0; k < n; k++) {
        const hidden = prompt[k] && !showPrompt.checked;
        const first = !prompt[k] || k === 0 || !prompt[k - 1];
        if (hidden && !first) continue;  // one note stands for a hidden prompt
        if (marks.has(k)) for (const m of marks.get(k)) frag.appendChild(m.cloneNode(true));
        if (hidden) {
          frag.appendChild(h("span", { class: "note" }, "[" + countPrompt(k) + " prompt tokens hidden] "));
          continue;
        }
        const text = T.texts ? T.texts[String(T.ids[k])] : undefined;
        const cls = "tok" + (prompt[k] ? " prompt" : mask[k] ? " trained" : " masked") + (image[k] ? " image" : "") +
          (eos[k] ? " eos" : "");
        const el = document.createElement("span");
        el.className = cls;
        el.dataset.k = k;
        const tint = deltas ? VIEWS.deltaColour(deltas[k]) : null;
        if (tint) el.style.background = tint;
        el.textContent = text === undefined ? String(T.ids[k]) + " " : showText(text);
        frag.appendChild(el);
      }
      strip.appendChild(frag);
    }
    function countPrompt(k) { let e = k; while (e < n && prompt[e]) e++; return e - k; }
    for (let k = 0; k < n; k++) { if (prompt[k]) promptCount++; else if (mask[k]) trained++; else masked++; }
    strip.addEventListener("mouseover", (e) => {
      const k = e.target.dataset ? e.target.dataset.k : undefined;
      if (k !== undefined) info.textContent = describe(Number(k));
    });
    showPrompt.addEventListener("change", fill);
    fill();
    return h("section", { id: "tokens" }, h("h2", null, "Tokens"),
      h("p", { class: "note" },
        n + " tokens: " + promptCount + " prompt, " + trained + " trained (loss mask 1), " + masked +
          " masked (loss mask 0)" +
        (T.texts ? "" : "; no tokenizer, ids shown")),
      h("div", { class: "legend" }, h("span", null, h("i", { style: "background:var(--train)" }), "trained"),
        h("span", null, h("i", { style: "background:var(--mask)" }), "masked"), h("span", null, h("i",
          { style: "background:var(--prompt);border:1px solid #ddd" }), "prompt"),
        h("span", null, h("i", { style: "outline:2px solid var(--eos)" }), "inserted EOS"), h("span", null, h("i",
          { style: "background:var(--img)" }), "image"),
        deltas ? h("span", null, h("i", { style: "background:linear-gradient(90deg," + VIEWS.deltaColour(0) + "," +
          VIEWS.deltaColour(1) + ")" }), "trained, by |\u0394logprob| (0 to \u2265 1)") : null,
        h("label", null, showPrompt, " show prompt tokens")),
      info, strip);
  }
  function replayBox(d) {
    const R = d.replay;
    if (!R) return null;
    const v = R.divergence;
    const items = [h("h2", null, "Replay ", badge(R.verdict))];
    if (v) {
      const where = [v.turn !== null && v.turn !== undefined ? "turn " + v.turn : null,
        v.state ? "state " + v.state : null,
        v.index !== null && v.index !== undefined ? "index " + v.index : null,
          v.line ? "line " + v.line : null].filter(Boolean).join(", ");
      const val = (x) => (typeof x === "string" ? x : JSON.stringify(x));
      const raised = v.kind === "error" && v.actual && typeof v.actual === "object" ? v.actual : null;
      // an error today: the message holds the error, what the recording did instead and what followed; each is
      // shown once, on its own line
      const cut = raised ? v.message.indexOf("; after it, ") : -1;
      const head = cut >= 0 ? v.message.slice(0, cut) : v.message;
      const then = raised ? (head.match(/\((the recording [^]*)\)$/) || [])[1] : undefined;
      items.push(h("div", { class: "diverge" }, h("p", null, h("b", null, "first divergence: " + v.kind),
        where ? " at " + where : "", raised ? null : h("br"), raised ? null : v.message),
        raised ? h("p", { class: "err" }, "today's run raised " + raised.type + ": " + raised.message +
          (raised.state ? " (in state " + raised.state + ", on " + raised.trigger + ")" : "")) : null,
        raised ? h("p", { class: "note" }, then || (v.expected === null ? "the recording did not fail here"
          : "the recording failed otherwise")) : null,
        raised && cut >= 0 ? h("p", { class: "note" }, "what followed: " + v.message.slice(cut + 12)) : null,
        !raised && (v.expected !== null || v.actual !== null) ? h("div", { class: "ctx" },
          h("span", null, "recorded"), h("span", { class: "exp" }, val(v.expected)),
          h("span", null, "today"), h("span", { class: "act" }, val(v.actual))) : null,
        v.context ? h("div", { class: "ctx", style: "margin-top:8px" }, h("span", null, "text before"), h("span",
          null, "\u2026" + v.context.before),
          h("span", null, "recorded"), h("span", { class: "exp" }, v.context.expected + "\u2026"),
          h("span", null, "today"), h("span", { class: "act" }, v.context.actual + "\u2026")) : null));
    }
    if (R.turns_replayed !== null && R.turns_replayed !== undefined) items.push(h("p", { class: "note" },
      "turns replayed: " + R.turns_replayed + " of " + R.turns));
    for (const f of R.findings || []) items.push(h("p", { class: "note" }, f));
    for (const f of R.notes || []) items.push(h("p", { class: "note" }, "note: " + f));
    return h("section", { id: "replay" }, items);
  }
  function samplePage(i) {
    const row = ROWS[i];
    if (row && !document.getElementById("d" + i) && document.readyState === "loading") {
      document.addEventListener("DOMContentLoaded", render, { once: true });  // its data is not parsed yet
      return h("main", null, h("p", { class: "loading" }, "loading sample data\u2026"));
    }
    const d = detail(i);
    if (!d || !row) return h("main", null, h("p", { class: "err" }, "no such sample"), h("a", { href: "#" }, "back"));
    const pos = view.indexOf(row);
    const prev = pos > 0 ? view[pos - 1].i : null, next = pos >= 0 && pos + 1 < view.length ? view[pos + 1].i : null;
    return h("main", { id: "sample" },
      h("div", { class: "nav" }, h("a", { href: "#" }, "\u2190 all samples"),
        prev !== null ? h("a", { href: "#s" + prev }, "\u2039 previous") : null, next !== null ? h("a",
          { href: "#s" + next }, "next \u203a") : null),
      h("section", null, h("h2", null, "Sample " + d.label + " ", badge(d.status), d.reason ? badge(d.reason,
        "reason") : null),
        h("p", { class: "note" },
          d.turns + " turn(s) · group " + fmt(row.v[C.group]) + " · reward " + fmt(row.v[C.reward], 3) +
          (d.session_id ? " · session " + d.session_id : "") + (d.rollout_uid ? " · rollout " + d.rollout_uid : ""))),
      replayBox(d), timelineSection(d), conversationSection(d), stripSection(d));
  }

  // ------------------------------------------------------------------------------------------------ routing
  let overview = null;
  function render() {
    const m = /^#s(\d+)$/.exec(location.hash);
    app.textContent = "";
    app.appendChild(header());
    if (m) { app.appendChild(samplePage(Number(m[1]))); window.scrollTo(0, 0); return; }
    if (!overview) overview = h("main", null, cards(), h("div", { class: "grid" }, statuses(), turnsAndTokens(),
      timeSection()),
      groupsSection(), VIEWS.overview.map((view) => view(h, INDEX)), extrasSection(), replaySection(), samplesSection(), lifecycleSection());
    app.appendChild(overview);
    if (table) requestAnimationFrame(() => table.refresh(false));
  }
  window.addEventListener("hashchange", render);
  render();
  // ready once the first frame with the table has been painted (what the browser tests and the timing wait for)
  requestAnimationFrame(() => requestAnimationFrame(() => {
    window.reportReadyMs = performance.now();
    document.body.dataset.ready = "1";
  }));
})();
