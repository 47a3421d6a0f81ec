// attnlab heads page: inlined into index.html by attnlab/heads/page.py, which documents the data.
// Notation: L layers, H query heads, G K/V heads, T tokens; i a query row, j a key column.
// Reads #attnlab-meta once; a head's full pattern (#pattern-l-h) is decoded when it is first opened.
"use strict";
(function () {
  const timings = { scriptStart: performance.now() };
  const META = JSON.parse(document.getElementById("attnlab-meta").textContent);
  const L = META.model.n_layers, H = META.model.n_heads, G = META.model.n_kv_heads;
  const PER_GROUP = H / G; // query heads that read one K/V head: head h reads K/V head floor(h / PER_GROUP)
  const TOKENS = META.text.tokens, T = TOKENS.length;
  const PAD = META.text.key_padding; // (T,) true = padding key, or null
  const FULL_ROW = new Uint8Array(T); // 1 = a query row that sees no key at all
  for (const i of META.text.fully_masked_rows) FULL_ROW[i] = 1;
  const S = META.thumb.size, CODES = META.thumb.codes;
  const THUMBS = b64bytes(META.thumb.data); // (L, H, S, S) codes
  const EMBEDDED = new Set(META.patterns.embedded.map(([l, h]) => l + "," + h));
  const SCORE_NAMES = Object.keys(META.scores);
  const TOO_SHORT = META.too_short || {}; // score -> why the text is too short to tell it (its values are null)
  const SHORT_LABEL = META.too_short_label || "too short to tell";
  const LABEL_W = 96, LABEL_H = 72; // px of the detail canvas given to query (left) and key (top) labels
  const ZOOMS = [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 32]; // px per cell in the detail view

  const KIND_STYLE = {
    induction: ["I", "#c0392b"],
    duplicate: ["D", "#8e44ad"],
    "previous-token": ["P", "#d35400"],
    sink: ["S", "#2c3e50"],
    local: ["L", "#16a085"],
    uniform: ["U", "#7f8c8d"],
    mixed: ["M", "#a0a8b0"],
    undecided: ["?", "#c3c8cf"], // a rule it had to be tested on is too short to tell
  };
  const kindStyle = (kind) => KIND_STYLE[kind] || [kind.charAt(0).toUpperCase(), "#777"];

  // Colours: codes 0..CODES.max are round(max * sqrt(weight)) on a viridis-like ramp; each mask has
  // a pale colour and its own stripes (future: diagonal, fully-masked row: horizontal, padding: vertical).
  const STOPS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  const PALETTE = new Uint8Array(256 * 3);
  for (let c = 0; c <= CODES.max; c++) {
    const pos = (c / CODES.max) * (STOPS.length - 1);
    const k = Math.min(Math.floor(pos), STOPS.length - 2), f = pos - k;
    for (let ch = 0; ch < 3; ch++) PALETTE[c * 3 + ch] = Math.round(STOPS[k][ch] * (1 - f) + STOPS[k + 1][ch] * f);
  }
  const MASKS = {
    future: { code: CODES.future, base: [238, 238, 238], stripe: [200, 200, 200], label: "future key (causal mask), or outside a sliding window" },
    row: { code: CODES.row, base: [248, 205, 205], stripe: [205, 110, 110], label: "fully-masked row (sees no key)" },
    pad: { code: CODES.pad, base: [252, 226, 186], stripe: [214, 150, 70], label: "padding key" },
  };
  const MASK_OF_CODE = {};
  for (const name in MASKS) MASK_OF_CODE[MASKS[name].code] = name;

  // Write the colour of `code` at virtual pixel (vx, vy) into data[o..o+3].
  function paint(data, o, code, vx, vy) {
    let rgb;
    if (code <= CODES.max) {
      data[o] = PALETTE[code * 3];
      data[o + 1] = PALETTE[code * 3 + 1];
      data[o + 2] = PALETTE[code * 3 + 2];
      data[o + 3] = 255;
      return;
    }
    const mask = MASKS[MASK_OF_CODE[code]];
    const stripe =
      code === CODES.future ? (vx + vy) % 6 < 2 : code === CODES.row ? vy % 6 < 2 : vx % 6 < 2;
    rgb = stripe ? mask.stripe : mask.base;
    data[o] = rgb[0];
    data[o + 1] = rgb[1];
    data[o + 2] = rgb[2];
    data[o + 3] = 255;
  }

  function b64bytes(text) {
    const bin = atob(text);
    const out = new Uint8Array(bin.length);
    for (let k = 0; k < bin.length; k++) out[k] = bin.charCodeAt(k);
    return out;
  }

  const weightCode = (w) => Math.round(Math.sqrt(Math.max(0, Math.min(1, w))) * CODES.max);
  const show = (tok) => tok.replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5").replace(/ /g, "\u00b7");
  const el = (tag, props, ...children) => {
    const node = document.createElement(tag);
    if (props) for (const key in props) {
      if (key === "dataset") Object.assign(node.dataset, props[key]);
      else if (key in node) node[key] = props[key];
      else node.setAttribute(key, props[key]);
    }
    for (const child of children) node.append(child);
    return node;
  };
  const badge = (kind) => {
    const [letter, colour] = kindStyle(kind);
    const b = el("span", { className: "badge", title: kind }, letter);
    b.style.background = colour;
    return b;
  };
  const kindText = (kind) => (kind === "undecided" ? `undecided (${SHORT_LABEL})` : kind);
  const fmt = (v) => (v === null ? SHORT_LABEL : Number.isInteger(v) ? String(v) : v.toFixed(3));

  // ---- header ----
  const nPad = PAD ? PAD.filter(Boolean).length : 0;
  const probe = META.probe || {};
  document.getElementById("title").textContent = "attnlab \u00b7 " + META.model.name + ": attention heads";
  document.getElementById("summary").textContent =
    `${L} layers \u00d7 ${H} heads (${G} K/V head${G === 1 ? "" : "s"}, ${PER_GROUP} query head${PER_GROUP === 1 ? "" : "s"} each)` +
    ` \u00b7 ${T} tokens${nPad ? ` (${nPad} padding)` : ""}` +
    (probe.n
      ? ` \u00b7 induction probe (${probe.n} random tokens repeated, batch ${probe.batch}): loss ` +
        `${Number(probe.loss_first_copy).toFixed(2)} on the first copy, ${Number(probe.loss_second_copy).toFixed(2)} on the second`
      : "");
  const note = document.getElementById("embed-note");
  const nEmbedded = EMBEDDED.size;
  if (nEmbedded === L * H) {
    note.textContent = `Full float32 patterns embedded for all ${L * H} heads.`;
  } else {
    note.className = "partial";
    note.textContent =
      `Full float32 patterns embedded for ${nEmbedded} of ${L * H} heads (page budget ${META.patterns.budget_mb} MiB; ` +
      `${META.patterns.selection}). The other ${L * H - nEmbedded}, marked \u25e6 in the grid, are not embedded: ` +
      "clicking one shows its thumbnail enlarged.";
  }

  const shortNames = Object.keys(TOO_SHORT);
  if (shortNames.length) {
    const shortNote = document.getElementById("short-note");
    shortNote.hidden = false;
    shortNote.className = "partial";
    shortNote.textContent =
      `${SHORT_LABEL[0].toUpperCase() + SHORT_LABEL.slice(1)} on this text: ${shortNames.join(", ")} ` +
      `(${shortNames.map((name) => TOO_SHORT[name]).join("; ")}). Heads a rule on them would decide are undecided (?).`;
  }

  // ---- the layer x head grid of thumbnails ----
  const kindLegend = document.getElementById("kind-legend");
  const rules = {};
  for (const r of META.thresholds) rules[r.kind] = `${r.score} ${r.op === ">=" ? "\u2265" : "\u2264"} ${r.value}`;
  rules.undecided = SHORT_LABEL;
  for (const kind of Object.keys(KIND_STYLE)) {
    kindLegend.append(el("span", { className: "kind" }, badge(kind), `${kind}${rules[kind] ? " (" + rules[kind] + ")" : ""}`));
  }

  function scoreLines(l, h) {
    return SCORE_NAMES.map((name) => `${name} ${fmt(META.scores[name][l][h])}`).join("\n");
  }

  function drawThumb(canvas, l, h) {
    const ctx = canvas.getContext("2d");
    const img = ctx.createImageData(S, S);
    const off = (l * H + h) * S * S;
    for (let y = 0; y < S; y++) for (let x = 0; x < S; x++) paint(img.data, (y * S + x) * 4, THUMBS[off + y * S + x], x, y);
    ctx.putImageData(img, 0, 0);
  }

  const grid = document.getElementById("grid");
  const cells = [];
  for (let l = 0; l < L; l++) {
    const row = el("div", { className: "layer-row", dataset: { layer: l } }, el("div", { className: "layer-label" }, "L" + l));
    for (let g = 0; g < G; g++) {
      const group = el("div", { className: "kv-group", dataset: { layer: l, kv: g }, title: `layer ${l}, K/V head ${g}` });
      group.append(el("span", { className: "group-label" }, "kv" + g));
      for (let h = g * PER_GROUP; h < (g + 1) * PER_GROUP; h++) {
        const kind = META.kinds[l][h];
        const embedded = EMBEDDED.has(l + "," + h);
        const canvas = el("canvas", { width: S, height: S });
        const cell = el(
          "div",
          {
            className: "cell" + (embedded ? "" : " thumb-only"),
            dataset: { layer: l, head: h, kv: g, kind: kind, embedded: embedded ? "true" : "false" },
            tabIndex: 0,
            role: "button",
            title: `layer ${l}, head ${h} (K/V head ${g}): ${kindText(kind)}${embedded ? "" : ", thumbnail only"}\n${scoreLines(l, h)}`,
          },
          canvas,
          el("span", { className: "head-label" }, "h" + h),
          badge(kind),
        );
        drawThumb(canvas, l, h);
        cells.push(cell);
        group.append(cell);
      }
      row.append(group);
    }
    grid.append(row);
  }
  const openFromEvent = (e) => {
    const cell = e.target.closest(".cell");
    if (cell) openHead(Number(cell.dataset.layer), Number(cell.dataset.head));
  };
  grid.addEventListener("click", openFromEvent);
  grid.addEventListener("keydown", (e) => {
    if (e.key === "Enter" || e.key === " ") {
      e.preventDefault();
      openFromEvent(e);
    }
  });
  timings.gridReady = performance.now();

  // ---- the sortable table of scores ----
  const COLUMNS = [
    { key: "layer", label: "layer", numeric: true },
    { key: "head", label: "head", numeric: true },
    { key: "kv", label: "kv head", numeric: true },
    { key: "kind", label: "kind", numeric: false },
    { key: "pattern", label: "pattern", numeric: false, doc: "full: every weight embedded; thumb: thumbnail only" },
    ...SCORE_NAMES.map((name) => ({ key: name, label: name, numeric: true, score: true, doc: META.score_docs[name] })),
  ];
  const table = document.getElementById("scores");
  const headRow = el("tr");
  for (const col of COLUMNS) {
    const th = el("th", { scope: "col", dataset: { key: col.key }, title: col.doc || "" }, col.label);
    if (!col.numeric) th.className = "kind";
    headRow.append(th);
  }
  table.tHead.append(headRow);
  const tableRows = [];
  for (let l = 0; l < L; l++) {
    for (let h = 0; h < H; h++) {
      const values = {
        layer: l,
        head: h,
        kv: Math.floor(h / PER_GROUP),
        kind: META.kinds[l][h],
        pattern: EMBEDDED.has(l + "," + h) ? "full" : "thumb",
      };
      for (const name of SCORE_NAMES) values[name] = META.scores[name][l][h];
      const tr = el("tr", { dataset: { layer: l, head: h } });
      for (const col of COLUMNS) {
        const v = values[col.key];
        const td = el("td", { dataset: { key: col.key, value: v === null ? "" : v } }, col.key === "kind" ? badge(v) : "", col.numeric ? fmt(v) : (col.key === "kind" ? " " : "") + v);
        if (!col.numeric) td.className = "kind";
        if (v === null) {
          td.className = "short";
          td.title = TOO_SHORT[col.key] || SHORT_LABEL;
        }
        tr.append(td);
      }
      tableRows.push({ tr, values });
    }
  }
  table.tBodies[0].append(...tableRows.map((r) => r.tr));
  table.tHead.addEventListener("click", (e) => {
    const th = e.target.closest("th");
    if (!th) return;
    const col = COLUMNS.find((c) => c.key === th.dataset.key);
    const was = th.getAttribute("aria-sort");
    // a score sorts highest first on the first click, a label column A-Z; a second click reverses
    const dir = was ? (was === "ascending" ? "descending" : "ascending") : col.score ? "descending" : "ascending";
    for (const other of headRow.children) other.removeAttribute("aria-sort");
    th.setAttribute("aria-sort", dir);
    const sign = dir === "ascending" ? 1 : -1;
    const cmp = (a, b) => (col.numeric ? a - b : String(a).localeCompare(String(b)));
    // a score too short to tell (null) sorts last either way
    const nulls = (a, b) => (a === null) - (b === null);
    tableRows.sort((a, b) => {
      const va = a.values[col.key], vb = b.values[col.key];
      const order = va === null || vb === null ? nulls(va, vb) : sign * cmp(va, vb);
      return order || a.values.layer - b.values.layer || a.values.head - b.values.head;
    });
    table.tBodies[0].append(...tableRows.map((r) => r.tr));
  });
  table.tBodies[0].addEventListener("click", (e) => {
    const tr = e.target.closest("tr");
    if (!tr) return;
    openHead(Number(tr.dataset.layer), Number(tr.dataset.head));
    document.getElementById("detail").scrollIntoView({ block: "nearest" });
  });

  // ---- the detail view: one head's pattern on a canvas, drawn only for the visible window ----
  const detail = document.getElementById("detail");
  const scroller = document.getElementById("detail-scroller");
  const spacer = document.getElementById("detail-spacer");
  const sticky = document.getElementById("detail-sticky");
  const canvas = document.getElementById("detail-canvas");
  const cursor = document.getElementById("detail-cursor");
  const hoverQuery = document.getElementById("hover-query");
  const hoverKey = document.getElementById("hover-key");
  const hoverWeight = document.getElementById("hover-weight");
  const patterns = new Map(); // "l,h" -> Float32Array of the lower triangle
  // n: rows (= columns) drawn: T for a full pattern, S for an enlarged thumbnail
  const view = { layer: -1, head: -1, full: false, n: 0, cell: 0, pattern: null, thumbOffset: 0 };

  function loadPattern(l, h) {
    const key = l + "," + h;
    if (!patterns.has(key)) {
      const tag = document.getElementById(`pattern-${l}-${h}`);
      if (!tag) return null;
      const bytes = b64bytes(JSON.parse(tag.textContent));
      patterns.set(key, new Float32Array(bytes.buffer, 0, bytes.length / 4));
    }
    return patterns.get(key);
  }

  function fitCell(n) {
    scroller.style.maxWidth = scroller.style.maxHeight = "none";
    const area = Math.min(scroller.clientWidth - LABEL_W, scroller.clientHeight - LABEL_H);
    let best = 0;
    for (const z of ZOOMS) if (z * n <= area) best = z;
    return Math.max(best, 4);
  }

  function openHead(l, h) {
    const t0 = performance.now();
    const full = EMBEDDED.has(l + "," + h);
    const pattern = full ? loadPattern(l, h) : null;
    if (full && !pattern) {
      // its tag comes later in the file than this script and has not been parsed yet
      document.addEventListener("DOMContentLoaded", () => openHead(l, h), { once: true });
      document.getElementById("detail-message").textContent = "Loading this head's pattern\u2026";
      return;
    }
    detail.hidden = false;
    document.getElementById("detail-hint").hidden = true;
    const n = full ? T : S;
    const resized = n !== view.n;
    Object.assign(view, { layer: l, head: h, full, n, pattern, thumbOffset: (l * H + h) * S * S });
    if (resized || !view.cell) view.cell = fitCell(n);
    const g = Math.floor(h / PER_GROUP);
    document.getElementById("detail-title").textContent =
      `Layer ${l}, head ${h} (K/V head ${g}): ${kindText(META.kinds[l][h])}`;
    document.getElementById("detail-message").textContent = full
      ? ""
      : `Full pattern not embedded in this page (page budget ${META.patterns.budget_mb} MiB holds ${EMBEDDED.size} of ` +
        `${L * H} heads): showing its ${S}\u00d7${S} max-pooled thumbnail enlarged, each cell the largest weight of its ` +
        "bin. Save with a larger page_budget_mb, or write_page(report, path, heads=[(layer, head)]), to see every weight.";
    Object.assign(detail.dataset, { layer: l, head: h, kv: g, embedded: full ? "true" : "false" });
    for (const c of cells) c.classList.toggle("selected", c.dataset.layer === String(l) && c.dataset.head === String(h));
    layout();
    if (resized) {
      scroller.scrollLeft = 0;
      scroller.scrollTop = 0;
    }
    draw();
    clearHover();
    timings.lastOpenMs = performance.now() - t0;
  }

  function layout() {
    // shrink the scroller to the pattern when it is smaller than the room there is
    const barW = scroller.offsetWidth - scroller.clientWidth, barH = scroller.offsetHeight - scroller.clientHeight;
    scroller.style.maxWidth = LABEL_W + view.n * view.cell + barW + "px";
    scroller.style.maxHeight = LABEL_H + view.n * view.cell + barH + "px";
    const cw = scroller.clientWidth, ch = scroller.clientHeight;
    spacer.style.width = Math.max(LABEL_W + view.n * view.cell, cw) + "px";
    spacer.style.height = Math.max(LABEL_H + view.n * view.cell, ch) + "px";
    sticky.style.width = cw + "px";
    sticky.style.height = ch + "px";
    for (const c of [canvas, cursor]) {
      if (c.width !== cw) c.width = cw;
      if (c.height !== ch) c.height = ch;
    }
  }

  // The code (colour) of cell (i, j) of the view.
  function codeAt(i, j) {
    if (!view.full) return THUMBS[view.thumbOffset + i * S + j];
    if (j > i) return CODES.future;
    const win = (META.model.windows || [])[view.layer];
    if (win && i - j >= win) return CODES.future; // a sliding-window layer: key older than the window
    if (FULL_ROW[i]) return CODES.row;
    if (PAD && PAD[j]) return CODES.pad;
    return weightCode(view.pattern[(i * (i + 1)) / 2 + j]);
  }

  const binStart = (k) => Math.floor((k * T) / S); // rows/keys of thumbnail bin k: adaptive_max_pool2d's bins
  const binEnd = (k) => Math.ceil(((k + 1) * T) / S) - 1;
  function axisLabel(k) {
    if (!view.full) return binStart(k) === binEnd(k) ? String(binStart(k)) : `${binStart(k)}\u2013${binEnd(k)}`;
    const text = `${k} ${show(TOKENS[k])}`;
    return text.length > 13 ? text.slice(0, 12) + "\u2026" : text;
  }

  function draw() {
    if (view.layer < 0) return;
    const cw = canvas.width, ch = canvas.height, cell = view.cell, n = view.n;
    const sx = scroller.scrollLeft, sy = scroller.scrollTop;
    const aw = Math.max(0, cw - LABEL_W), ah = Math.max(0, ch - LABEL_H);
    const ctx = canvas.getContext("2d");
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, cw, ch);
    if (aw > 0 && ah > 0) {
      const img = ctx.createImageData(aw, ah), data = img.data;
      const colOf = new Int32Array(aw); // key column under each pixel column, -1 past the last
      for (let px = 0; px < aw; px++) {
        const j = Math.floor((sx + px) / cell);
        colOf[px] = j < n ? j : -1;
      }
      const gridLines = cell >= 10;
      for (let py = 0; py < ah; py++) {
        const vy = sy + py, i = Math.floor(vy / cell);
        let o = py * aw * 4;
        for (let px = 0; px < aw; px++, o += 4) {
          const j = colOf[px], vx = sx + px;
          if (i >= n || j < 0 || (gridLines && (vx % cell === 0 || vy % cell === 0))) {
            data[o] = data[o + 1] = data[o + 2] = data[o + 3] = 255;
          } else {
            paint(data, o, codeAt(i, j), vx, vy);
          }
        }
      }
      ctx.putImageData(img, LABEL_W, LABEL_H);
    }
    // labels of the visible rows and columns only, every `stride`-th when cells are small
    const i0 = Math.floor(sy / cell), i1 = Math.min(n - 1, Math.floor((sy + ah - 1) / cell));
    const j0 = Math.floor(sx / cell), j1 = Math.min(n - 1, Math.floor((sx + aw - 1) / cell));
    const stride = Math.max(1, Math.ceil(11 / cell));
    ctx.fillStyle = "#1d2430";
    ctx.font = "10px ui-monospace, 'DejaVu Sans Mono', monospace";
    ctx.textBaseline = "middle";
    ctx.save();
    ctx.beginPath();
    ctx.rect(0, LABEL_H - 6, LABEL_W, ah + 6); // 6 px more: half a label over the first row's top
    ctx.clip();
    ctx.textAlign = "right";
    for (let i = Math.ceil(i0 / stride) * stride; i <= i1; i += stride) {
      ctx.fillText(axisLabel(i), LABEL_W - 4, LABEL_H + i * cell - sy + cell / 2);
    }
    ctx.restore();
    ctx.save();
    ctx.beginPath();
    ctx.rect(LABEL_W - 6, 0, aw + 6, LABEL_H);
    ctx.clip();
    ctx.textAlign = "left";
    for (let j = Math.ceil(j0 / stride) * stride; j <= j1; j += stride) {
      ctx.save();
      ctx.translate(LABEL_W + j * cell - sx + cell / 2, LABEL_H - 4);
      ctx.rotate(-Math.PI / 2);
      ctx.fillText(axisLabel(j), 0, 0);
      ctx.restore();
    }
    ctx.restore();
    ctx.fillStyle = "#5b6574";
    ctx.textAlign = "left";
    ctx.fillText("key \u2192", 4, 12);
    ctx.fillText("query \u2193", 4, LABEL_H - 10);
    const what = view.full ? "" : " thumbnail bins";
    const win = document.getElementById("detail-window");
    win.textContent = `rows ${i0}\u2013${i1}, keys ${j0}\u2013${j1} of ${n}${what} \u00b7 ${cell} px per cell`;
    Object.assign(win.dataset, { row0: i0, row1: i1, col0: j0, col1: j1, cell: cell });
    cursor.getContext("2d").clearRect(0, 0, cursor.width, cursor.height);
  }

  function clearHover() {
    hoverQuery.textContent = hoverKey.textContent = hoverWeight.textContent = "\u2013";
    hoverWeight.dataset.weight = "";
    for (const key of ["masked", "query", "key", "approx"]) delete hoverWeight.dataset[key];
  }

  function showHover(i, j) {
    clearHover();
    const code = codeAt(i, j);
    const mask = MASK_OF_CODE[code];
    Object.assign(hoverWeight.dataset, { query: i, key: j });
    if (view.full) {
      hoverQuery.textContent = `${i} ${JSON.stringify(TOKENS[i])}`;
      hoverKey.textContent = `${j} ${JSON.stringify(TOKENS[j])}`;
      if (mask) {
        hoverWeight.textContent = "masked: " + MASKS[mask].label;
        hoverWeight.dataset.masked = mask;
        hoverWeight.dataset.weight = "0";
      } else {
        const w = view.pattern[(i * (i + 1)) / 2 + j]; // a float32, exact as a JS number
        hoverWeight.textContent = w.toPrecision(9);
        hoverWeight.dataset.weight = String(w);
      }
    } else {
      hoverQuery.textContent = `${axisLabel(i)} (a bin of rows)`;
      hoverKey.textContent = `${axisLabel(j)} (a bin of keys)`;
      if (mask) {
        hoverWeight.textContent = "masked: " + MASKS[mask].label;
        hoverWeight.dataset.masked = mask;
      } else {
        const approx = (code / CODES.max) ** 2;
        hoverWeight.textContent = `max \u2248 ${approx.toFixed(3)} (thumbnail; exact weights not embedded)`;
        hoverWeight.dataset.approx = String(approx);
      }
    }
    const ctx = cursor.getContext("2d"), cell = view.cell;
    ctx.clearRect(0, 0, cursor.width, cursor.height);
    ctx.strokeStyle = "#e0245e";
    ctx.lineWidth = 2;
    ctx.strokeRect(LABEL_W + j * cell - scroller.scrollLeft - 1, LABEL_H + i * cell - scroller.scrollTop - 1, cell + 2, cell + 2);
  }

  canvas.addEventListener("mousemove", (e) => {
    const r = canvas.getBoundingClientRect();
    const mx = e.clientX - r.left, my = e.clientY - r.top;
    if (mx < LABEL_W || my < LABEL_H) return;
    const i = Math.floor((scroller.scrollTop + my - LABEL_H) / view.cell);
    const j = Math.floor((scroller.scrollLeft + mx - LABEL_W) / view.cell);
    if (i < view.n && j < view.n) showHover(i, j);
  });

  let pending = false;
  const redraw = () => {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => {
      pending = false;
      draw();
    });
  };
  scroller.addEventListener("scroll", redraw);
  window.addEventListener("resize", () => {
    if (view.layer < 0) return;
    layout();
    draw();
  });

  function zoom(step) {
    const k = ZOOMS.indexOf(view.cell) + step;
    if (k < 0 || k >= ZOOMS.length) return;
    const aw = canvas.width - LABEL_W, ah = canvas.height - LABEL_H;
    const cx = (scroller.scrollLeft + aw / 2) / view.cell, cy = (scroller.scrollTop + ah / 2) / view.cell;
    view.cell = ZOOMS[k];
    layout();
    scroller.scrollLeft = cx * view.cell - aw / 2; // keep the centre cell in the centre
    scroller.scrollTop = cy * view.cell - ah / 2;
    draw();
  }
  document.getElementById("zoom-in").addEventListener("click", () => zoom(1));
  document.getElementById("zoom-out").addEventListener("click", () => zoom(-1));

  // Scroll so that cell (i, j) is in the window; returns its centre in viewport pixels (for tests and links).
  function cellCenter(i, j) {
    const cell = view.cell, aw = canvas.width - LABEL_W, ah = canvas.height - LABEL_H;
    if (j * cell < scroller.scrollLeft || (j + 1) * cell > scroller.scrollLeft + aw) scroller.scrollLeft = j * cell - aw / 2;
    if (i * cell < scroller.scrollTop || (i + 1) * cell > scroller.scrollTop + ah) scroller.scrollTop = i * cell - ah / 2;
    scroller.scrollIntoView({ block: "nearest", inline: "nearest" });
    draw();
    const r = canvas.getBoundingClientRect();
    return {
      x: r.left + LABEL_W + j * cell - scroller.scrollLeft + cell / 2,
      y: r.top + LABEL_H + i * cell - scroller.scrollTop + cell / 2,
    };
  }

  // ---- the legend of the detail view ----
  const legend = document.getElementById("legend");
  const ramp = el("canvas", { width: 120, height: 12 });
  {
    const ctx = ramp.getContext("2d"), img = ctx.createImageData(120, 12);
    for (let y = 0; y < 12; y++) for (let x = 0; x < 120; x++) paint(img.data, (y * 120 + x) * 4, Math.round((x / 119) * CODES.max), x, y);
    ctx.putImageData(img, 0, 0);
  }
  legend.append(el("span", {}, "weight 0 ", ramp, " 1 (colour \u221d \u221aweight)"));
  for (const name in MASKS) {
    const swatch = el("canvas", { width: 14, height: 14 });
    const ctx = swatch.getContext("2d"), img = ctx.createImageData(14, 14);
    for (let y = 0; y < 14; y++) for (let x = 0; x < 14; x++) paint(img.data, (y * 14 + x) * 4, MASKS[name].code, x, y);
    ctx.putImageData(img, 0, 0);
    legend.append(el("span", { dataset: { mask: name } }, swatch, MASKS[name].label));
  }

  timings.ready = performance.now();
  window.attnlab = { meta: META, open: openHead, cellCenter, timings };
  document.body.dataset.ready = "true";
})();
