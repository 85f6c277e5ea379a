// The OCR cache page: send one image (POST /v1/ocr) or PDF (POST /ocr, PaddleX, fileType 0),
// draw the boxes over it, list the lines, and show the service's figures (GET /v1/stats).
// A long document goes as a job instead (POST /v1/jobs), polled until it ends.
"use strict";

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";
let chosen = null;
let plainText = "";

function isPdf(file) {
  return file.type === "application/pdf" || /\.pdf$/i.test(file.name);
}

function choose(file) {
  if (!file) return;
  chosen = file;
  $("chosen").textContent = `${file.name} (${Math.ceil(file.size / 1024)} KiB)`;
  $("run").disabled = false;
  recognise();
}

function options() {
  const minScore = $("min-score").value.trim();
  const headers = {};
  const directives = [];
  if ($("no-cache").checked) directives.push("no-cache");
  if ($("no-store").checked) directives.push("no-store");
  if (directives.length) headers["Cache-Control"] = directives.join(", ");
  const key = $("api-key").value.trim();
  if (key) headers.Authorization = `Bearer ${key}`;
  return {
    minScore,
    task: $("task").value,
    fields: $("fields").value.trim(),
    targetLanguage: $("target-language").value.trim(),
    headers,
  };
}

async function errorMessage(response) {
  const fallback = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body.error) return `${body.error.code}: ${body.error.message}`;
    if (body.errorMsg) return body.errorMsg;
  } catch (_) { /* not JSON */ }
  return fallback;
}

async function recogniseImage(file, opts) {
  const form = new FormData();
  form.append("file", file);
  if (opts.minScore) form.append("min_score", opts.minScore);
  if (opts.task) form.append("task", opts.task);
  if (opts.task === "extraction" && opts.fields) form.append("fields", opts.fields);
  if (opts.task === "translation" && opts.targetLanguage) {
    form.append("target_language", opts.targetLanguage);
  }
  const response = await fetch("/v1/ocr", { method: "POST", body: form, headers: opts.headers });
  if (!response.ok) throw new Error(await errorMessage(response));
  const body = await response.json();
  return {
    cache: response.headers.get("X-Cache") || body.cache,
    engine: body.engine && body.engine.kind,
    text: body.text,
    pages: [{ src: URL.createObjectURL(file), width: body.width, height: body.height, lines: body.lines }],
  };
}

function base64Of(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(String(reader.result).split(",", 2)[1]);
    reader.onerror = () => reject(new Error("could not read the file"));
    reader.readAsDataURL(file);
  });
}

async function recognisePdf(file, opts) {
  const body = { file: await base64Of(file), fileType: 0, visualize: true };
  if (opts.minScore) body.textRecScoreThresh = Number(opts.minScore);
  const response = await fetch("/ocr", {
    method: "POST",
    body: JSON.stringify(body),
    headers: { ...opts.headers, "Content-Type": "application/json" },
  });
  const answer = await response.json().catch(() => ({}));
  if (!response.ok || answer.errorCode) {
    throw new Error(answer.errorMsg || `${response.status} ${response.statusText}`);
  }
  const sizes = answer.result.dataInfo.pages;
  return {
    cache: response.headers.get("X-Cache") || "",
    pages: answer.result.ocrResults.map((page, i) => {
      const pruned = page.prunedResult;
      return {
        src: `data:image/jpeg;base64,${page.inputImage}`,
        width: sizes[i].width,
        height: sizes[i].height,
        lines: pruned.rec_texts.map((text, j) => ({
          text, score: pruned.rec_scores[j], box: pruned.rec_polys[j],
        })),
      };
    }),
  };
}

async function recognise() {
  if (!chosen) return;
  const opts = options();
  $("error").hidden = true;
  $("run").disabled = true;
  $("run").textContent = "Recognising…";
  const started = performance.now();
  try {
    const answer = await (isPdf(chosen) ? recognisePdf : recogniseImage)(chosen, opts);
    show(answer, performance.now() - started);
  } catch (err) {
    $("error").textContent = `Could not recognise ${chosen.name}: ${err.message}`;
    $("error").hidden = false;
  } finally {
    $("run").disabled = false;
    $("run").textContent = "Recognise";
    refreshStats();
  }
}

