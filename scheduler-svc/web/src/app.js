// The learner page: lessons by collection, a lesson's guide, its live lesson's progress, and a
// tab per presentation (a terminal over the entrypoint's WebSocket, a web page in a frame).
// Plain DOM, no framework; every call goes to this origin's JSON API (antidote.api.v1), whose
// session token lives in an HttpOnly cookie the page never sees. Served by scheduler-svc
// (src/api/http/page.rs) under a Content-Security-Policy without inline scripts or eval.
'use strict';

(function () {
  // --- The style nonce -------------------------------------------------------------------
  // xterm.js's DOM renderer inserts <style> elements; the policy admits styles from this
  // origin or carrying this answer's nonce. Every <style> made from here on gets it, before it
  // is inserted (a nonce set afterwards has no effect).
  const nonceMeta = document.querySelector('meta[name="antidote-style-nonce"]');
  const styleNonce = nonceMeta ? nonceMeta.content : '';
  if (nonceMeta) nonceMeta.remove();
  if (styleNonce) {
    const create = Document.prototype.createElement;
    Document.prototype.createElement = function (name, options) {
      const element = create.call(this, name, options);
      if (String(name).toLowerCase() === 'style') element.setAttribute('nonce', styleNonce);
      return element;
    };
  }
  // Policy violations, for people (the console) and for the browser test.
  window.antidoteCspViolations = [];
  document.addEventListener('securitypolicyviolation', (event) => {
    window.antidoteCspViolations.push(
      `${event.effectiveDirective} ${event.blockedURI} at ${event.sourceFile}:${event.lineNumber}:${event.columnNumber}`,
    );
  });

  const $ = (id) => document.getElementById(id);
  const SESSION_KEY = 'antidote.session';
  const STATUS_PREFIX = 'LIVE_LESSON_STATUS_';
  const STEPS = ['PENDING', 'BOOTING', 'CONFIGURING', 'READY'];
  const libraries = typeof window.DOMPurify !== 'undefined' && typeof window.marked !== 'undefined'
    && typeof window.Terminal !== 'undefined' && typeof window.FitAddon !== 'undefined';

  // --- Small helpers -----------------------------------------------------------------------
  function el(tag, attributes, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attributes || {})) {
      if (value === false || value === undefined || value === null) continue;
      node.setAttribute(name, value === true ? '' : String(value));
    }
    for (const child of children) {
      node.append(typeof child === 'string' ? document.createTextNode(child) : child);
    }
    return node;
  }

  function showError(message) {
    const box = $('error');
    box.textContent = message;
    box.hidden = !message;
  }

  function statusName(lesson) {
    const status = String(lesson.status || '');
    return status.startsWith(STATUS_PREFIX) ? status.slice(STATUS_PREFIX.length) : status;
  }

  class ApiError extends Error {
    constructor(message, status, reason, metadata) {
      super(message);
      this.status = status;
      this.reason = reason;
      this.metadata = metadata || {};
    }
  }

  // One JSON API call; errors carry the HTTP status, the API's typed reason and its metadata.
  async function call(method, path, body) {
    const init = { method, headers: {}, credentials: 'same-origin' };
    if (body !== undefined) {
      init.headers['content-type'] = 'application/json';
      init.body = JSON.stringify(body);
    }
    const response = await fetch(path, init);
    const text = await response.text();
    let json = null;
    try {
      json = text ? JSON.parse(text) : null;
    } catch (_) {
      json = null;
    }
    if (!response.ok) {
      const message = (json && json.message) || `${method} ${path}: HTTP ${response.status}`;
      throw new ApiError(message, response.status, json && json.reason, json && json.metadata);
    }
    return json;
  }

  // --- The session -------------------------------------------------------------------------
  // The token is the HttpOnly cookie CreateSession set; only the session's id is kept here.
  let sessionId = null;

  async function newSession() {
    const session = await call('POST', '/v1/sessions', {});
    sessionId = session.id;
    localStorage.setItem(SESSION_KEY, sessionId);
    $('session').textContent = `Session ${sessionId}`;
    return sessionId;
  }

  async function ensureSession() {
    if (sessionId) return sessionId;
    const kept = localStorage.getItem(SESSION_KEY);
    if (kept) {
      try {
        await call('GET', `/v1/sessions/${encodeURIComponent(kept)}`);
        sessionId = kept;
        $('session').textContent = `Session ${sessionId}`;
        return sessionId;
      } catch (err) {
        if (!(err instanceof ApiError) || (err.status !== 401 && err.status !== 404)) throw err;
      }
    }
    return newSession();
  }

  // A call within the session: an expired session (its cookie gone) is replaced once.
  // `body` may be a function of the (new) session id's state, so a retry sends the new one.
  async function sessionCall(method, path, body) {
    const make = () => (typeof body === 'function' ? body() : body);
    await ensureSession();
    try {
      return await call(method, path, make());
    } catch (err) {
      if (err instanceof ApiError && err.status === 401) {
        sessionId = null;
        localStorage.removeItem(SESSION_KEY);
        await newSession();
        return call(method, path, make());
      }
      throw err;
    }
  }

  // --- The catalog ---------------------------------------------------------------------------
  async function showCatalog() {
    closeLesson();
    $('lesson').hidden = true;
    $('catalog').hidden = false;
    document.title = 'Antidote lessons';
    const [collections, lessons] = await Promise.all([
      call('GET', '/v1/collections'),
      call('GET', '/v1/lessons'),
    ]);
    const groups = new Map();
    for (const collection of collections.collections || []) {
      groups.set(collection.slug, { collection, lessons: [] });
    }
    const others = { collection: { slug: '', title: 'Other lessons' }, lessons: [] };
    for (const lesson of lessons.lessons || []) {
      (groups.get(lesson.collection) || others).lessons.push(lesson);
    }
    const list = $('collections');
    list.replaceChildren();
    for (const group of [...groups.values(), others]) {
      if (group.lessons.length === 0) continue;
      const heading = el('h3', {}, group.collection.title || group.collection.slug);
      const section = el('section', { class: 'collection', 'data-collection': group.collection.slug }, heading);
      if (group.collection.briefDescription) {
        section.append(el('p', { class: 'quiet' }, group.collection.briefDescription));
      }
      const items = el('ul', { class: 'lessons' });
      group.lessons.sort((a, b) => a.name.localeCompare(b.name));
      for (const lesson of group.lessons) {
        const link = el('a', { href: `#/lessons/${encodeURIComponent(lesson.slug)}`, 'data-lesson': lesson.slug }, lesson.name);
        items.append(el('li', {}, link, ' ', el('span', { class: 'quiet' }, lesson.shortDescription || '')));
      }
      section.append(items);
      list.append(section);
    }
    if (!list.firstChild) list.append(el('p', {}, 'This curriculum has no lessons for this tier.'));
  }

  // --- One lesson ------------------------------------------------------------------------------
  // What the page shows of the lesson opened: its catalog entry and its live lesson, if any.
  let view = null;

  function closeLesson() {
    if (!view) return;
    if (view.events) view.events.close();
    for (const tab of view.tabs.values()) tab.close();
    view = null;
    $('tabs').replaceChildren();
    $('panels').replaceChildren();
    document.body.removeAttribute('data-status');
  }

  async function showLesson(slug) {
    closeLesson();
    $('catalog').hidden = true;
    $('lesson').hidden = false;
    const lesson = await call('GET', `/v1/lessons/${encodeURIComponent(slug)}`);
    view = {
      lesson, live: null, events: null, tabs: new Map(), stage: 0, deleting: false,
      checking: false, shownCheck: null, checkError: false,
    };
    document.title = `${lesson.name} · Antidote`;
    $('lesson-title').textContent = lesson.name;
    $('lesson-description').textContent = lesson.description || '';
    $('live').hidden = true;
    $('live-line').hidden = true;
    $('health').replaceChildren();
    $('start').hidden = false;
    $('start').textContent = 'Start this lesson';
    $('start').disabled = false;
    $('delete').hidden = true;
    renderFeedback(null);
    renderGuide(0);
    renderStages();
    // A live lesson of this session already running this lesson is picked up again.
    await ensureSession();
    const mine = await sessionCall('GET', `/v1/live-lessons?session_id=${encodeURIComponent(sessionId)}`);
    const running = (mine.liveLessons || []).find((l) => l.lessonSlug === slug);
    if (running) follow(running);
  }

  function renderGuide(stage) {
    const guide = $('guide');
    const stages = view.lesson.stages || [];
    const entry = stages[stage];
    guide.replaceChildren();
    if (!entry) return;
    guide.append(el('p', { class: 'quiet' }, entry.description || ''));
    if (entry.guideType === 'jupyter') {
      guide.append(el('p', {}, 'This stage\'s guide is a Jupyter notebook: open the "Guide" tab once the lesson is ready.'));
      return;
    }
    if (!libraries) return;
    const html = window.marked.parse(entry.guide || '', { async: false });
    // Curriculum HTML runs on the origin that holds learners' sessions: sanitised, and the
    // policy would refuse any script that got through.
    const clean = window.DOMPurify.sanitize(html, {
      FORBID_TAGS: ['style', 'form', 'input', 'button', 'textarea', 'select'],
      FORBID_ATTR: ['style'],
      RETURN_DOM_FRAGMENT: true,
    });
    const body = el('div', { class: 'guide-body' });
    body.append(clean);
    for (const link of body.querySelectorAll('a[href]')) {
      link.setAttribute('target', '_blank');
      link.setAttribute('rel', 'noopener noreferrer');
    }
    guide.append(body);
  }

  function currentStage() {
    return view.live ? view.live.stage || 0 : view.stage;
  }

  function renderStages() {
    const stages = view.lesson.stages || [];
    const count = stages.length;
    const stage = currentStage();
    const passed = new Set((view.live && view.live.passedStages) || []);
    $('stage-label').textContent = `Stage ${stage + 1} of ${count}`;
    const ready = view.live && statusName(view.live) === 'READY' && !view.deleting;
    const entry = stages[stage] || {};
    // A gated stage (`checks: gate`): the next stage waits until its check passed.
    const held = entry.checks === 'gate' && !passed.has(stage) && stage + 1 < count;
    $('stage-back').disabled = !ready || stage <= 0;
    $('stage-forward').disabled = !ready || stage + 1 >= count || held;
    $('stage-forward').title = held ? 'Pass this stage\'s check first' : '';
    $('held').hidden = !held || !view.live;
    $('check').hidden = !entry.checks;
    $('check').disabled = !ready || view.checking;
    $('check').textContent = view.checking ? 'Checking…' : 'Check';
    $('passed').hidden = !passed.has(stage);
  }

  // The feedback of a check (CheckStage's answer, or a live lesson's last check) of the stage
  // shown: passed or not, and each endpoint's output. Outputs are what check files printed,
  // so they are only ever text, never markup.
  function renderFeedback(check) {
    const box = $('feedback');
    if (!check || (check.stage || 0) !== currentStage()) {
      box.hidden = true;
      box.replaceChildren();
      delete box.dataset.passed;
      return;
    }
    // A newer check than the one shown: an error about an earlier attempt is old news.
    const key = `${check.stage || 0} ${check.checkedAt || ''}`;
    if (key !== view.shownCheck && view.checkError) {
      view.checkError = false;
      showError('');
    }
    view.shownCheck = key;
    box.hidden = false;
    box.dataset.passed = check.passed ? 'true' : 'false';
    const title = check.passed ? 'Check passed.' : 'Not yet: the check failed.';
    const children = [el('p', { class: 'verdict' }, el('strong', {}, title))];
    for (const endpoint of check.endpoints || []) {
      const verdict = endpoint.passed ? 'passed' : (endpoint.timedOut ? 'ran out of time' : 'failed');
      children.push(el('p', { class: 'quiet' }, `${endpoint.endpoint} (${endpoint.fileName}): ${verdict}`));
      if (endpoint.truncated) children.push(el('p', { class: 'quiet' }, 'The end of its output:'));
      if (endpoint.feedback) children.push(el('pre', { 'data-endpoint': endpoint.endpoint }, endpoint.feedback));
    }
    box.replaceChildren(...children);
  }

  // What a learner reads when the scheduler refuses a check or a stage change.
  function explain(err) {
    if (!(err instanceof ApiError)) return err.message;
    const metadata = err.metadata || {};
    switch (err.reason) {
      case 'TOO_MANY_CHECKS':
        if (metadata.scope === 'running') {
          return 'A check of this lesson is running already: its result shows here when it ends.';
        }
        return `This lesson ran ${metadata.limit || 'the most'} checks in the last minute, the most allowed: wait a moment, then check again.`;
      case 'CHECK_NOT_PASSED':
        return 'This stage\'s check has to pass before the next stage: press Check.';
      case 'CHECKS_UNSUPPORTED':
        return 'Checks cannot run where this lesson runs; your lesson is unchanged.';
      case 'NO_CHECKS':
        return 'This stage has no check.';
      case 'LIVE_LESSON_BUSY':
        return 'The lesson is not ready: check again once it is.';
      default:
        return err.message;
    }
  }

  async function check() {
    if (!view || !view.live || view.checking) return;
    showError('');
    view.checkError = false;
    const current = view;
    view.checking = true;
    renderStages();
    try {
      const result = await sessionCall('POST', `/v1/live-lessons/${encodeURIComponent(view.live.id)}/check`, {});
      if (view !== current || !view.live) return;
      // The answer is the live lesson's last check now; a pass counts at once (the Watch
      // stream says the same when it sends the live lesson again).
      const passed = new Set(view.live.passedStages || []);
      if (result.passed) passed.add(result.stage || 0);
      view.live = { ...view.live, lastCheck: result, passedStages: [...passed].sort((a, b) => a - b) };
      renderFeedback(result);
    } catch (err) {
      if (view !== current) return;
      showError(explain(err));
      view.checkError = true;
    } finally {
      if (view === current) {
        view.checking = false;
        renderStages();
      }
    }
  }

  async function start() {
    $('start').disabled = true;
    showError('');
    const slug = view.lesson.slug;
    const body = () => ({ sessionId, lessonSlug: slug, stage: view.stage });
    await ensureSession();
    const live = await sessionCall('POST', '/v1/live-lessons', body);
    follow(live);
  }

  // Shows a live lesson and follows it through the Watch stream (server-sent events).
  function follow(live) {
    if (view.events) view.events.close();
    update(live);
    const events = new EventSource(`/v1/live-lessons/${encodeURIComponent(live.id)}/watch`);
    view.events = events;
    const current = view;
    events.addEventListener('live_lesson', (event) => {
      if (view !== current) return;
      update(JSON.parse(event.data));
    });
    events.addEventListener('error', (event) => {
      if (view !== current) return;
      if (event.data) {
        // The server's own `event: error`: the stream is over (the lesson is gone, say).
        events.close();
      }
      if (events.readyState === EventSource.CLOSED) settle(current);
    });
  }

  // The stream ended for good: is the live lesson still there?
  async function settle(current) {
    try {
      const live = await sessionCall('GET', `/v1/live-lessons/${encodeURIComponent(current.live.id)}`);
      if (view === current) follow(live);
    } catch (err) {
      if (view !== current) return;
      if (err instanceof ApiError && err.status === 404) {
        gone();
      } else {
        showError(`Lost the lesson's progress: ${err.message}`);
      }
    }
  }

  function gone() {
    const slug = view.lesson.slug;
    closeLesson();
    showLesson(slug).then(() => {
      $('status').textContent = 'The lesson was deleted.';
      $('live').hidden = false;
      document.body.setAttribute('data-status', 'DELETED');
    }, (err) => showError(err.message));
  }

  function update(live) {
    view.live = live;
    const status = statusName(live);
    document.body.setAttribute('data-status', status);
    $('live').hidden = false;
    $('live-id').textContent = live.id;
    $('live-line').hidden = false;
    $('start').hidden = true;
    $('delete').hidden = false;
    $('delete').disabled = view.deleting || status === 'TERMINATING';
    let reached = STEPS.indexOf(status);
    if (status === 'FAILED' || status === 'TERMINATING') reached = -1;
    for (const item of $('progress').children) {
      const index = STEPS.indexOf(item.dataset.step);
      item.classList.toggle('done', reached >= 0 && index < reached);
      item.classList.toggle('current', index === reached);
      if (index === reached) item.setAttribute('aria-current', 'step');
      else item.removeAttribute('aria-current');
    }
    const words = {
      PENDING: 'Waiting for a place to run…',
      BOOTING: 'Starting the lesson\'s endpoints…',
      CONFIGURING: `Configuring stage ${(live.stage || 0) + 1}…`,
      READY: 'Ready.',
      FAILED: `Failed: ${live.failureReason || 'no reason given'}. Start it again to retry.`,
      TERMINATING: 'Deleting…',
    };
    $('status').textContent = `${status}: ${words[status] || ''} (${live.healthy || 0}/${live.total || 0} probes healthy)`;
    const health = $('health');
    health.replaceChildren();
    for (const endpoint of live.endpoints || []) {
      health.append(el('li', {}, `${endpoint.name}: ${endpoint.healthy || 0}/${endpoint.total || 0} healthy`));
    }
    if (status === 'FAILED') {
      $('start').hidden = false;
      $('start').disabled = false;
      $('start').textContent = 'Try again';
    }
    if ((live.stage || 0) !== view.shownStage) {
      view.shownStage = live.stage || 0;
      view.stage = view.shownStage;
      renderGuide(view.shownStage);
    }
    renderFeedback(live.lastCheck);
    renderStages();
    if (status === 'READY') renderTabs(live);
  }

  // --- Presentations ---------------------------------------------------------------------------
  // The newest URL of a presentation: the one in the last answer, or a fresh one from
  // GetLiveLesson (tokens live about ten minutes).
  function urlIn(live, endpoint, presentation) {
    for (const e of live.endpoints || []) {
      if (e.name !== endpoint) continue;
      for (const p of e.presentations || []) {
        if (p.name === presentation) return p.entrypointUrl || '';
      }
    }
    return '';
  }

  async function freshUrl(endpoint, presentation) {
    const live = await sessionCall('GET', `/v1/live-lessons/${encodeURIComponent(view.live.id)}`);
    return urlIn(live, endpoint, presentation);
  }

  function renderTabs(live) {
    for (const endpoint of live.endpoints || []) {
      for (const presentation of endpoint.presentations || []) {
        const key = `${endpoint.name}/${presentation.name}`;
        if (view.tabs.has(key)) continue;
        let tab;
        if (endpoint.name === 'jupyter-guide') {
          // Jupyter refuses to be framed by another origin (its own frame-ancestors 'self'):
          // the tab offers the notebook in a tab of its own.
          tab = webTab(endpoint.name, presentation.name, 'Guide (Jupyter)', 'notebooks/guide.ipynb', false);
        } else if (presentation.type === 'ssh') {
          tab = terminalTab(endpoint.name, presentation.name);
        } else {
          tab = webTab(endpoint.name, presentation.name, `${endpoint.name} · ${presentation.name} (web)`, '', true);
        }
        view.tabs.set(key, tab);
        if (view.tabs.size === 1) select(tab);
      }
    }
  }

  // A tab and its panel; `activate` runs the first time it is shown.
  function makeTab(endpoint, presentation, label, activate) {
    const id = `${endpoint}-${presentation}`.replace(/[^A-Za-z0-9_-]/g, '_');
    const button = el('button', {
      type: 'button', role: 'tab', id: `tab-${id}`, 'aria-controls': `panel-${id}`,
      'aria-selected': 'false', tabindex: '-1',
    }, label);
    const panel = el('div', { role: 'tabpanel', id: `panel-${id}`, 'aria-labelledby': `tab-${id}`, class: 'panel', hidden: true });
    const tab = { button, panel, activated: false, activate, close: () => {}, shown: () => {} };
    button.addEventListener('click', () => select(tab));
    button.addEventListener('keydown', (event) => {
      const all = [...view.tabs.values()];
      const at = all.indexOf(tab);
      let next = null;
      if (event.key === 'ArrowRight') next = all[(at + 1) % all.length];
      if (event.key === 'ArrowLeft') next = all[(at - 1 + all.length) % all.length];
      if (next) {
        event.preventDefault();
        select(next);
        next.button.focus();
      }
    });
    $('tabs').append(button);
    $('panels').append(panel);
    return tab;
  }

  function select(chosen) {
    for (const tab of view.tabs.values()) {
      const on = tab === chosen;
      tab.button.setAttribute('aria-selected', String(on));
      tab.button.tabIndex = on ? 0 : -1;
      tab.panel.hidden = !on;
    }
    if (!chosen.activated) {
      chosen.activated = true;
      chosen.activate(chosen);
    }
    chosen.shown();
  }

  // A framed presentation runs as an opaque origin, unless the entrypoint gives its live lesson
  // an origin of its own (the lesson's id is the host's first label): where every lesson
  // shares one origin, a page keeping it could read other learners' presentations.
  const SANDBOX = 'allow-scripts allow-forms allow-popups allow-downloads';
  function ownOrigin(url) {
    const label = new URL(url).hostname.split('.')[0];
    return label !== '' && label === String(view.live.id).toLowerCase();
  }

  // An http presentation: in a sandboxed frame when `embed`, always as a link to a new tab.
  function webTab(endpoint, presentation, label, subpath, embed) {
    return makeTab(endpoint, presentation, label, (tab) => {
      const frame = el('iframe', {
        title: label,
        // No top navigation: the lesson's page cannot take this page away.
        sandbox: SANDBOX,
        referrerpolicy: 'no-referrer',
      });
      const open = el('a', { target: '_blank', rel: 'noopener noreferrer' }, 'Open in a new tab');
      const reload = el('button', { type: 'button' }, 'Reload');
      const load = async () => {
        let url = await freshUrl(endpoint, presentation);
        if (!url) {
          tab.panel.prepend(el('p', { class: 'notice' }, 'This scheduler gives no entrypoint for this page.'));
          return;
        }
        if (subpath) {
          const u = new URL(url);
          u.pathname = u.pathname.replace(/\/?$/, '/') + subpath;
          url = u.toString();
        }
        // The page keeps its origin only where that origin is this live lesson's own.
        frame.setAttribute('sandbox', ownOrigin(url) ? `${SANDBOX} allow-same-origin` : SANDBOX);
        if (embed) frame.src = url;
        open.href = url;
      };
      reload.addEventListener('click', () => load().catch((err) => showError(err.message)));
      tab.panel.append(el('p', { class: 'toolbar' }, reload, ' ', open));
      if (embed) tab.panel.append(frame);
      load().catch((err) => showError(err.message));
    });
  }

  function terminalTab(endpoint, presentation) {
    return makeTab(endpoint, presentation, `${endpoint} · ${presentation} (terminal)`, (tab) => {
      const screen = el('div', { class: 'terminal', 'data-terminal': `${endpoint}/${presentation}` });
      const state = el('p', { class: 'quiet', role: 'status' }, 'Connecting…');
      const again = el('button', { type: 'button', hidden: true }, 'Reconnect');
      tab.panel.append(el('p', { class: 'toolbar' }, state, ' ', again), screen);
      const term = new window.Terminal({ cursorBlink: true, fontSize: 14, scrollback: 5000, screenReaderMode: false });
      const fit = new window.FitAddon.FitAddon();
      term.loadAddon(fit);
      term.open(screen);
      fit.fit();
      const encoder = new TextEncoder();
      let socket = null;
      let tries = 0;
      let ended = false;
      const current = view;

      const connect = async () => {
        again.hidden = true;
        state.textContent = 'Connecting…';
        // Every connection asks for a fresh URL: the one in hand may carry an expired token.
        const url = await freshUrl(endpoint, presentation);
        if (!url) {
          state.textContent = 'This scheduler gives no entrypoint for this terminal.';
          return;
        }
        const u = new URL(url);
        u.protocol = u.protocol === 'https:' ? 'wss:' : 'ws:';
        u.searchParams.set('cols', String(term.cols));
        u.searchParams.set('rows', String(term.rows));
        const ws = new WebSocket(u.toString());
        ws.binaryType = 'arraybuffer';
        socket = ws;
        ws.addEventListener('open', () => {
          tries = 0;
          for (const data of pending) ws.send(encoder.encode(data));
          pending = [];
          state.textContent = 'Connected.';
          term.focus();
        });
        ws.addEventListener('message', (event) => {
          if (typeof event.data === 'string') {
            let message = null;
            try {
              message = JSON.parse(event.data);
            } catch (_) {
              return;
            }
            if (message.type === 'exit') {
              ended = true;
              term.write(`\r\n[the shell exited with status ${message.status}]\r\n`);
            }
            return;
          }
          term.write(new Uint8Array(event.data));
        });
        ws.addEventListener('close', () => {
          if (socket !== ws || view !== current) return;
          socket = null;
          if (ended || view.deleting) {
            state.textContent = 'Disconnected.';
            again.hidden = false;
            ended = false;
            return;
          }
          // Reconnect a few times (a fresh token each time), then leave it to the learner.
          tries += 1;
          if (tries > 4) {
            state.textContent = 'Disconnected.';
            again.hidden = false;
            return;
          }
          state.textContent = 'Reconnecting…';
          setTimeout(() => connect().catch(failed), 1000 * tries);
        });
      };
      const failed = (err) => {
        state.textContent = `Cannot connect: ${err.message}`;
        again.hidden = false;
      };
      // Keys typed while a connection opens are sent once it is open.
      let pending = [];
      term.onData((data) => {
        if (!socket) return;
        if (socket.readyState === WebSocket.OPEN) socket.send(encoder.encode(data));
        else if (socket.readyState === WebSocket.CONNECTING && pending.length < 1000) pending.push(data);
      });
      term.onResize(({ cols, rows }) => {
        if (socket && socket.readyState === WebSocket.OPEN) {
          socket.send(JSON.stringify({ type: 'resize', cols, rows }));
        }
      });
      const refit = () => {
        if (!tab.panel.hidden) fit.fit();
      };
      window.addEventListener('resize', refit);
      again.addEventListener('click', () => {
        tries = 0;
        connect().catch(failed);
      });
      tab.shown = () => {
        refit();
        term.focus();
      };
      tab.close = () => {
        window.removeEventListener('resize', refit);
        const ws = socket;
        socket = null;
        if (ws) ws.close();
        term.dispose();
      };
      connect().catch(failed);
    });
  }

  // --- Actions ---------------------------------------------------------------------------------
  async function setStage(stage) {
    showError('');
    $('stage-back').disabled = true;
    $('stage-forward').disabled = true;
    const current = view;
    try {
      const live = await sessionCall('PUT', `/v1/live-lessons/${encodeURIComponent(view.live.id)}/stage`, { stage });
      if (view === current) update(live);
    } catch (err) {
      if (view === current) renderStages();
      throw new Error(explain(err));
    }
  }

  async function remove() {
    if (!view || !view.live) return;
    showError('');
    view.deleting = true;
    $('delete').disabled = true;
    for (const tab of view.tabs.values()) tab.close();
    view.tabs.clear();
    $('tabs').replaceChildren();
    $('panels').replaceChildren();
    await sessionCall('DELETE', `/v1/live-lessons/${encodeURIComponent(view.live.id)}`);
    $('status').textContent = 'TERMINATING: Deleting…';
    // The Watch stream shows TERMINATING and then ends; settle() then finds it gone.
  }

  function guard(action) {
    return (...args) => action(...args).catch((err) => showError(err.message));
  }

  async function route() {
    showError('');
    const match = /^#\/lessons\/([^/]+)$/.exec(location.hash);
    if (match) await showLesson(decodeURIComponent(match[1]));
    else await showCatalog();
    document.body.setAttribute('data-page', match ? 'lesson' : 'catalog');
  }

  $('start').addEventListener('click', guard(start));
  $('check').addEventListener('click', guard(check));
  $('delete').addEventListener('click', guard(remove));
  $('stage-back').addEventListener('click', guard(() => setStage(view.live.stage - 1)));
  $('stage-forward').addEventListener('click', guard(() => setStage((view.live.stage || 0) + 1)));
  window.addEventListener('hashchange', guard(route));
  if (!libraries) {
    $('main').prepend(el('p', { class: 'notice' }, 'The page\'s libraries did not load: see the notice above.'));
  }
  guard(route)();
})();
