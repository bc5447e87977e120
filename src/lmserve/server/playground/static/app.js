// The playground page: builds a request from the form, streams it from /v1/chat/completions or
// /v1/completions, shows the token view, saves and reopens permalinks, exports the request as code.
// Talks only to this server's own routes; the API key (when the server needs one) lives in this tab's
// sessionStorage and in the Authorization header, nowhere else.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "lmserve-api-key";
const SHARES = "/playground/api/shares";
const TOP_LOGPROBS = 5;
const NUMBER_PARAMS = ["temperature", "top_p", "top_k", "max_tokens", "seed", "presence_penalty", "frequency_penalty"];
const INTEGER_PARAMS = ["top_k", "max_tokens", "seed"];
const DEFAULT_SCHEMA = {
  type: "object",
  properties: { name: { type: "string" }, age: { type: "integer" } },
  required: ["name", "age"],
};

const state = {
  key: sessionStorage.getItem(KEY_STORAGE) || "",
  needsKey: false,
  tokens: [],  // the token view of the output: [{token, logprob, top: [{token, logprob}]}]
  text: "",
  finishReason: null,
  controller: null,  // the running generation's AbortController
  exportLang: "curl",
  image: null,  // the picked image as a data: URL (chat mode): the user message's image_url part
};

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// ---- HTTP ------------------------------------------------------------------------------------

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  if (state.key) h.Authorization = `Bearer ${state.key}`;
  return h;
}

async function errorOf(response) {
  let message = `HTTP ${response.status}`;
  try {
    const body = await response.json();
    message = (body.error && (body.error.message || body.error)) || message;
  } catch (_) { /* not JSON: the status says it */ }
  if (response.status === 401) askForKey(true);
  return new ApiError(response.status, String(message));
}

async function api(path, options = {}) {
  const response = await fetch(path, { ...options, headers: headers(options.body !== undefined) });
  if (!response.ok) throw await errorOf(response);
  return response.json();
}

// Server-sent events of a streaming response: each `data:` payload, parsed, until [DONE].
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

// ---- status, key -----------------------------------------------------------------------------

function setStatus(text, stateName) {
  const el = $("status");
  el.textContent = text;
  el.dataset.state = stateName;
  el.classList.toggle("error", stateName === "error");
}

function askForKey(refused) {
  state.needsKey = true;
  $("key-button").hidden = false;
  $("key-error").hidden = !refused || !state.key;
  if (!$("key-dialog").open) $("key-dialog").showModal();
  $("api-key").focus();
}

function useKey(event) {
  event.preventDefault();
  state.key = $("api-key").value.trim();
  sessionStorage.setItem(KEY_STORAGE, state.key);
  $("api-key").value = "";
  $("key-dialog").close();
  $("key-button").textContent = "API key ✓";
  start();
}

// ---- the form --------------------------------------------------------------------------------

function mode() {
  return document.querySelector('input[name="mode"]:checked').value;
}

function setMode(value) {
  document.querySelector(`input[name="mode"][value="${value}"]`).checked = true;
  $("system-field").hidden = value !== "chat";
  $("image-field").hidden = value !== "chat";  // a completion prompt has no image parts
}

// The picked file, read as a data: URL; the server checks it (type, size, a model that takes images).
function pickImage() {
  const file = $("image").files[0];
  if (!file) return setImage(null);
  const reader = new FileReader();
  reader.onload = () => setImage(reader.result);
  reader.onerror = () => { setImage(null); setStatus(`Could not read ${file.name}`, "error"); };
  reader.readAsDataURL(file);
}

function setImage(url) {
  state.image = url;
  if (!url) $("image").value = "";
  $("image-preview").hidden = !url;
  $("image-clear").hidden = !url;
  if (url) $("image-preview").src = url;
  else $("image-preview").removeAttribute("src");
  updateExport();
}

function numberParam(name) {
  const raw = $(name).value.trim();
  if (raw === "") return null;
  const value = Number(raw);
  if (!Number.isFinite(value) || (INTEGER_PARAMS.includes(name) && !Number.isInteger(value))) {
    throw new Error(`${$(name).labels[0].textContent} must be a${INTEGER_PARAMS.includes(name) ? "n integer" : " number"}`);
  }
  return value;
}