function highlight(index, on) {
  document.querySelectorAll(`[data-line="${index}"]`).forEach((el) => el.classList.toggle("hot", on));
}

function show(answer, millis) {
  const pages = $("pages");
  const list = $("lines");
  pages.replaceChildren();
  list.replaceChildren();
  const texts = [];
  let index = 0;
  answer.pages.forEach((page, pageNumber) => {
    const figure = document.createElement("figure");
    figure.className = "page";
    const img = document.createElement("img");
    img.src = page.src;
    img.alt = answer.pages.length > 1 ? `Page ${pageNumber + 1}` : chosen.name;
    const svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("viewBox", `0 0 ${page.width} ${page.height}`);
    svg.setAttribute("preserveAspectRatio", "none");
    svg.setAttribute("aria-hidden", "true");
    figure.append(img, svg);
    pages.append(figure);
    if (answer.pages.length > 1) {
      const heading = document.createElement("li");
      heading.className = "page-break";
      heading.textContent = `Page ${pageNumber + 1}`;
      list.append(heading);
    }
    for (const line of page.lines) {
      const i = index++;
      const polygon = document.createElementNS(SVG, "polygon");
      polygon.setAttribute("points", line.box.map((p) => p.join(",")).join(" "));
      polygon.dataset.line = i;
      polygon.addEventListener("mouseenter", () => {
        highlight(i, true);
        list.querySelector(`li[data-line="${i}"]`).scrollIntoView({ block: "nearest" });
      });
      polygon.addEventListener("mouseleave", () => highlight(i, false));
      svg.append(polygon);
      const item = document.createElement("li");
      item.dataset.line = i;
      item.tabIndex = 0;
      const text = document.createElement("span");
      text.className = "text";
      text.textContent = line.text;
      const score = document.createElement("span");
      score.className = "score";
      score.textContent = Number(line.score).toFixed(3);
      score.title = "recognition score";
      item.append(score, text);
      for (const [on, events] of [[true, ["mouseenter", "focus"]], [false, ["mouseleave", "blur"]]]) {
        for (const name of events) item.addEventListener(name, () => highlight(i, on));
      }
      list.append(item);
      texts.push(line.text);
    }
  });
  const textAnswer = $("text-answer");
  textAnswer.hidden = answer.text == null;
  textAnswer.textContent = answer.text ?? "";
  plainText = answer.text ?? texts.join("\n");
  const meta = $("meta");
  meta.replaceChildren();
  const badge = document.createElement("span");
  badge.className = `badge ${answer.cache.split(",")[0]}`;
  badge.textContent = answer.cache || "no cache status";
  const size = answer.pages.length > 1
    ? `${answer.pages.length} pages`
    : `${answer.pages[0].width}×${answer.pages[0].height}`;
  const count = answer.text == null ? `${index} lines` : "text answer";
  meta.append(badge, ` answered in ${Math.round(millis)} ms · ${count} · ${size}`);
  if (answer.engine) meta.append(` · ${answer.engine}`);
  $("copied").textContent = "";
  $("results").hidden = false;
}

