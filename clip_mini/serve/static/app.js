// clip-mini search page: text and image queries against /api/search, results as a keyboard-navigable grid.
"use strict";

const $ = (id) => document.getElementById(id);
const form = $("search-form"), input = $("q"), kSelect = $("k"), fileInput = $("image-file");
const withoutInput = $("without"), whereInput = $("where"), afterInput = $("after"), beforeInput = $("before");
const statusLine = $("status"), grid = $("results"), viewer = $("viewer");
const explainBox = $("explain"), explainLabel = $("explain-label");

// "why this match": each result's thumbnail replaced by the same picture with the match map of the query over it
// (/api/explain/ID?q=...: where in the image the words match). Like `clip-mini search --explain`, it needs a single
// text query: no "without" words, no weight ("2:..."), no image; the search answer says so (`explainable`).
const EXPLAIN_HINT = "Show where each result matches the words: warm colours where it matches";
const EXPLAIN_NEEDS = "why this match needs a single text query (no “without” words, no weight like 2:…, no image)";
let explainQuery = null;   // the text query the results can be explained for, or null
let wantExplain = false;   // the box as the user left it: kept for the next text query while it is disabled
let explainFailed = false; // one error message per result grid

function setStatus(text, isError = false) {
  statusLine.textContent = text;
  statusLine.classList.toggle("error", isError);
}

async function callApi(url, options) {
  let response;
  try {
    response = await fetch(url, options);
  } catch (err) {
    throw new Error(`the server cannot be reached (${err.message})`);
  }
  if (response.status === 401) {   // a server with a token, and this browser's login is gone: log in again
    location.assign("/login");
    throw new Error("log in to search");
  }
  const body = await response.json().catch(() => ({ error: `HTTP ${response.status}` }));
  if (!response.ok) throw new Error(body.error || `HTTP ${response.status}`);
  return body;
}

function render(answer, what, query = null) {
  grid.replaceChildren();
  explainQuery = answer.explainable ? query : null;
  explainFailed = false;
  for (const hit of answer.results) {
    const link = document.createElement("a");
    link.href = hit.image;
    link.className = "hit";
    link.dataset.rank = hit.rank;
    link.dataset.path = hit.path;
    link.dataset.attention = hit.attention;
    const img = document.createElement("img");
    img.dataset.thumb = hit.thumb;
    if (explainQuery !== null) {
      img.dataset.explain = `/api/explain/${hit.id}?` +
        new URLSearchParams({ q: explainQuery, gen: answer.generation });
    }
    img.addEventListener("error", () => explainFailedFor(img));
    img.alt = hit.caption || hit.path.split("/").pop();
    img.loading = "lazy";
    const label = document.createElement("span");
    label.className = "score";
    label.textContent = `#${hit.rank}  ${hit.score.toFixed(3)}`;
    const caption = document.createElement("span");
    caption.className = "caption";
    caption.textContent = hit.caption || hit.path.split("/").pop();
    link.append(img, label, caption);
    link.addEventListener("click", (event) => { event.preventDefault(); openViewer(hit); });
    const item = document.createElement("li");
    item.append(link);
    grid.append(item);
  }
  grid.dataset.generation = answer.generation;
  grid.dataset.query = what;
  showExplained();
  const n = answer.results.length;
  if (!n && answer.below) {   // the best hit fell below the model's cut-off: say so instead of a wall of weak hits
    const floor = answer.min_best ?? answer.min_score;
    setStatus(`No good match for ${what}: the nearest photo scores ${answer.best_below.toFixed(3)}, below this ` +
              `model's cut-off ${floor.toFixed(3)}.`);
    const more = document.createElement("button");
    more.type = "button";
    more.id = "show-weak";
    more.textContent = "show the nearest anyway";
    more.addEventListener("click", () => { showWeak = true; rerun(); });
    statusLine.append(" ", more);
    return;
  }
  const weak = answer.below ? ` (${answer.below} more below the cut-off)` : "";
  setStatus(`${n} result${n === 1 ? "" : "s"} for ${what}${weak} in ${answer.took_ms.toFixed(1)} ms ` +
            `(index generation ${answer.generation})`);
}

