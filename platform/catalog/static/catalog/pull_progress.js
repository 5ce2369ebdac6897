// A pull's admin page (catalog/admin.py ModelPullAdmin): its progress bar,
// figures, status and model link kept current by polling the pull's progress
// URL every second until it ends. No inline script: the front's Content
// Security Policy allows this origin's files only.
"use strict";

(function () {
  const EVERY_MS = 1000;

  function show(id, text) {
    const element = document.getElementById(id);
    if (element) element.textContent = text;
  }

  function showModel(progress) {
    const holder = document.getElementById("pull-model");
    if (!holder || !progress.model_url) return;
    const link = document.createElement("a");
    link.href = progress.model_url;
    link.textContent = progress.model;
    holder.replaceChildren(link);
  }

  function render(progress) {
    const bar = document.getElementById("pull-bar");
    if (bar) {
      bar.max = Math.max(progress.size_bytes, 1);
      bar.value = progress.done_bytes;
    }
    show("pull-text", progress.text);
    show("pull-status", progress.status);
    show("pull-message", progress.message);
    showModel(progress);
    const cancel = document.getElementById("pull-cancel");
    if (cancel && !progress.open) cancel.hidden = true;
  }

  async function poll(url) {
    try {
      const answer = await fetch(url, {
        headers: { Accept: "application/json" },
        credentials: "same-origin",
      });
      if (answer.ok) {
        const progress = await answer.json();
        render(progress);
        if (!progress.open) return;
      }
    } catch (error) {
      // The front restarting or the network gone: try again next time.
    }
    setTimeout(poll, EVERY_MS, url);
  }

  function start() {
    const holder = document.getElementById("pull-progress");
    if (holder && holder.dataset.url) setTimeout(poll, EVERY_MS, holder.dataset.url);
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else {
    start();
  }
})();