// "\n" and "\t" written in a stop sequence stand for a newline and a tab.
function stopSequences() {
  return $("stop-seqs").value.split("\n").filter((s) => s !== "")
    .map((s) => s.replace(/\\n/g, "\n").replace(/\\t/g, "\t"));
}

function responseFormat() {
  const kind = $("response-format").value;
  if (kind === "text") return null;
  if (kind === "json_object") return { type: "json_object" };
  let schema;
  try {
    schema = JSON.parse($("json-schema").value);
  } catch (e) {
    throw new Error(`the JSON schema is not valid JSON (${e.message})`);
  }
  return { type: "json_schema", json_schema: { name: "output", schema } };
}

// The parameters as a share saves them (null: the server's default).
function readParams() {
  const params = {};
  for (const name of NUMBER_PARAMS) params[name] = numberParam(name);
  params.stop = stopSequences();
  params.response_format = responseFormat();
  return params;
}

function writeParams(params) {
  for (const name of NUMBER_PARAMS) $(name).value = params[name] ?? "";
  for (const name of ["temperature", "top_p"]) $(`${name}-range`).value = params[name] ?? $(`${name}-range`).defaultValue;
  $("stop-seqs").value = (params.stop || []).map((s) => s.replace(/\n/g, "\\n").replace(/\t/g, "\\t")).join("\n");
  const format = params.response_format;
  $("response-format").value = format ? format.type : "text";
  if (format && format.json_schema) $("json-schema").value = JSON.stringify(format.json_schema.schema, null, 2);
  $("schema-field").hidden = $("response-format").value !== "json_schema";
}

// The API request for the current form: what the exports show. The page adds streaming and logprobs.
function apiRequest() {
  const body = { model: $("model").value };
  if (mode() === "chat") {
    const system = $("system").value;
    const text = $("prompt").value;
    const content = state.image ? [{ type: "image_url", image_url: { url: state.image } }, { type: "text", text }] : text;
    body.messages = [...(system ? [{ role: "system", content: system }] : []), { role: "user", content }];
  } else {
    body.prompt = $("prompt").value;
  }
  const params = readParams();
  for (const [name, value] of Object.entries(params)) {
    if (value !== null && !(name === "stop" && !value.length)) body[name] = value;
  }
  return { origin: location.origin, path: mode() === "chat" ? "/v1/chat/completions" : "/v1/completions", mode: mode(),
           body, needsKey: state.needsKey };
}

function streamingBody(req) {
  const extra = req.mode === "chat" ? { logprobs: true, top_logprobs: TOP_LOGPROBS } : { logprobs: TOP_LOGPROBS };
  return { ...req.body, ...extra, stream: true };
}

// ---- output ----------------------------------------------------------------------------------

function clearOutput() {
  state.tokens = [];
  state.text = "";
  state.finishReason = null;
  $("output").replaceChildren();
  $("output").dataset.state = "empty";
}

// New tokens of one stream chunk, in the token view's shape.
function chunkTokens(choice) {
  if (!choice.logprobs) return [];
  return choice.logprobs.content ? choice.logprobs.content.map(Tokens.fromChat) : Tokens.fromCompletion(choice.logprobs);
}

function addChunk(chunk) {
  if (chunk.error) throw new ApiError(500, chunk.error.message || "generation failed");
  const choice = (chunk.choices || [])[0];
  if (!choice) return;
  state.text += choice.delta ? choice.delta.content || "" : choice.text || "";
  const from = state.tokens.length;
  state.tokens.push(...chunkTokens(choice));
  Tokens.append($("output"), state.tokens, from);
  if (choice.finish_reason) state.finishReason = choice.finish_reason;
}

// A whole output at once (a reopened share): the tokens, or its bare text when it has none.
function showOutput(output) {
  clearOutput();
  state.text = output.text;
  state.tokens = output.tokens || [];
  state.finishReason = output.finish_reason ?? null;
  if (state.tokens.length) {
    Tokens.append($("output"), state.tokens, 0);
    Tokens.markTrailing($("output"), state.tokens, state.text);
  } else {
    $("output").textContent = state.text;
  }
  $("output").dataset.state = "done";
}

