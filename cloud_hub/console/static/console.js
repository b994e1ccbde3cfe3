// Continuum Mesh console: local times, live updates by server-sent events. No dependencies.
(() => {
  "use strict";
  const body = document.body;

  // ------------------------------------------------------------------ times
  const pad = (n, w = 2) => String(n).padStart(w, "0");
  function ago(s) {
    if (s < 1) return "just now";
    if (s < 60) return `${Math.floor(s)} s ago`;
    if (s < 3600) return `${Math.floor(s / 60)} min ago`;
    if (s < 86400) return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min ago`;
    return `${Math.floor(s / 86400)} d ago`;
  }
  function renderTimes(root) {
    const now = Date.now() / 1000;
    root.querySelectorAll("time[data-ts]").forEach((el) => {
      const ts = Number(el.dataset.ts);
      const d = new Date(ts * 1000);
      let text;
      if (el.dataset.fmt === "ago") text = ago(Math.max(0, now - ts));
      else if (el.dataset.fmt === "clock") text = `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}.${pad(d.getMilliseconds(), 3)}`;
      else text = d.toLocaleString([], { dateStyle: "medium", timeStyle: "medium" });
      if (el.textContent !== text) el.textContent = text;
      if (!el.title) el.title = d.toLocaleString();
    });
  }
  renderTimes(document);
  setInterval(() => renderTimes(document), 1000);

  // ------------------------------------------------------------------ live
  const url = body.dataset.liveStream;
  if (!url) return;
  const dot = document.getElementById("live-state");
  let rev = body.dataset.rev;
  // Refreshes are spaced by at least 1 s and 5x what the last one took: a slow hub is not hammered.
  let busy = false, again = false, lastFetch = 0, spacing = 1000, timer = null, es = null;

  const setState = (state, title) => {
    body.dataset.live = state;
    if (dot) { dot.dataset.state = state; dot.title = `live updates: ${title}`; }
  };
  const get = (obj, path) => path.split(".").reduce((o, k) => (o == null ? undefined : o[k]), obj);
  const toLogin = () => location.assign(`/console/login?next=${encodeURIComponent(location.pathname + location.search)}`);

  function bind(snap) {
    const c = snap.counts;
    const values = { ...snap, pending: c.queued + c.dispatched + c.on_device };
    document.querySelectorAll("[data-bind]").forEach((el) => {
      const v = get(values, el.dataset.bind);
      if (typeof v !== "number") return;
      el.textContent = v.toLocaleString("en-US");
      if (el.hasAttribute("data-hide-zero")) el.hidden = v === 0;
    });
    for (const e of snap.endpoints) {
      document.querySelectorAll(`[data-ep-state="${CSS.escape(e.id)}"]`).forEach((el) => {
        el.classList.toggle("is-on", e.online);
        el.classList.toggle("is-off", !e.online);
        el.textContent = e.online ? "online" : "offline";
      });
    }
  }

  // Re-render the page's [data-live] regions from a fresh copy of the page, at most once a second.
  async function refresh() {
    if (!document.querySelector("[data-live]")) return;
    if (busy) { again = true; return; }
    const wait = spacing - (Date.now() - lastFetch);
    if (wait > 0) { clearTimeout(timer); timer = setTimeout(refresh, wait); return; }
    busy = true;
    lastFetch = Date.now();
    try {
      const r = await fetch(location.href, { headers: { "X-Console-Live": "1" }, credentials: "same-origin", cache: "no-store" });
      if (r.status === 401) { toLogin(); return; }
      if (r.ok) {
        const doc = new DOMParser().parseFromString(await r.text(), "text/html");
        // what the reader opened stays open across the refresh
        const open = new Set([...document.querySelectorAll("details[open][data-key]")].map((d) => d.dataset.key));
        doc.querySelectorAll("details[data-key]").forEach((d) => { if (open.has(d.dataset.key)) d.open = true; });
        document.querySelectorAll("[data-live]").forEach((el) => {
          const fresh = doc.querySelector(`[data-live="${CSS.escape(el.dataset.live)}"]`);
          if (fresh) el.replaceWith(document.adoptNode(fresh));
        });
        renderTimes(document);
        spacing = Math.min(30000, Math.max(1000, 5 * (Date.now() - lastFetch)));
        body.dataset.refreshes = String(Number(body.dataset.refreshes || 0) + 1);
      }
    } catch (err) {
      // network hiccup: the next snapshot triggers another refresh
    } finally {
      busy = false;
      if (again) { again = false; refresh(); }
    }
  }

  // A stream the server refused (401 after sign-out, 503 when full) is not retried by EventSource.
  async function recheck() {
    try {
      const r = await fetch(location.href, { headers: { "X-Console-Live": "1" }, credentials: "same-origin", cache: "no-store" });
      if (r.status === 401) { toLogin(); return; }
    } catch (err) { /* offline: try again later */ }
    setTimeout(connect, 5000);
  }

  function connect() {
    es = new EventSource(url);
    es.addEventListener("open", () => setState("live", "connected"));
    es.addEventListener("snapshot", (ev) => {
      const snap = JSON.parse(ev.data);
      setState("live", "connected");
      bind(snap);
      if (snap.rev !== rev) {
        rev = snap.rev;
        body.dataset.rev = rev;
        refresh();
      }
    });
    es.addEventListener("signout", () => { es.close(); toLogin(); });
    es.addEventListener("error", () => {
      if (es.readyState === EventSource.CLOSED) { setState("down", "disconnected"); recheck(); }
      else setState("connecting", "reconnecting");
    });
  }
  window.addEventListener("pagehide", () => es && es.close());
  connect();
})();
