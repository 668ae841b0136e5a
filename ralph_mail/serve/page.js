// The page of `ralph-mail serve`: one snapshot of the team per change, over
// server-sent events; the acts (approve, deny, answer) are JSON posts.
"use strict";

const el = (tag, attrs = {}, ...kids) => {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const kid of kids) node.append(kid);
  return node;
};
const empty = (text) => el("p", { class: "empty" }, text);
const time = (ts) => (ts || "").slice(11, 19);

async function act(path, body, card) {
  for (const button of card.querySelectorAll("button, textarea")) button.disabled = true;
  const response = await fetch(path, {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  });
  if (!response.ok) {
    const said = await response.json().catch(() => ({ error: response.statusText }));
    card.append(el("p", { class: "error" }, said.error));
    for (const button of card.querySelectorAll("button, textarea")) button.disabled = false;
  }
}

function approvals(items) {
  if (!items.length) return [empty("nothing waits")];
  return items.map((held) => {
    const card = el("div", { class: "card", "data-id": held.id });
    card.append(
      el("div", { class: "head" }, `${held.from} → ${held.to} [${held.type}] · approver ${held.approver} · ${held.reason}`),
      el("div", { class: "body" }, held.content),
      el("button", { class: "approve", onclick: () => act("api/approve", { id: held.id }, card) }, "Approve"),
      el("button", { class: "deny", onclick: () => act("api/deny", { id: held.id, reason: "denied in the page" }, card) }, "Deny"),
    );
    return card;
  });
}

const drafts = {};  // what was typed survives a refresh of the list

function questions(items) {
  if (!items.length) return [empty("no question waits")];
  return items.map((question) => {
    const card = el("div", { class: "card", "data-id": question.id });
    const box = el("textarea", { rows: "3", placeholder: `answer as ${question.to}` });
    box.value = drafts[question.id] || "";
    box.addEventListener("input", () => { drafts[question.id] = box.value; });
    card.append(
      el("div", { class: "head" }, `${question.from} asks ${question.to} · ${time(question.ts)}`, seal(question)),
      el("div", { class: "body" }, question.content),
      box,
      el("button", { class: "answer", onclick: () => act("api/answer", { id: question.id, text: box.value }, card) }, "Answer"),
    );
    return card;
  });
}

function roster(members) {
  const rows = [el("tr", {}, el("th", {}, "member"), el("th", {}, "presence"), el("th", {}, "does"))];
  for (const m of members) {
    const who = m.name + (m.role === "lead" ? " (lead)" : "") + (m.human ? " (person)" : "");
    rows.push(el("tr", { "data-member": m.name },
      el("td", {}, who),
      el("td", {}, el("span", { class: `presence p-${m.presence}` }, m.presence)),
      el("td", {}, m.description)));
  }
  return rows;
}

function tasks(items) {
  if (!items.length) return [el("tr", {}, el("td", { class: "empty" }, "no tasks"))];
  return items.map((t) => el("tr", { "data-task": t.id },
    el("td", { class: "tree" }, `${t.prefix}${t.id} ${t.description}`),
    el("td", {}, t.status), el("td", {}, t.assignee)));
}

// A bad signature, or none where one is due: said beside the message, in red.
const seal = (m) => (m.seal ? el("span", { class: "seal" }, ` ${m.seal}`) : "");

function message(m) {
  return el("div", { class: "msg" },
    el("div", { class: "head" }, `${time(m.ts)} ${m.from} → ${m.to} [${m.type}]`, seal(m)),
    el("div", { class: "body" }, m.content));
}

function conversation(messages) {
  // What people should see stays in view; each run of internal messages folds.
  if (!messages.length) return [empty("no messages")];
  const out = [];
  let run = [];
  const flush = () => {
    if (!run.length) return;
    const fold = el("details", { class: "internal" }, el("summary", {}, `Internal agent messages (${run.length})`));
    for (const m of run) fold.append(message(m));
    out.push(fold);
    run = [];
  };
  for (const m of messages) {
    if (m.visibility === "internal") run.push(m);
    else { flush(); out.push(message(m)); }
  }
  flush();
  return out;
}

const shownBefore = {};  // a pane is drawn again only when what it shows changed

function draw(id, data, render) {
  const text = JSON.stringify(data);
  if (shownBefore[id] === text) return;
  shownBefore[id] = text;
  document.getElementById(id).replaceChildren(...render(data));
}

function show(state) {
  const status = document.getElementById("status");
  if (state.error) { status.textContent = state.error; return; }
  status.textContent = `live · ${new Date().toLocaleTimeString()}`;
  draw("approvals", state.approvals, approvals);
  draw("questions", state.questions, questions);
  draw("roster", state.members, roster);
  draw("tasks", state.tasks, tasks);
  const open = document.querySelector("#conversation details[open]") !== null;
  draw("conversation", state.messages, (messages) => {
    const shown = conversation(messages);
    if (open) for (const node of shown) if (node.tagName === "DETAILS") node.open = true;
    return shown;
  });
}

const feed = new EventSource("events");
feed.onmessage = (event) => show(JSON.parse(event.data));
feed.onerror = () => { document.getElementById("status").textContent = "reconnecting…"; };