// ---- actions ---------------------------------------------------------------------------------

async function generate() {
  let req;
  try {
    req = apiRequest();
  } catch (e) {
    return setStatus(e.message, "error");
  }
  clearOutput();
  history.replaceState(null, "", "/playground");  // the output no longer is the permalink's
  $("share-url").value = "";
  running(true);
  setStatus("Generating…", "running");
  $("output").dataset.state = "running";
  state.controller = new AbortController();
  try {
    await stream(req);
    setStatus(`Done: ${state.tokens.length} tokens, finish reason ${state.finishReason ?? "none"}`, "done");
  } catch (e) {
    if (e.name === "AbortError") setStatus(`Stopped after ${state.tokens.length} tokens`, "stopped");
    else setStatus(e.message, "error");
  } finally {
    $("output").dataset.state = "done";
    running(false);
  }
}

async function stream(req) {
  const response = await fetch(req.path, { method: "POST", headers: headers(true), signal: state.controller.signal,
                                           body: JSON.stringify(streamingBody(req)) });
  if (!response.ok) throw await errorOf(response);
  for await (const chunk of sseEvents(response)) addChunk(chunk);
  if (state.tokens.length) Tokens.markTrailing($("output"), state.tokens, state.text);
  else $("output").textContent = state.text;  // an answer without logprobs: plain text
}

function running(on) {
  $("run").disabled = on;
  $("stop").disabled = !on;
  $("share").disabled = on || (!state.tokens.length && !state.text);
  if (!on) state.controller = null;
}

async function share() {
  let shared;
  try {
    const req = apiRequest();
    shared = {
      mode: req.mode, model: req.body.model, system: mode() === "chat" ? $("system").value : "",
      prompt: $("prompt").value, params: readParams(),
      output: { text: state.text, tokens: state.tokens, finish_reason: state.finishReason },
    };
    const saved = await api(SHARES, { method: "POST", body: JSON.stringify(shared) });
    $("share-url").value = location.origin + saved.url;
    $("copy-link").disabled = false;
    history.replaceState(null, "", saved.url);
    setStatus("Saved: the permalink reopens this prompt, its parameters and its output", "shared");
    loadSaved();
  } catch (e) {
    setStatus(`Share failed: ${e.message}`, "error");
  }
}

async function openShare(id) {
  try {
    const saved = await api(`${SHARES}/${encodeURIComponent(id)}`);
    setMode(saved.mode);
    selectModel(saved.model);
    $("system").value = saved.system;
    $("prompt").value = saved.prompt;
    writeParams(saved.params);
    showOutput(saved.output);
    $("share-url").value = location.origin + saved.url;
    $("copy-link").disabled = false;
    running(false);
    updateExport();
    setStatus(`Shared example “${saved.title}”`, "loaded");
  } catch (e) {
    setStatus(e.status === 404 ? "This permalink does not exist (it may have been deleted)" : e.message, "error");
  }
}

function selectModel(name) {
  if (![...$("model").options].some((o) => o.value === name)) $("model").append(new Option(`${name} (not served)`, name));
  $("model").value = name;
}

async function loadModels() {
  const models = await api("/v1/models");
  $("model").replaceChildren(...models.data.map((m) => new Option(m.id, m.id)));
  if (!models.data.length) $("model").append(new Option("(no model for this key)", ""));
}

async function loadSaved() {
  let list;
  try {
    list = (await api(SHARES)).data;
  } catch (e) {
    return;
  }
  $("saved").replaceChildren(...list.map(savedItem));
  $("saved-empty").hidden = list.length > 0;
}

function savedItem(share) {
  const item = document.createElement("li");
  const link = document.createElement("a");
  link.href = share.url;
  link.textContent = share.title;
  const meta = document.createElement("small");
  meta.textContent = `${share.mode} · ${new Date(share.created * 1000).toLocaleString()}`;
  const remove = document.createElement("button");
  remove.type = "button";
  remove.className = "icon";
  remove.textContent = "✕";
  remove.setAttribute("aria-label", `Delete ${share.title}`);
  remove.addEventListener("click", () => deleteShare(share.id));
  item.append(link, meta, remove);
  return item;
}