// "show the nearest anyway": the next search of the same query lists the top k whatever they score (cutoff=none)
let showWeak = false, rerun = () => {};
function cutoffParams(params) {
  if (showWeak) params.append("cutoff", "none");
  showWeak = false;
}

// The thumbnails or, with the box ticked and a query it can explain, the match maps.
function showExplained() {
  explainBox.disabled = explainQuery === null;
  explainBox.checked = wantExplain && !explainBox.disabled;
  explainLabel.title = explainBox.disabled ? EXPLAIN_NEEDS : EXPLAIN_HINT;
  explainBox.title = explainLabel.title;
  for (const img of grid.querySelectorAll("img")) {
    const explained = explainBox.checked && Boolean(img.dataset.explain);
    const src = explained ? img.dataset.explain : img.dataset.thumb;
    if (img.getAttribute("src") !== src) img.src = src;
    img.classList.toggle("explained", explained);
  }
}

// A match map the server refused (e.g. a model whose image tower has none): the thumbnail again, and why, once.
async function explainFailedFor(img) {
  if (!img.dataset.explain || img.getAttribute("src") !== img.dataset.explain) return;
  img.classList.remove("explained");
  img.src = img.dataset.thumb;
  if (explainFailed) return;
  explainFailed = true;
  const reason = await callApi(img.dataset.explain).then(() => "it could not be loaded", (err) => err.message);
  setStatus(`why this match: ${reason}`, true);
}

explainBox.addEventListener("change", () => {
  wantExplain = explainBox.checked;
  showExplained();
});

// The "without" box: one term the server subtracts from the query (the command line's `- "grass"`).
function withoutTerm() {
  return withoutInput.value.trim();
}

function withoutText() {
  const term = withoutTerm();
  return term ? ` without “${term}”` : "";
}

