"use strict";
// The report's training views: each group's token tree, and the train/inference mismatch (--mismatch). This script
// runs before report.js, which calls these with its DOM helper h (text nodes only, never markup) and the index.
window.fsmReportViews = (function () {
  function num(value, digits) {
    if (value === null || value === undefined) return "\u2013";
    if (Number.isInteger(value)) return value.toLocaleString("en-US");
    return Math.abs(value) < 1e-3 && value !== 0 ? value.toExponential(2) : value.toFixed(digits || 4);
  }
  function table(h, head, rows) {
    return h("table", { class: "views" }, h("thead", null, h("tr", null, head.map((c) => h("th", null, c)))),
      h("tbody", null, rows.map((r) => h("tr", null, r.map((c) => h("td", null, c))))));
  }

  // one tree: a line per node, indented by its tree depth, a bar as long as its tokens (shared nodes darker)
  function treeView(h, tree) {
    const level = new Map();
    const longest = Math.max(1, ...tree.nodes.map((n) => n[3]));
    const lines = tree.nodes.map((n) => {
      const [id, parent, depth, tokens, generated, shared, images] = n;
      const indent = parent >= 0 && level.has(parent) ? level.get(parent) + 1 : 0;
      level.set(id, indent);
      const width = Math.max(2, Math.round(240 * tokens / longest));
      return h("div", { class: "tnode", style: "padding-left:" + (indent * 18) + "px",
        title: "node " + id + ": positions " + depth + "\u2013" + (depth + tokens - 1) + ", " + tokens +
          " tokens, " + generated + " generated, shared by " + shared + " sequence(s)" +
          (images ? ", " + images + " image(s)" : "") },
        h("span", { class: "tbar" + (shared > 1 ? " shared" : ""), style: "width:" + width + "px" }),
        " #" + id + " @" + depth + " \u00b7 " + num(tokens) + " tok" + (generated ? " \u00b7 " + num(generated) +
          " generated" : "") + (shared > 1 ? " \u00b7 shared \u00d7" + shared : "") + (images ? " \u00b7 " +
          images + " image(s)" : ""));
    });
    const s = tree.stats;
    const splits = Object.entries(s.provenance_splits || {}).filter((e) => e[1] > 0);
    return h("details", { class: "tree" }, h("summary", null, tree.name + ": " + num(s.tree_tokens) + " tree tokens for " +
      num(s.flat_tokens) + " flat (" + (s.flat_tokens ? (100 * s.tree_tokens / s.flat_tokens).toFixed(0) : "\u2013") +
      "%), " + s.sequences + " sequence(s), " + s.nodes + " node(s)"),
      splits.length ? h("p", { class: "note" }, "kept apart by provenance: " + splits.map((e) => e[0] + " " + e[1])
        .join(", ")) : null,
      lines, tree.hidden_nodes ? h("p", { class: "note" }, tree.hidden_nodes + " more node(s) not drawn") : null);
  }
  function treesSection(h, index) {
    const trees = index.trees || [];
    if (!trees.length) return null;
    let flat = 0, tree = 0;
    for (const t of trees) { flat += t.stats.flat_tokens; tree += t.stats.tree_tokens; }
    return h("section", { id: "trees" }, h("h2", null, "Token trees"),
      h("p", { class: "note" }, "what a trainer gets from training_tree(results): shared prefixes once; " +
        num(tree) + " tree tokens for " + num(flat) + " in flat rows over " + trees.length + " tree(s)"),
      trees.map((t) => treeView(h, t)));
  }

  function mismatchSection(h, index) {
    const M = index.mismatch;
    if (!M) return null;
    const t = M.totals;
    return h("section", { id: "mismatch" }, h("h2", null, "Train/inference mismatch"),
      h("p", { class: "note" }, M.file + ": " + num(t.tokens) + " trained tokens, K1 " + num(t.k1) + ", K3 " +
        num(t.k3) + ", max |\u0394| " + num(t.max_abs_delta) + ", TIS-clipped " + num(t.tis_clipped_fraction) +
        ", IcePop-masked " + num(t.icepop_masked_fraction)),
      h("h3", null, "K3 per step"), table(h, ["step", "K3", "tokens"], M.steps.map((s) => [s[0], num(s[1]),
        num(s[2])])),
      h("h3", null, "Per rollout event"), table(h, ["dimension", "group", "tokens", "K3", "max |\u0394|",
        "staleness"], M.events.map((e) => [e.dimension, e.label, num(e.tokens), num(e.k3), num(e.max_abs_delta),
        e.staleness === null || e.staleness === undefined ? "\u2013" : String(e.staleness)])),
      h("h3", null, "Worst sequences"), table(h, ["sequence", "sample", "branch", "tokens", "K3", "max |\u0394|"],
        M.worst.map((w) => [h("a", { href: "#s" + w.row }, String(w.sequence)), w.index === null ? "\u2013" :
          String(w.index), String(w.branch), num(w.tokens), num(w.k3), num(w.max_abs_delta)])));
  }

  // |Δ logprob| per token of a sample's strip (its sequences end to end), or null without mismatch data
  function stripDeltas(d, T, n) {
    if (!d.mismatch) return null;
    const out = new Float64Array(n).fill(-1);
    const starts = T.sequences && T.sequences.length ? T.sequences.map((s) => s[0]) : [0];
    d.mismatch.forEach((m, s) => {
      const base = (s < starts.length ? starts[s] : 0) + m.prompt;
      m.delta.forEach((v, p) => { if (base + p < n) out[base + p] = v; });
    });
    return out;
  }
  function deltaColour(v) {
    if (v < 0) return null;
    const x = Math.min(1, Math.log10(1 + v * 1e4) / 4);  // 0 at |Δ| = 0, full at |Δ| >= 1
    return "hsl(" + Math.round(120 * (1 - x)) + ",70%," + Math.round(88 - 30 * x) + "%)";
  }
  return { overview: [treesSection, mismatchSection], stripDeltas: stripDeltas, deltaColour: deltaColour };
})();
