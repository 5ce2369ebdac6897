// The fleet dashboard: one card per engine, kept live by /ws/dashboard/
// (the front pushes the fleet about once a second), with restart, load and
// unload buttons (POSTs with the CSRF token; the admin's history records them);
// each node's disk for models (or this host's), and the model pulls in progress.
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const cards = $("cards");
  const WINDOW_S = 600; // the charts' last ten minutes
  const csrf = document.querySelector("[name=csrfmiddlewaretoken]").value;
  const history = new Map(); // engine -> {t:[], tokens_per_s:[], queue:[], memory_mib:[]}
  const charts = new Map(); // engine -> {series name: uPlot}
  let fleet = JSON.parse($("fleet-data").textContent);
  // The orders this user may give (the server checks them too): no button
  // for the others.
  const allowed = JSON.parse($("allowed-data").textContent);
  let reconnectDelay = 1;

  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs)) {
      if (name === "class") node.className = value;
      else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
      else node.setAttribute(name, value);
    }
    for (const child of children) {
      if (child != null) node.append(child instanceof Node ? child : String(child));
    }
    return node;
  }

  function duration(seconds) {
    if (seconds == null) return "–";
    const s = Math.floor(seconds);
    if (s < 60) return `${s} s`;
    if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
    return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
  }

  function size(mib) {
    if (mib == null) return "–";
    if (mib < 1) return `${mib.toFixed(1)} MiB`;
    if (mib < 1024) return `${Math.round(mib)} MiB`;
    return `${(mib / 1024).toFixed(1)} GiB`;
  }

  // A disk for models, as fleet/disk.py reports it: {node, models_dir,
  // total_mib, free_mib, used_mib, models: {name: MiB}}.
  function diskLine(disk) {
    const where = disk.node ? `node ${disk.node}` : "this host";
    const line = el("p", { class: "disk", "data-disk-node": disk.node || "" }, el("strong", {}, "Disk "));
    if (disk.total_mib == null) {
      line.append(`(${where}): ${disk.error || "not reported yet"}`);
      return line;
    }
    line.append(`(${where}): ${size(disk.used_mib)} used, ${size(disk.free_mib)} free of ${size(disk.total_mib)}`);
    const models = Object.entries(disk.models || {}).sort(([a], [b]) => a.localeCompare(b));
    line.append(models.length
      ? ` · models: ${models.map(([name, mib]) => `${name} ${size(mib)}`).join(", ")}`
      : " · no model's files here");
    return line;
  }

  // The pulls queued or running (catalog ModelPull rows).
  function pullsList() {
    const pulls = fleet.pulls || [];
    if (!pulls.length) return [];
    const rows = pulls.map((pull) => el("li", { class: "pull", "data-pull": pull.name },
      el("strong", {}, pull.name), ` ${pull.status}${pull.node ? ` on ${pull.node}` : ""} `,
      el("progress", { max: 100, value: pull.percent }),
      ` ${pull.percent}% of ${size(pull.size_bytes / 2 ** 20)}`,
      pull.stalled_s != null ? ` · no bytes for ${duration(pull.stalled_s)}` : "",
      pull.rate_bps ? ` · ${size(pull.rate_bps / 2 ** 20)}/s` : "",
      pull.left_s != null ? ` · ${duration(pull.left_s)} left` : ""));
    return [el("h2", { class: "pulls-heading" }, "Pulls in progress"), el("ul", { class: "pulls" }, ...rows)];
  }

  function flash(text, bad = false) {
    const box = $("flash");
    box.textContent = text;
    box.className = bad ? "flash error" : "flash";
    box.hidden = !text;
  }

  async function act(url, body, what) {
    flash(`${what}…`);
    try {
      const reply = await fetch(url, {
        method: "POST",
        headers: { "X-CSRFToken": csrf, "Content-Type": "application/x-www-form-urlencoded" },
        body: new URLSearchParams(body || {}),
        credentials: "same-origin",
      });
      const data = await reply.json().catch(() => ({}));
      flash(data.message || `${what}: HTTP ${reply.status}`, !reply.ok);
    } catch (error) {
      flash(`${what} failed: ${error}`, true);
    }
  }

  // A sample is {at, engines: {engine: point}} (chat/dashboard.py FleetFeed).
  function remember(sample) {
    for (const [name, point] of Object.entries((sample && sample.engines) || {})) {
      const series = history.get(name) || { t: [], tokens_per_s: [], queue: [], memory_mib: [] };
      for (const key of Object.keys(series)) series[key].push(point[key]);
      while (series.t.length && series.t[0] < point.t - WINDOW_S) {
        for (const key of Object.keys(series)) series[key].shift();
      }
      history.set(name, series);
    }
  }

  function chart(engine, key, label, holder) {
    const series = history.get(engine) || { t: [], [key]: [] };
    const data = [series.t, series[key]];
    let byKey = charts.get(engine);
    if (!byKey) charts.set(engine, (byKey = {}));
    const existing = byKey[key];
    if (existing && holder.contains(existing.root)) {
      existing.setData(data);
      return;
    }
    holder.replaceChildren();
    byKey[key] = new uPlot({
      width: 150, height: 70, legend: { show: false }, cursor: { show: false },
      axes: [{ show: false }, { size: 34, font: "10px system-ui" }],
      scales: { x: { time: true } },
      // Points drawn too: the first sample shows before there is a line.
      series: [{}, { label, stroke: "#2364aa", width: 1.5, fill: "rgba(35,100,170,.08)",
        points: { show: true, size: 4, stroke: "#2364aa", fill: "#2364aa" } }],
    }, data, holder);
  }

  function card(engine) {
    const status = engine.status || "stopped";
    const facts = el("dl", { class: "facts" });
    const fact = (name, value) => facts.append(el("dt", {}, name), el("dd", {}, value));
    fact("pid", engine.pid ?? "–");
    fact("uptime", duration(engine.uptime_s));
    fact("restarts", engine.restart_count);
    fact("devices", engine.devices || engine.backend);
    fact("temperatures", (engine.temperatures || []).map((t) => `${t.device} ${t.celsius} °C`).join(", ") || "no sensor");
    fact("slots in use", engine.slots_in_use);
    fact("queue", engine.queue_depth);
    fact("memory", engine.memory_mib != null ? `${Math.round(engine.memory_mib)} MiB` : "–");
    fact("heartbeat", engine.heartbeat_age_s != null ? `${engine.heartbeat_age_s.toFixed(1)} s ago` : "–");

    const models = el("table", {}, el("tr", {}, el("th", {}, "resident model"), el("th", {}, "memory"),
      el("th", {}, "busy"), el("th", {}, "queued"), el("th", {})));
    for (const model of engine.models) {
      models.append(el("tr", {},
        el("td", {}, model.name), el("td", {}, `${Math.round(model.memory_mib)} MiB`),
        el("td", {}, model.busy), el("td", {}, model.queued),
        el("td", {}, allowed.place ? el("button", {
          type: "button", class: "unload",
          onclick: () => act(`/dashboard/engines/${engine.name}/unload/`, { model: model.name }, `Unloading ${model.name}`),
        }, "Unload") : null)));
    }
    if (!engine.models.length) models.append(el("tr", {}, el("td", { colspan: 5 }, "no model resident")));

    const actions = el("div", { class: "actions" });
    if (allowed.restart) {
      actions.append(el("button", { type: "button", class: "restart",
        onclick: () => act(`/dashboard/engines/${engine.name}/restart/`, {}, `Restarting ${engine.name}`) }, "Restart engine"));
    }
    if (allowed.place) {
      // fleet.models: the enabled models only (a disabled one is never loaded).
      const picker = el("select", { "aria-label": `model to load on ${engine.name}` });
      for (const model of fleet.models) {
        if (!engine.models.some((m) => m.name === model.name)) picker.append(el("option", { value: model.name }, model.name));
      }
      actions.append(picker, el("button", { type: "button", class: "load",
        onclick: () => picker.value && act(`/dashboard/engines/${engine.name}/load/`, { model: picker.value }, `Loading ${picker.value}`) }, "Load"));
    }

    const holders = {};
    const charts = el("div", { class: "charts" });
    for (const [key, label] of [["tokens_per_s", "tokens/s"], ["queue", "queue depth"], ["memory_mib", "memory MiB"]]) {
      holders[key] = el("div");
      charts.append(el("figure", {}, holders[key], el("figcaption", {}, label)));
    }
    const node = el("article", { class: "card", "data-engine": engine.name },
      el("h2", {}, engine.name, el("span", { class: `badge ${status}` }, status)),
      engine.cooling_reason ? el("p", { class: "banner cooling" }, `Cooling: ${engine.cooling_reason}`) : null,
      engine.crash_loop && engine.last_error ? el("p", { class: "banner error" }, `Crash loop: ${engine.last_error}`) : null,
      facts, models, actions, charts);
    return { node, holders };
  }

  // On a cluster, one heading per node (its status, address and heartbeat)
  // above the cards of its engines; on one host, the cards alone.
  function nodeHeading(name) {
    const node = (fleet.nodes || []).find((n) => n.name === name);
    if (!node) return el("h2", { class: "node", "data-node": "" }, "Engines of no node");
    const age = node.heartbeat_age_s != null ? `, heartbeat ${node.heartbeat_age_s.toFixed(1)} s ago` : "";
    return el("h2", { class: "node", "data-node": node.name }, `Node ${node.name} `,
      el("span", { class: `badge ${node.status}` }, node.status),
      el("small", {}, ` ${node.address}${node.labels.length ? " · " + node.labels.join(", ") : ""}${age}`));
  }

  function draw() {
    const built = fleet.engines.map((engine) => ({ engine, ...card(engine) }));
    const children = [...pullsList()];
    const clustered = (fleet.nodes || []).length > 0;
    const disks = fleet.disks || [];
    const diskOf = (name) => disks.find((d) => (d.node || "") === (name || ""));
    if (!clustered && diskOf("")) children.push(diskLine(diskOf("")));
    let current = null;
    for (const b of built) {
      if (clustered && b.engine.node !== current) {
        current = b.engine.node;
        children.push(nodeHeading(current));
        if (diskOf(current)) children.push(diskLine(diskOf(current)));
      }
      children.push(b.node);
    }
    if (clustered) {  // nodes without engines are shown too
      for (const node of fleet.nodes) {
        if (!built.some((b) => b.engine.node === node.name)) {
          children.push(nodeHeading(node.name));
          if (diskOf(node.name)) children.push(diskLine(diskOf(node.name)));
          children.push(el("p", { class: "node-empty" }, "no engine configured on this node"));
        }
      }
    }
    cards.replaceChildren(...children);
    if (!built.length && !clustered) cards.append(el("p", {}, "No engine is configured: add one in the admin."));
    charts.clear();
    for (const { engine, holders } of built) {
      for (const [key, holder] of Object.entries(holders)) chart(engine.name, key, key, holder);
    }
  }

  function connect() {
    const scheme = location.protocol === "https:" ? "wss://" : "ws://";
    const socket = new WebSocket(scheme + location.host + "/ws/dashboard/");
    socket.onopen = () => { $("connection").textContent = "live"; reconnectDelay = 1; };
    socket.onmessage = (event) => {
      const message = JSON.parse(event.data);
      if (message.type === "fleet") {
        if (message.history) {
          history.clear();
          for (const sample of message.history) remember(sample);
        }
        if (message.sample) remember(message.sample);
        fleet = message.fleet;
        draw();
      } else if (message.type === "notice") {
        flash(message.text, message.level === "error");
      }
    };
    socket.onclose = (event) => {
      if (event.code === 4403) {
        $("connection").textContent = "staff login needed";
        return;
      }
      $("connection").textContent = `disconnected, reconnecting in ${reconnectDelay} s`;
      setTimeout(connect, reconnectDelay * 1000);
      reconnectDelay = Math.min(30, reconnectDelay * 2);
    };
  }

  draw();
  connect();
})();