// The filter boxes: a folder or a pattern (anything with * ? [ is a pattern: the API's `glob`, else `under`), and
// the days a photo was taken after / before (the API's `after`, `before`; the server keeps only those images before
// it ranks them, so k results come back whenever k pass).
function filterParams() {
  const where = whereInput.value.trim(), out = [];
  if (where) out.push([/[*?[]/.test(where) ? "glob" : "under", where]);
  if (afterInput.value) out.push(["after", afterInput.value]);
  if (beforeInput.value) out.push(["before", beforeInput.value]);
  return out;
}

function filterText() {
  const words = { under: "in", glob: "matching", after: "taken after", before: "before" };
  return filterParams().map(([name, value]) => ` ${words[name]} ${value}`).join("");
}

async function searchText(query) {
  query = query.trim();
  if (!query) { setStatus("Type a few words describing the image.", true); return; }
  setStatus("searching…");
  const params = new URLSearchParams({ q: query, k: kSelect.value });
  if (withoutTerm()) params.append("without", withoutTerm());
  for (const [name, value] of filterParams()) params.append(name, value);
  history.replaceState(null, "", `/?${params}`);
  rerun = () => searchText(query);
  cutoffParams(params);
  try {
    render(await callApi(`/api/search?${params}`), `“${query}”${withoutText()}${filterText()}`, query);
    $("query-image").hidden = true;
  } catch (err) {
    setStatus(err.message, true);
  }
}

async function searchImage(file) {
  if (!file) return;
  setStatus(`searching with ${file.name}…`);
  const body = new FormData();
  body.append("file", file, file.name);
  try {
    const params = new URLSearchParams({ k: kSelect.value });
    if (withoutTerm()) params.append("without", withoutTerm());
    for (const [name, value] of filterParams()) params.append(name, value);
    rerun = () => searchImage(file);
    cutoffParams(params);
    const answer = await callApi(`/api/search/image?${params}`, { method: "POST", body });
    const preview = $("query-preview");
    if (preview.src.startsWith("blob:")) URL.revokeObjectURL(preview.src);
    preview.src = URL.createObjectURL(file);
    $("query-image").hidden = false;
    render(answer, `image ${file.name}${withoutText()}${filterText()}`);
  } catch (err) {
    setStatus(err.message, true);
  }
}

function openViewer(hit) {
  $("viewer-title").textContent = `#${hit.rank}  ${hit.path.split("/").pop()}  (score ${hit.score.toFixed(3)})`;
  $("viewer-image").src = hit.image;
  $("viewer-caption").textContent = hit.caption ? `${hit.caption} (${hit.path})` : hit.path;
  const attention = $("viewer-attention");
  attention.hidden = false;
  $("attention-caption").textContent = "CLS attention (loading…)";
  attention.onload = () => { $("attention-caption").textContent = "CLS attention"; };
  attention.onerror = async () => {   // the server says why in JSON (e.g. not a ViT image tower)
    attention.hidden = true;
    const reason = await callApi(hit.attention).then(() => "unavailable", (err) => err.message);
    $("attention-caption").textContent = `no attention map: ${reason}`;
  };
  attention.src = hit.attention;
  viewer.showModal();
}

// Arrow keys move between results in reading order; rows are found from the laid-out positions.
function moveFocus(key) {
  const links = [...grid.querySelectorAll("a.hit")];
  const at = links.indexOf(document.activeElement);
  if (at < 0) return false;
  const top = (el) => el.getBoundingClientRect().top;
  const perRow = Math.max(1, links.filter((el) => top(el) === top(links[0])).length);
  const step = { ArrowLeft: -1, ArrowRight: 1, ArrowUp: -perRow, ArrowDown: perRow }[key];
  const next = links[Math.min(links.length - 1, Math.max(0, at + step))];
  next.focus();
  return true;
}

form.addEventListener("submit", (event) => { event.preventDefault(); searchText(input.value); });
kSelect.addEventListener("change", () => { if (input.value.trim()) searchText(input.value); });
for (const box of [afterInput, beforeInput]) {
  box.addEventListener("change", () => { if (input.value.trim()) searchText(input.value); });
}
fileInput.addEventListener("change", () => searchImage(fileInput.files[0]));

document.addEventListener("keydown", (event) => {
  if (viewer.open) return;   // Esc closes the dialog natively
  const typing = ["INPUT", "SELECT", "TEXTAREA"].includes(document.activeElement.tagName);
  if (event.key === "/" && !typing) {
    event.preventDefault();
    input.focus();
    input.select();
  } else if (event.key.startsWith("Arrow") && !typing && moveFocus(event.key)) {
    event.preventDefault();
  } else if (event.key === "ArrowDown" && document.activeElement === input) {
    const first = grid.querySelector("a.hit");
    if (first) { event.preventDefault(); first.focus(); }
  }
});

// Drag and drop an image anywhere on the page.
document.addEventListener("dragover", (event) => {
  event.preventDefault();
  document.body.classList.add("dragging");
});
document.addEventListener("dragleave", (event) => {
  if (event.relatedTarget === null) document.body.classList.remove("dragging");
});
document.addEventListener("drop", (event) => {
  event.preventDefault();
  document.body.classList.remove("dragging");
  const file = [...(event.dataTransfer?.files || [])].find((f) => f.type.startsWith("image/"));
  if (file) searchImage(file);
  else setStatus("drop an image file (PNG, JPEG, GIF, WebP or BMP)", true);
});

// A shared link (/?q=...&k=...) runs its search on load.
const initial = new URLSearchParams(location.search);
if (initial.get("k") && [...kSelect.options].some((o) => o.value === initial.get("k"))) {
  kSelect.value = initial.get("k");
}
if (initial.get("without")) withoutInput.value = initial.get("without");
whereInput.value = initial.get("glob") || initial.get("under") || "";
if (initial.get("after")) afterInput.value = initial.get("after");
if (initial.get("before")) beforeInput.value = initial.get("before");
if (initial.get("q")) {
  input.value = initial.get("q");
  searchText(initial.get("q"));
}
