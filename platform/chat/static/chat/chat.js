// The chat page: one WebSocket to /ws/chat/ (the session authenticates it),
// answers streamed token by token, rendered as sanitised Markdown.
"use strict";

(function () {
  const page = JSON.parse(document.getElementById("page-data").textContent);
  const $ = (id) => document.getElementById(id);
  const ui = {
    model: $("model"), system: $("system"), temperature: $("temperature"),
    topP: $("top_p"), maxTokens: $("max_tokens"), seed: $("seed"),
    connection: $("connection"), messages: $("messages"), notice: $("notice"),
    composer: $("composer"), prompt: $("prompt"), send: $("send"),
    stop: $("stop"), regenerate: $("regenerate"), list: $("conversation-list"),
  };

  // What the errors' codes mean, in plain words.
  const PLAIN = {
    overloaded: "The model is busy",
    rate_limit_exceeded: "You are sending requests too fast",
    too_many_streams: "Too many answers are streaming at once",
    cooling: "The engine is cooling down",
    no_engine: "No engine can serve this model right now",
    engine_unreachable: "The engine cannot be reached",
    insufficient_memory: "There is not enough memory to load this model now",
    database_unavailable: "The server's database is unavailable",
    engine_died: "The engine stopped while answering",
    engine_timeout: "The engine stopped answering",
    model_not_found: "This model is not available to you",
    conversation_not_found: "This conversation is not yours or no longer exists",
    context_length_exceeded: "This conversation is longer than the model's context",
    internal: "Something went wrong on the server",
  };
  // Errors worth trying again by themselves, after their retry_after.
  const RETRY = new Set(["overloaded", "rate_limit_exceeded", "cooling", "no_engine",
    "engine_unreachable", "insufficient_memory", "database_unavailable", "cancelled"]);
  const MAX_RETRIES = 5;

  const state = {
    socket: null, ready: false, reconnectDelay: 1, streamSeq: 0,
    conversation: page.conversation ? page.conversation.id : null,
    history: [],      // {role, content} sent with each turn
    stream: null,     // the answer streaming now
    pending: null,    // a turn waiting for the socket, a retry or `stored`
    storing: null,    // the id of an answer whose turn is being stored
  };

  // -- sanitising ---------------------------------------------------------------
  // What a rendered answer may hold: Markdown's text, code, lists, tables,
  // links, and images inlined as data: only. An answer may be steered by what
  // the model read (a prompt injection): nothing in it may load from
  // elsewhere, or a URL could carry the conversation away, nor submit or embed
  // anything. No forms, inputs, buttons, frames, objects, media, SVG, styles;
  // an image's remote src is dropped (the image shows nothing); links stay,
  // opened only when clicked, in a new tab without a referrer. The page's CSP
  // (img-src 'self' data:) refuses remote loads too.
  const PURIFY = {
    ALLOWED_TAGS: ["p", "br", "hr", "h1", "h2", "h3", "h4", "h5", "h6", "strong", "em",
      "b", "i", "u", "s", "del", "ins", "mark", "sub", "sup", "small", "code", "pre",
      "kbd", "samp", "blockquote", "ul", "ol", "li", "dl", "dt", "dd", "table",
      "thead", "tbody", "tfoot", "tr", "th", "td", "caption", "a", "img", "span",
      "div", "abbr", "details", "summary"],
    ALLOWED_ATTR: ["href", "title", "alt", "src", "class", "align", "start",
      "colspan", "rowspan"],
    ALLOW_DATA_ATTR: false,
    ALLOW_ARIA_ATTR: false,
  };
  const INLINE_IMAGE = /^data:image\/(png|gif|jpeg|webp);/i;
  DOMPurify.addHook("uponSanitizeAttribute", (node, data) => {
    if (data.attrName === "src" && !(node.nodeName === "IMG" && INLINE_IMAGE.test(data.attrValue))) {
      data.keepAttr = false;
    }
    // Only Markdown's code languages: no borrowing the page's own classes.
    if (data.attrName === "class" && !/^language-[\w+-]+$/.test(data.attrValue)) {
      data.keepAttr = false;
    }
  });
  DOMPurify.addHook("afterSanitizeAttributes", (node) => {
    if (node.nodeName === "A") {
      node.setAttribute("target", "_blank");
      node.setAttribute("rel", "noopener noreferrer nofollow");
    }
  });

  // -- models and stored messages -------------------------------------------
  for (const name of page.models) {
    const option = document.createElement("option");
    option.value = option.textContent = name;
    ui.model.append(option);
  }
  if (!page.models.length) {
    showNotice("No chat model is enabled: an operator can add one in the admin.");
    ui.send.disabled = true;
  }
  if (page.conversation) {
    const stored = page.conversation;
    if (page.models.includes(stored.model)) ui.model.value = stored.model;
    ui.system.value = stored.system_prompt;
    for (const message of stored.messages) {
      const bubble = addBubble(message.role, message.content);
      if (message.role === "assistant") {
        showStats(bubble, message);
        if (message.error_code) bubble.classList.add("failed");
      }
      if (!(message.role === "assistant" && message.error_code && !message.content)) {
        state.history.push({ role: message.role, content: message.content });
      }
    }
    ui.regenerate.hidden = !state.history.some((m) => m.role === "assistant");
  }

  // -- rendering --------------------------------------------------------------
  function render(markdown) {
    return DOMPurify.sanitize(marked.parse(markdown, { gfm: true, breaks: true }), PURIFY);
  }

  function addBubble(role, text) {
    const bubble = document.createElement("article");
    bubble.className = `message ${role}`;
    const body = document.createElement("div");
    body.className = "body";
    if (role === "assistant") body.innerHTML = render(text);
    else body.textContent = text;
    const stats = document.createElement("footer");
    stats.className = "stats";
    bubble.append(body, stats);
    ui.messages.append(bubble);
    bubble.scrollIntoView({ block: "end" });
    return bubble;
  }

  function showStats(bubble, m) {
    const parts = [];
    if (m.first_token_ms != null) parts.push(`first token ${Math.round(m.first_token_ms)} ms`);
    const decoding = (m.total_ms ?? 0) - (m.first_token_ms ?? 0);
    if (m.completion_tokens > 1 && decoding > 0) {
      parts.push(`${((m.completion_tokens - 1) / (decoding / 1000)).toFixed(1)} tokens/s`);
    }
    if (m.completion_tokens != null) parts.push(`${m.completion_tokens} tokens`);
    if (m.finish_reason === "cancelled") parts.push("stopped");
    if (m.finish_reason === "length") parts.push("cut at max tokens");
    if (m.dropped) parts.push(`${m.dropped} oldest messages not seen`);
    if (m.engine) parts.push(m.engine);
    bubble.querySelector(".stats").textContent = parts.join(" · ");
  }

  // The conversation outgrew the model's context and its setting drops the
  // oldest messages: the answer did not see them.
  function droppedNotice(count) {
    if (!count) return "";
    const what = count === 1 ? "oldest message was" : `${count} oldest messages were`;
    return `This conversation is longer than the model's context: its ${what} left out of this answer.`;
  }

  function showNotice(text) {
    ui.notice.textContent = text;
    ui.notice.hidden = !text;
  }

  function setBusy(busy) {
    ui.send.disabled = busy || !page.models.length;
    ui.stop.hidden = !busy;
    ui.regenerate.hidden = busy || !state.history.some((m) => m.role === "assistant");
  }

  // -- the socket ---------------------------------------------------------------
  function connect() {
    const scheme = location.protocol === "https:" ? "wss://" : "ws://";
    const socket = new WebSocket(scheme + location.host + "/ws/chat/");
    state.socket = socket;
    ui.connection.textContent = "connecting…";
    socket.onmessage = (event) => receive(JSON.parse(event.data));
    socket.onclose = (event) => {
      state.ready = false;
      if (state.socket !== socket) return;
      if (event.code === 4401) {
        ui.connection.textContent = "logged out";
        showNotice("Your session has ended: log in again to chat.");
        return;
      }
      if (state.stream) {
        // The answer so far stays; the turn is sent again once reconnected,
        // with its id: the server stores it once.
        const interrupted = state.stream;
        state.stream = null;
        interrupted.bubble.classList.add("failed");
        interrupted.bubble.querySelector(".stats").textContent = "interrupted: the connection dropped";
        state.pending = interrupted.turn;
        setBusy(false);
      }
      const delay = state.reconnectDelay;
      state.reconnectDelay = Math.min(30, delay * 2);
      ui.connection.textContent = `disconnected, reconnecting in ${delay} s`;
      setTimeout(connect, delay * 1000);
    };
  }

  function receive(message) {
    switch (message.type) {
      case "ready":
        state.ready = true;
        state.reconnectDelay = 1;
        ui.connection.textContent = "connected";
        if (state.pending) {
          const turn = state.pending;
          state.pending = null;
          start(turn);
        }
        return;
      case "start":
        if (state.stream && message.id === state.stream.id) {
          state.stream.engine = message.engine;
          state.stream.dropped = message.dropped_messages || 0;
          showNotice(droppedNotice(state.stream.dropped));
        }
        return;
      case "token":
        if (state.stream && message.id === state.stream.id) {
          state.stream.text += message.text;
          scheduleRender();
        }
        return;
      case "done":
        if (state.stream && message.id === state.stream.id) finish(message);
        return;
      case "stored":
        stored(message);
        return;
      case "error":
        failed(message);
        return;
    }
  }

  let renderQueued = false;
  function scheduleRender() {
    if (renderQueued) return;
    renderQueued = true;
    requestAnimationFrame(() => {
      renderQueued = false;
      if (!state.stream) return;
      state.stream.bubble.querySelector(".body").innerHTML = render(state.stream.text);
      state.stream.bubble.scrollIntoView({ block: "end" });
    });
  }

  // -- turns ------------------------------------------------------------------------
  // A turn's id, kept when it is sent again (after a reconnect or a retry):
  // the server then replaces its stored answer rather than storing it twice.
  // getRandomValues, unlike randomUUID, works on plain-HTTP hosts too.
  function turnId() {
    const bytes = crypto.getRandomValues(new Uint8Array(12));
    return "t" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  function params() {
    const out = {};
    const number = (input, name, parse) => {
      if (input.value !== "") out[name] = parse(input.value);
    };
    number(ui.temperature, "temperature", parseFloat);
    number(ui.topP, "top_p", parseFloat);
    number(ui.maxTokens, "max_tokens", (v) => parseInt(v, 10));
    number(ui.seed, "seed", (v) => parseInt(v, 10));
    return out;
  }

  function start(turn) {
    if (state.storing) {
      // The next turn names the conversation, known once this one is stored.
      state.pending = turn;
      return;
    }
    if (!state.ready) {
      state.pending = turn;
      showNotice("Not connected: the message is sent once the connection is back.");
      return;
    }
    const id = `s${++state.streamSeq}`;
    const bubble = turn.bubble || addBubble("assistant", "");
    bubble.classList.remove("failed");
    bubble.querySelector(".body").innerHTML = "";
    bubble.querySelector(".stats").textContent = "waiting for the model…";
    turn.bubble = bubble;
    state.stream = { id, turn, bubble, text: "", engine: "" };
    const messages = [];
    if (ui.system.value.trim()) messages.push({ role: "system", content: ui.system.value });
    messages.push(...turn.history);
    const chat = {
      type: "chat", id, turn_id: turn.id, model: ui.model.value, messages, params: params(),
    };
    if (state.conversation) chat.conversation = state.conversation;
    if (turn.regenerate) chat.regenerate = true;
    state.socket.send(JSON.stringify(chat));
    setBusy(true);
  }

  function finish(done) {
    const stream = state.stream;
    state.stream = null;
    stream.bubble.querySelector(".body").innerHTML = render(stream.text);
    showStats(stream.bubble, {
      ...done.usage, ...done.timings, finish_reason: done.finish_reason,
      engine: done.timings.engine, dropped: stream.dropped,
    });
    state.history = [...stream.turn.history, { role: "assistant", content: stream.text }];
    state.storing = { id: done.id, turn: stream.turn };
    // Never wait for ever: the turn is answered even if it cannot be stored.
    setTimeout(() => stored({ id: done.id, conversation: null }), 5000);
    showNotice(droppedNotice(stream.dropped));
    setBusy(false);
  }

  function stored(message) {
    const storing = state.storing;
    if (!storing || storing.id !== message.id) return;
    state.storing = null;
    const id = message.conversation;
    if (id && id !== state.conversation) {
      state.conversation = id;
      history.replaceState(null, "", `/chat/${id}/`);
      const item = document.createElement("li");
      item.className = "current";
      const link = document.createElement("a");
      link.href = `/chat/${id}/`;
      link.textContent = storing.turn.history.find((m) => m.role === "user")?.content.slice(0, 80) || "(untitled)";
      item.append(link);
      ui.list.querySelector(".current")?.classList.remove("current");
      ui.list.querySelector(".none")?.remove();
      ui.list.prepend(item);
    }
    if (state.pending && state.ready) {
      const turn = state.pending;
      state.pending = null;
      start(turn);
    }
  }

  function failed(error) {
    const plain = PLAIN[error.code] || error.message;
    const stream = state.stream && (error.id === state.stream.id || error.id == null) ? state.stream : null;
    if (!stream) {
      showNotice(`${plain}.`);
      return;
    }
    state.stream = null;
    const turn = stream.turn;
    if (stream.engine) {
      // It had started: the server stores it, and says where.
      state.storing = { id: stream.id, turn };
      setTimeout(() => stored({ id: stream.id, conversation: null }), 5000);
    }
    turn.retries = (turn.retries || 0) + 1;
    if (RETRY.has(error.code) && turn.retries <= MAX_RETRIES && !stream.text) {
      const wait = Math.max(1, error.retry_after || 1);
      showNotice(`${plain}, retrying in ${wait} s (try ${turn.retries} of ${MAX_RETRIES}).`);
      stream.bubble.querySelector(".stats").textContent = `${plain.toLowerCase()}…`;
      setTimeout(() => start(turn), wait * 1000);
      return;
    }
    stream.bubble.classList.add("failed");
    stream.bubble.querySelector(".body").innerHTML = render(stream.text);
    stream.bubble.querySelector(".stats").textContent = `${plain}${error.code === "bad_request" ? "" : ` (${error.code})`}.`;
    const refused = error.code === "bad_request" || error.code === "context_length_exceeded";
    showNotice(refused ? `The request was refused: ${error.message}` : `${plain}.`);
    setBusy(false);
  }

  // -- controls ---------------------------------------------------------------------
  ui.composer.addEventListener("submit", (event) => {
    event.preventDefault();
    const text = ui.prompt.value;
    if (!text.trim() || state.stream) return;
    ui.prompt.value = "";
    addBubble("user", text);
    start({ id: turnId(), history: [...state.history, { role: "user", content: text }] });
  });
  ui.prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      ui.composer.requestSubmit();
    }
  });
  ui.stop.addEventListener("click", () => {
    if (state.stream && state.ready) {
      state.socket.send(JSON.stringify({ type: "cancel", id: state.stream.id }));
    }
  });
  ui.regenerate.addEventListener("click", () => {
    if (state.stream) return;
    const last = state.history.length - 1;
    if (last < 0 || state.history[last].role !== "assistant") return;
    const answers = ui.messages.querySelectorAll(".message.assistant");
    const bubble = answers[answers.length - 1];
    start({ id: turnId(), history: state.history.slice(0, last), regenerate: true, bubble });
  });

  connect();
})();