async function copyText() {
  try {
    await navigator.clipboard.writeText(plainText);
  } catch (_) {
    const area = document.createElement("textarea");
    area.value = plainText;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  $("copied").textContent = "Copied";
}

function percent(ratio) {
  return ratio == null ? "–" : `${(ratio * 100).toFixed(1)} %`;
}

function seconds(value) {
  if (value == null) return "–";
  return value < 1 ? `${Math.round(value * 1000)} ms` : `${value.toFixed(2)} s`;
}

async function refreshStats() {
  try {
    const response = await fetch("/v1/stats");
    if (!response.ok) return;
    const stats = await response.json();
    $("stat-hit-ratio").textContent = percent(stats.cache.hit_ratio);
    $("stat-engine-calls").textContent = String(stats.engine.calls);
    $("stat-p50").textContent = seconds(stats.latency.p50_seconds);
    $("stat-engine-mean").textContent = seconds(stats.engine.mean_seconds);
  } catch (_) { /* the next refresh will try again */ }
}

// Document jobs: POST /v1/jobs, then GET /v1/jobs/{id} every second until the job ends,
// each finished page shown as it comes, in page order. One job is followed at a time.
const JOB_ENDED = new Set(["succeeded", "failed", "cancelled"]);
const JOB_POLL_MS = 1000;
let jobFile = null;
let job = null; // { id, headers, ended, shown: Map(page number -> its element) }

function chooseJobFile(file) {
  if (!file) return;
  jobFile = file;
  $("job-chosen").textContent = `${file.name} (${Math.ceil(file.size / 1024)} KiB)`;
  $("job-submit").disabled = Boolean(job && !job.ended);
}

function showJobError(message) {
  $("job-error").textContent = message;
  $("job-error").hidden = !message;
}

async function submitJob() {
  if (!jobFile || (job && !job.ended)) return;
  const form = new FormData();
  form.append("file", jobFile);
  const pages = $("job-page-ranges").value.trim();
  if (pages) form.append("pages", pages);
  const minScore = $("min-score").value.trim();
  if (minScore) form.append("min_score", minScore);
  const key = $("api-key").value.trim();
  const headers = key ? { Authorization: `Bearer ${key}` } : {};
  showJobError("");
  $("job-submit").disabled = true;
  $("job-submit").textContent = "Submitting…";
  try {
    const response = await fetch("/v1/jobs", { method: "POST", body: form, headers });
    if (!response.ok) throw new Error(await errorMessage(response));
    const body = await response.json();
    job = { id: body.id, headers, ended: false, shown: new Map() };
    $("job-pages").replaceChildren();
    $("job-view").hidden = false;
    showJob(body);
    setTimeout(pollJob, JOB_POLL_MS);
  } catch (err) {
    showJobError(`Could not submit ${jobFile.name}: ${err.message}`);
  } finally {
    $("job-submit").textContent = "Submit job";
    $("job-submit").disabled = Boolean(job && !job.ended);
  }
}

async function pollJob() {
  const followed = job;
  let body = null;
  try {
    const response = await fetch(`/v1/jobs/${encodeURIComponent(followed.id)}`, {
      headers: followed.headers,
    });
    if (response.ok) {
      body = await response.json();
    } else if (response.status === 429 || response.status >= 500) {
      showJobError(`Could not read job ${followed.id} (${await errorMessage(response)}); retrying`);
    } else { // gone (expired, another tenant's) or refused: nothing more to follow
      showJobError(`Job ${followed.id}: ${await errorMessage(response)}`);
      endJob(followed);
      return;
    }
  } catch (err) {
    showJobError(`Could not reach the service (${err.message}); retrying`);
  }
  if (followed !== job) return;
  if (body) {
    showJobError("");
    showJob(body);
    if (JOB_ENDED.has(body.status)) {
      endJob(followed);
      return;
    }
  }
  setTimeout(pollJob, JOB_POLL_MS);
}

function endJob(followed) {
  followed.ended = true;
  $("job-cancel").hidden = true;
  $("job-submit").disabled = !jobFile;
  refreshStats();
}

function jobState(body) {
  const took = Date.parse(body.finished_at) - Date.parse(body.created_at);
  const after = Number.isFinite(took) ? ` after ${(took / 1000).toFixed(1)} s` : "";
  switch (body.status) {
    case "queued": return `Job ${body.id} is queued`;
    case "running": return `Job ${body.id} is running`;
    case "succeeded": return `Job ${body.id} succeeded${after}`;
    case "cancelled": return `Job ${body.id} was cancelled${after}`;
    case "failed": {
      const why = body.error ? `: ${body.error.message}` : "";
      return `Job ${body.id} failed${after}${why}`;
    }
    default: return `Job ${body.id}: ${body.status}`;
  }
}

function showJob(body) {
  const { pages_done: done, pages_failed: failed, pages_total: total } = body.progress;
  const bar = $("job-progress");
  bar.max = Math.max(total, 1);
  bar.value = done + failed;
  $("job-counts").textContent = `${done} of ${total} pages done · ${failed} failed`;
  const state = $("job-state");
  state.className = body.status;
  state.textContent = jobState(body);
  $("job-cancel").hidden = JOB_ENDED.has(body.status);
  let added = false;
  for (const page of body.pages || []) {
    if (!job.shown.has(page.page)) {
      job.shown.set(page.page, jobPage(page));
      added = true;
    }
  }
  if (added) { // pages may finish out of order: (re)place them all in page order
    const ordered = [...job.shown.entries()].sort((a, b) => a[0] - b[0]).map(([, el]) => el);
    $("job-pages").append(...ordered);
  }
}

function jobPage(page) {
  const item = document.createElement("li");
  item.className = "job-page";
  item.dataset.page = String(page.page);
  const heading = document.createElement("h3");
  heading.append(`Page ${page.page}`);
  const badge = document.createElement("span");
  if (page.error) {
    badge.className = "badge";
    badge.textContent = "error";
    const error = document.createElement("p");
    error.className = "page-error";
    error.textContent = `${page.error.code}: ${page.error.message}`;
    heading.append(badge);
    item.append(heading, error);
    return item;
  }
  const cache = page.cache || "";
  badge.className = `badge ${cache.split(",")[0]}`;
  badge.textContent = cache || "no cache status";
  const count = document.createElement("span");
  count.className = "hint";
  count.textContent = `${page.lines.length} line${page.lines.length === 1 ? "" : "s"}`;
  heading.append(badge, count);
  const text = document.createElement("pre");
  text.textContent = page.lines.map((line) => line.text).join("\n");
  item.append(heading, text);
  return item;
}

async function cancelJob() {
  if (!job || job.ended) return;
  const followed = job;
  $("job-cancel").disabled = true;
  try {
    const response = await fetch(`/v1/jobs/${encodeURIComponent(followed.id)}`, {
      method: "DELETE",
      headers: followed.headers,
    });
    // 409 job_ended: it ended meanwhile. Either way the next poll shows the end and its pages.
    if (!response.ok && response.status !== 409) throw new Error(await errorMessage(response));
    if (response.ok && followed === job) {
      showJobError("");
      showJob(await response.json());
    }
  } catch (err) {
    showJobError(`Could not cancel job ${followed.id}: ${err.message}`);
  } finally {
    $("job-cancel").disabled = false;
  }
}

function init() {
  const drop = $("drop");
  $("file").addEventListener("change", (e) => choose(e.target.files[0]));
  for (const name of ["dragenter", "dragover"]) {
    drop.addEventListener(name, (e) => { e.preventDefault(); drop.classList.add("over"); });
  }
  for (const name of ["dragleave", "drop"]) {
    drop.addEventListener(name, () => drop.classList.remove("over"));
  }
  drop.addEventListener("drop", (e) => { e.preventDefault(); choose(e.dataTransfer.files[0]); });
  $("upload").addEventListener("submit", (e) => { e.preventDefault(); recognise(); });
  $("copy").addEventListener("click", copyText);
  $("task").addEventListener("change", () => {
    document.querySelectorAll("[data-for-task]").forEach((el) => {
      el.hidden = el.dataset.forTask !== $("task").value;
    });
  });
  $("job-file").addEventListener("change", (e) => chooseJobFile(e.target.files[0]));
  $("job-form").addEventListener("submit", (e) => { e.preventDefault(); submitJob(); });
  $("job-cancel").addEventListener("click", cancelJob);
  refreshStats();
  setInterval(() => { if (!document.hidden) refreshStats(); }, 5000);
}

init();