async function deleteShare(id) {
  try {
    await api(`${SHARES}/${encodeURIComponent(id)}`, { method: "DELETE" });
    setStatus("Deleted", "deleted");
  } catch (e) {
    setStatus(`Delete failed: ${e.message}`, "error");
  }
  loadSaved();
}

// ---- export ----------------------------------------------------------------------------------

function updateExport() {
  let code;
  try {
    code = Export.render(state.exportLang, apiRequest());
  } catch (e) {
    code = `# ${e.message}`;
  }
  $("export-code").textContent = code;
}

function selectExport(lang) {
  state.exportLang = lang;
  for (const tab of document.querySelectorAll('[role="tab"]')) tab.setAttribute("aria-selected", String(tab.dataset.lang === lang));
  updateExport();
}

async function copy(text, button) {
  try {
    await navigator.clipboard.writeText(text);
    const label = button.textContent;
    button.textContent = "Copied";
    setTimeout(() => { button.textContent = label; }, 1200);
  } catch (e) {
    setStatus("The browser refused the clipboard: select the text and copy it", "error");
  }
}

// ---- start -----------------------------------------------------------------------------------

function bind() {
  $("run").addEventListener("click", generate);
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("prompt").addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) generate(); });
  $("share").addEventListener("click", share);
  $("copy-link").addEventListener("click", () => copy($("share-url").value, $("copy-link")));
  $("copy-code").addEventListener("click", () => copy($("export-code").textContent, $("copy-code")));
  for (const tab of document.querySelectorAll('[role="tab"]')) tab.addEventListener("click", () => selectExport(tab.dataset.lang));
  for (const radio of document.querySelectorAll('input[name="mode"]')) radio.addEventListener("change", () => setMode(mode()));
  for (const name of ["temperature", "top_p"]) {
    $(`${name}-range`).addEventListener("input", () => { $(name).value = $(`${name}-range`).value; updateExport(); });
    $(name).addEventListener("input", () => { $(`${name}-range`).value = $(name).value; });
  }
  $("response-format").addEventListener("change", () => { $("schema-field").hidden = $("response-format").value !== "json_schema"; });
  $("image").addEventListener("change", pickImage);
  $("image-clear").addEventListener("click", () => setImage(null));
  $("shade").addEventListener("change", () => $("output").classList.toggle("shaded", $("shade").checked));
  document.querySelector("main").addEventListener("input", updateExport);
  document.querySelector("main").addEventListener("change", updateExport);
  document.querySelector("header").addEventListener("change", updateExport);
  $("key-form").addEventListener("submit", useKey);
  $("key-cancel").addEventListener("click", () => $("key-dialog").close());
  $("key-button").addEventListener("click", () => askForKey(false));
  Tokens.attachTooltip($("output"), $("tooltip"), () => state.tokens);
}

// Models, saved shares and the permalink's share; again once a key is entered.
async function start() {
  try {
    await loadModels();
  } catch (e) {
    if (e.status === 503) setTimeout(start, 2000);  // the model is still loading
    if (e.status !== 401) setStatus(`Could not list models: ${e.message}`, "error");
    return;
  }
  setStatus("", "idle");
  updateExport();
  loadSaved();
  const permalink = location.pathname.match(/^\/p\/([A-Za-z0-9_-]+)$/);
  if (permalink) await openShare(permalink[1]);
}

async function init() {
  bind();
  $("json-schema").value = JSON.stringify(DEFAULT_SCHEMA, null, 2);
  // Does this server need a key? Asked without one, so a stored key cannot hide the answer.
  state.needsKey = (await fetch("/v1/models")).status === 401;
  $("key-button").hidden = !state.needsKey;
  if (state.needsKey && state.key) $("key-button").textContent = "API key ✓";
  if (state.needsKey && !state.key) return askForKey(false);
  await start();
}

init();
