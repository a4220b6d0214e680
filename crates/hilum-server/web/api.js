// Talking to the Hilum API: the bearer token (kept in sessionStorage, so it goes away with
// the tab), requests whose failures become readable messages with the fix, and the NDJSON
// event stream of a question.

const TOKEN_KEY = "hilum.token";

export function getToken() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

export function setToken(t) {
  sessionStorage.setItem(TOKEN_KEY, t.trim());
}

/** An API failure whose message says what to do. */
export class ApiError extends Error {
  constructor(message, status, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

/** The user-facing message of a failed response, with the fix. */
export function explain(status, code, serverMessage) {
  const said = serverMessage ? ` (server: ${serverMessage})` : "";
  if (status === 401) {
    return "The server refused the token: check your token; create one with `hilum serve token create` and paste it above.";
  }
  if (status === 403) return `Not allowed${said}.`;
  if (status === 413 && /question/.test(serverMessage || "")) {
    return `The question is too long: ${serverMessage}. Nothing was sent to the model; the session is unchanged.`;
  }
  if (status === 413) return `The file is too large for this server${said}.`;
  if (status === 422 && code === "unprocessable") {
    return `The server could not read this file as a radiograph${said}. Upload a PNG, JPEG or DICOM file.`;
  }
  if (status === 429) return `Too many requests for this token${said}. Wait a moment and retry.`;
  if (status === 503 || code === "llm_unavailable") {
    return `The reasoning model is unavailable${said}. Start the server with a model (\`hilum serve --llm …\`) or check that the model endpoint is running and reachable.`;
  }
  return serverMessage || `The server answered ${status}.`;
}

/** A message about a tool failure or run error, with the fix when the text names one. */
export function explainRunError(text) {
  const t = String(text || "");
  if (/hilum models (fetch|import)/.test(t)) {
    return `A model is not installed: ${t}`;
  }
  if (/model file|not installed|no such model/i.test(t)) {
    return `A model is missing: ${t} Install it with \`hilum models fetch ID\` (or \`hilum models import ID FILE\`).`;
  }
  if (/connect|unreachable|connection refused|timed out|dns|error sending request/i.test(t)) {
    return `The reasoning model could not be reached: ${t} Check that the model endpoint (the --llm URL) is running.`;
  }
  return t;
}

async function failure(resp) {
  let code = "";
  let message = "";
  try {
    const body = await resp.json();
    code = body?.error?.code || "";
    message = body?.error?.message || "";
  } catch {
    // Not JSON: the status alone.
  }
  return new ApiError(explain(resp.status, code, message), resp.status, code);
}

/** fetch with the token; throws ApiError with a readable message on any failure. */
export async function request(path, options = {}) {
  const headers = new Headers(options.headers || {});
  const token = getToken();
  if (token) headers.set("Authorization", `Bearer ${token}`);
  let resp;
  try {
    resp = await fetch(path, { ...options, headers });
  } catch (e) {
    throw new ApiError(
      `Cannot reach the Hilum server at ${location.origin} (${e.message}). Is \`hilum serve\` running?`,
      0, "network");
  }
  if (!resp.ok) throw await failure(resp);
  return resp;
}

export async function getJson(path) {
  return (await request(path)).json();
}

export async function postJson(path, body) {
  const resp = await request(path, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
  });
  return resp.json();
}

export async function upload(file) {
  const form = new FormData();
  form.append("file", file, file.name);
  const resp = await request("/v1/images", { method: "POST", body: form });
  const body = await resp.json();
  return body.images[0];
}

/** A fetched artifact as a Blob (artifact URLs need the token, so no plain <img src>). */
export async function artifactBlob(url) {
  return (await request(url)).blob();
}

/** Posts a question and calls onEvent for each streamed event until the stream ends. The run
 * is detached: it goes on when this page closes or reloads (the page then follows it again). */
export async function ask(sessionId, question, images, onEvent) {
  const resp = await request(`/v1/sessions/${encodeURIComponent(sessionId)}/messages?detach=true`, {
    method: "POST",
    headers: { "Content-Type": "application/json", Accept: "application/x-ndjson" },
    body: JSON.stringify({ question, images }),
  });
  await readEvents(resp, onEvent);
}

/** Follows a run from its first stored event to its end (a run this page did not start). */
export async function follow(sessionId, runId, onEvent) {
  const resp = await request(
    `/v1/sessions/${encodeURIComponent(sessionId)}/runs/${encodeURIComponent(runId)}/stream`,
    { headers: { Accept: "application/x-ndjson" } },
  );
  await readEvents(resp, onEvent);
}

/** Asks the server to stop a running run; its stream then ends with `cancelled`. */
export async function cancelRun(sessionId, runId) {
  await request(
    `/v1/sessions/${encodeURIComponent(sessionId)}/runs/${encodeURIComponent(runId)}/cancel`,
    { method: "POST" },
  );
}

/** Continues an interrupted run; its remaining events stream as from ask() (detached too). */
export async function resume(sessionId, runId, onEvent) {
  const resp = await request(
    `/v1/sessions/${encodeURIComponent(sessionId)}/runs/${encodeURIComponent(runId)}/resume?detach=true`,
    { method: "POST", headers: { Accept: "application/x-ndjson" } },
  );
  await readEvents(resp, onEvent);
}

async function readEvents(resp, onEvent) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let nl;
    while ((nl = buf.indexOf("\n")) >= 0) {
      const line = buf.slice(0, nl).trim();
      buf = buf.slice(nl + 1);
      if (!line) continue;
      let ev;
      try {
        ev = JSON.parse(line);
      } catch {
        continue; // A torn line cannot happen with NDJSON over HTTP; ignore rather than stop.
      }
      await onEvent(ev);
    }
  }
  if (buf.trim()) {
    try { await onEvent(JSON.parse(buf)); } catch { /* ignore a trailing partial line */ }
  }
}
