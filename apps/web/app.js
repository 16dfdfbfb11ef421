// The chat page of `streamfuse serve` (apps/web_page.py serves it; no build step, nothing from outside).
//
// It posts the conversation to /v1/chat/completions with `stream: true` and `streamfuse_steps: true`, reads the
// server-sent events with fetch + a ReadableStream (EventSource cannot POST), and marks each token of the answer:
// an accepted draft token (`span.draft`), the model's own verified token (`span.verified`), or a token of a plain
// step (`span.plain`). A chunk without `streamfuse_step` is shown as unmarked text. Model text only ever goes
// through textContent / text nodes, never innerHTML.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const page = {
    messages: [], // the conversation sent with every request: [{role, content}, ...]
    model: null, // GET /v1/models' first id; sent as `model` once known
    controller: null, // the AbortController of the request in flight
  };

  const oneLine = (text) => String(text).replace(/\s+/g, " ").trim();

  function headers(json) {
    const sent = {};
    if (json) sent["Content-Type"] = "application/json";
    const key = $("key").value.trim();
    if (key) sent["Authorization"] = "Bearer " + key;
    return sent;
  }

  // The one line an error response says: OpenAI's {"error": {"message": ...}}, else its status and text.
  async function errorOf(response) {
    let text = "";
    try {
      text = await response.text();
      const body = JSON.parse(text);
      if (body && body.error && body.error.message) return oneLine(body.error.message);
    } catch (_) {
      // not JSON: the status line and the start of the text say it
    }
    const status = oneLine(`${response.status} ${response.statusText}`);
    return text ? `${status}: ${oneLine(text).slice(0, 200)}` : status;
  }

  function showError(message) {
    const line = $("error");
    line.textContent = message ? oneLine(message) : "";
    line.hidden = !message;
  }

  async function loadModel() {
    try {
      const response = await fetch("/v1/models", { headers: headers(false) });
      if (!response.ok) {
        $("model").textContent = "?";
        showError(await errorOf(response));
        return;
      }
      const body = await response.json();
      page.model = body && body.data && body.data.length ? String(body.data[0].id) : null;
      $("model").textContent = page.model || "?";
      showError("");
    } catch (error) {
      $("model").textContent = "?";
      showError(`the server did not answer (${error.message})`);
    }
  }

  // --- the conversation ------------------------------------------------------------------------------------

  function nearBottom() {
    const log = $("log");
    return log.scrollHeight - log.scrollTop - log.clientHeight < 40;
  }

  function addTurn(role, text) {
    const follow = nearBottom();
    const turn = document.createElement("div");
    turn.className = `turn ${role}`;
    const who = document.createElement("span");
    who.className = "who";
    who.textContent = role === "user" ? "you" : "model";
    const body = document.createElement("div");
    body.className = "text";
    body.textContent = text;
    turn.append(who, body);
    $("log").append(turn);
    if (follow) $("log").scrollTop = $("log").scrollHeight;
    return body;
  }

  // --- the figures -----------------------------------------------------------------------------------------

  class Tally {
    constructor() {
      this.start = performance.now();
      this.tokens = 0; // tokens of the marked steps
      this.steps = 0; // model calls so far (a step's 1-based number)
      this.drafts = 0; // accepted draft tokens
      this.rejected = 0; // draft tokens the model rejected
      this.marked = false; // whether any chunk carried streamfuse_step
      this.server = null; // the last chunk's `streamfuse` stats
    }

    add(step) {
      this.marked = true;
      this.steps = Math.max(this.steps + 1, Number(step.step) || 0);
      this.tokens += step.pieces.length;
      this.drafts += step.pieces.filter((piece) => piece.draft).length;
      this.rejected += Number(step.rejected) || 0;
    }

    // [label, value] pairs; "–" where a figure is not known (yet)
    fields() {
      const number = (value, digits) => (Number.isFinite(value) ? value.toFixed(digits) : "–");
      const server = this.server;
      const tokens = server ? server.new_tokens : this.marked ? this.tokens : NaN;
      const steps = server ? server.model_calls || server.steps + 1 : this.marked ? this.steps : NaN;
      const seconds = server ? server.seconds : (performance.now() - this.start) / 1000;
      const fields = [
        ["tokens/step", number(tokens / steps, 2)],
        ["tokens/s", number(seconds > 0 ? tokens / seconds : NaN, 1)],
        ["steps", Number.isFinite(steps) ? String(steps) : "–"],
        ["accepted drafts", this.marked ? String(this.drafts) : "–"],
        ["rejected drafts", this.marked ? String(this.rejected) : "–"],
        ["tokens", Number.isFinite(tokens) ? String(tokens) : "–"],
      ];
      if (server && Number.isFinite(server.time_to_first_token)) {
        fields.push(["first token", `${server.time_to_first_token.toFixed(2)} s`]);
      }
      return fields;
    }
  }

  function showStats(tally) {
    const line = $("stats");
    line.replaceChildren();
    tally.fields().forEach(([label, value], index) => {
      if (index) line.append(" · ");
      const figure = document.createElement("span");
      figure.className = "figure";
      figure.dataset.name = label;
      const strong = document.createElement("b");
      strong.textContent = value;
      figure.append(strong, ` ${label}`);
      line.append(figure);
    });
  }

  // --- the stream ------------------------------------------------------------------------------------------

  // The data of one event ("" lines joined by newlines); null for an event without data (a `: keep-alive`).
  function eventData(raw) {
    const data = [];
    for (const line of raw.split(/\r\n|\r|\n/)) {
      if (line.startsWith("data:")) data.push(line.slice(line.startsWith("data: ") ? 6 : 5));
    }
    return data.length ? data.join("\n") : null;
  }

  async function* events(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      buffer += done ? decoder.decode() : decoder.decode(value, { stream: true });
      let end;
      while ((end = /\r\n\r\n|\n\n|\r\r/.exec(buffer))) {
        const data = eventData(buffer.slice(0, end.index));
        buffer = buffer.slice(end.index + end[0].length);
        if (data !== null) yield data;
      }
      if (done) return;
    }
  }

  // Appends a chunk's text to `out`, each token marked where the chunk says how; returns the chunk's text.
  function render(out, chunk, tally) {
    const choice = chunk.choices && chunk.choices[0];
    const delta = (choice && choice.delta) || {};
    const content = typeof delta.content === "string" ? delta.content : "";
    const step = chunk.streamfuse_step;
    if (step && Array.isArray(step.pieces)) {
      tally.add(step);
      const texts = step.pieces.map((piece) => String(piece.text ?? ""));
      if (texts.join("") === content) {
        step.pieces.forEach((piece, index) => {
          if (!texts[index]) return;
          const span = document.createElement("span");
          span.className = step.plain ? "plain" : piece.draft ? "draft" : "verified";
          span.textContent = texts[index];
          out.append(span);
        });
        return content;
      }
    }
    if (content) out.append(document.createTextNode(content));
    return content;
  }

  function setState(state) {
    document.body.dataset.state = state;
    const busy = state === "streaming";
    $("send").disabled = busy;
    $("stop").hidden = !busy;
  }

  async function send(text, maxTokens) {
    const message = { role: "user", content: text };
    page.messages.push(message);
    const asked = addTurn("user", text).parentElement;
    const out = addTurn("assistant", "");
    const tally = new Tally();
    const controller = new AbortController();
    page.controller = controller;
    showStats(tally);
    showError("");
    setState("streaming");
    const body = { messages: page.messages, stream: true, streamfuse_steps: true, max_tokens: maxTokens };
    if (page.model) body.model = page.model;
    let answer = "";
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: headers(true),
        body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (!response.ok) throw new Error(await errorOf(response));
      let finished = false;
      for await (const data of events(response)) {
        if (data === "[DONE]") {
          finished = true;
          break;
        }
        let chunk;
        try {
          chunk = JSON.parse(data);
        } catch (_) {
          throw new Error(`the server sent an event that is not JSON: ${oneLine(data).slice(0, 80)}`);
        }
        if (chunk.error) throw new Error(chunk.error.message || "the server failed mid-answer");
        const follow = nearBottom();
        answer += render(out, chunk, tally);
        if (chunk.streamfuse) tally.server = chunk.streamfuse;
        showStats(tally);
        if (follow) $("log").scrollTop = $("log").scrollHeight;
      }
      if (!finished) throw new Error("the answer ended before the server's [DONE]");
      page.messages.push({ role: "assistant", content: answer });
      setState("done");
    } catch (error) {
      if (page.controller !== controller) return; // the chat was cleared meanwhile
      // the unanswered message leaves the conversation; both turns stay on the page, faded
      page.messages.splice(page.messages.indexOf(message), 1);
      asked.classList.add("failed");
      out.parentElement.classList.add("failed");
      const stopped = error.name === "AbortError";
      showError(stopped ? "stopped: this turn is not part of the conversation" : error.message);
      setState(stopped ? "stopped" : "error");
    } finally {
      if (page.controller === controller) page.controller = null;
    }
  }

  // --- the controls ----------------------------------------------------------------------------------------

  function submit(event) {
    event.preventDefault();
    if (document.body.dataset.state === "streaming") return;
    const prompt = $("prompt");
    const text = prompt.value.trim();
    const maxTokens = Number($("max-tokens").value);
    if (!text) return;
    if (!Number.isInteger(maxTokens) || maxTokens < 1) {
      showError("max tokens must be a whole number of at least 1");
      return;
    }
    prompt.value = "";
    send(text, maxTokens);
  }

  function clear() {
    const controller = page.controller;
    page.controller = null;
    if (controller) controller.abort();
    page.messages = [];
    $("log").replaceChildren();
    showStats(new Tally());
    showError("");
    setState("idle");
    $("prompt").focus();
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("form").addEventListener("submit", submit);
    $("prompt").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        $("form").requestSubmit();
      }
    });
    $("stop").addEventListener("click", () => page.controller && page.controller.abort());
    $("clear").addEventListener("click", clear);
    $("key").addEventListener("change", loadModel);
    showStats(new Tally());
    setState("idle");
    loadModel();
    $("prompt").focus();
  });
})();
