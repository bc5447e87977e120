// The token view: each generated token is a <span> shaded by its probability; hovering, tapping or
// focusing one shows its top alternatives. Model output only ever goes in through textContent: the
// model can write "<script>", and it must stay text.
"use strict";

const Tokens = (() => {
  const TOP_SHOWN = 5;

  // A token as the API gives it -> {token, logprob, top: [{token, logprob}]}.
  function fromChat(entry) {
    return {
      token: entry.token,
      logprob: entry.logprob,
      top: (entry.top_logprobs || []).map((t) => ({ token: t.token, logprob: t.logprob })),
    };
  }

  // The completions API gives parallel lists; top_logprobs[i] is an object {token text: logprob}.
  function fromCompletion(logprobs) {
    return logprobs.tokens.map((token, i) => ({
      token,
      logprob: logprobs.token_logprobs[i],
      top: Object.entries((logprobs.top_logprobs || [])[i] || {}).map(([t, lp]) => ({ token: t, logprob: lp })),
    }));
  }

  function probability(logprob) {
    return Math.exp(logprob);
  }

  function percent(p) {
    if (p < 0.0001) return "<0.01%";
    return (p * 100).toFixed(p >= 0.1 ? 1 : 2) + "%";
  }

  // Red (unlikely) through amber to green (certain), light enough to read dark text on.
  function shade(p) {
    return `hsl(${Math.round(130 * p)}, 75%, ${84 + Math.round(6 * p)}%)`;
  }

  // Whitespace made visible in the tooltip, where a bare space would show nothing.
  function visible(text) {
    if (text === "") return "∅";
    return text.replace(/ /g, "␣").replace(/\n/g, "↵").replace(/\t/g, "⇥");
  }

  function span(tok, index) {
    const el = document.createElement("span");
    el.className = "tok";
    el.textContent = tok.token;
    el.tabIndex = 0;
    el.dataset.index = String(index);
    el.style.setProperty("--shade", shade(probability(tok.logprob)));
    return el;
  }

  // Append tokens [from, list.length) to the output element (called as a stream's chunks arrive).
  function append(output, list, from) {
    const frag = document.createDocumentFragment();
    for (let i = from; i < list.length; i++) frag.appendChild(span(list[i], i));
    output.appendChild(frag);
  }

  // The top alternatives; a sampled token outside them comes last, after a gap, so it is always shown.
  function tooltipRows(tok) {
    const shown = tok.top.slice(0, TOP_SHOWN);
    const outside = !shown.some((alt) => alt.token === tok.token);
    if (outside) shown.push({ token: tok.token, logprob: tok.logprob });
    return shown.map((alt) => {
      const row = document.createElement("li");
      const p = probability(alt.logprob);
      if (alt.token === tok.token) row.className = outside && shown.length > 1 ? "chosen apart" : "chosen";
      const name = document.createElement("code");
      name.textContent = visible(alt.token);
      const bar = document.createElement("span");
      bar.className = "bar";
      bar.style.setProperty("--p", String(p));
      const value = document.createElement("span");
      value.className = "prob";
      value.textContent = percent(p);
      row.append(name, bar, value);
      return row;
    });
  }

  function fillTooltip(tooltip, tok) {
    const head = document.createElement("div");
    head.className = "tip-head";
    const name = document.createElement("code");
    name.textContent = visible(tok.token);
    head.append(name, document.createTextNode(` ${percent(probability(tok.logprob))}`));
    const list = document.createElement("ol");
    list.append(...tooltipRows(tok));
    const caption = document.createElement("div");
    caption.className = "tip-caption";
    caption.textContent = tok.top.length ? `Top ${Math.min(TOP_SHOWN, tok.top.length)} alternatives` : "No alternatives saved";
    tooltip.replaceChildren(head, caption, list);
  }

  // One tooltip for the whole output: for the token under the pointer, else the focused (tapped) one.
  // Touch screens send a mouseleave right after a tap: the tapped token has the focus and keeps the tooltip.
  function attachTooltip(output, tooltip, getTokens) {
    function show(el) {
      const tok = getTokens()[Number(el.dataset.index)];
      if (!tok) return;
      fillTooltip(tooltip, tok);
      tooltip.hidden = false;
      const box = el.getBoundingClientRect();
      const right = window.scrollX + document.documentElement.clientWidth - tooltip.offsetWidth - 8;
      tooltip.style.left = `${Math.max(8, Math.min(box.left + window.scrollX, right))}px`;
      tooltip.style.top = `${box.bottom + window.scrollY + 6}px`;
    }
    function showFocusedOrHide() {
      const focused = output.querySelector(".tok:focus");
      if (focused) show(focused);
      else tooltip.hidden = true;
    }
    const tokenOf = (event) => event.target.closest && event.target.closest(".tok");
    output.addEventListener("mouseover", (e) => { const el = tokenOf(e); if (el) show(el); });
    output.addEventListener("mouseleave", showFocusedOrHide);
    output.addEventListener("focusin", (e) => { const el = tokenOf(e); if (el) show(el); });
    output.addEventListener("focusout", () => { tooltip.hidden = true; });
    document.addEventListener("keydown", (e) => { if (e.key === "Escape") tooltip.hidden = true; });
  }

  // Tokens at the end that are not in the text (chat's end-of-turn token: its logprob is reported, its
  // text is not content) are dimmed, so the view does not show them as words the model wrote.
  function markTrailing(output, list, text) {
    let joined = list.map((t) => t.token).join("");
    for (let i = list.length - 1; i >= 0 && joined.length > text.length && joined.startsWith(text); i--) {
      output.children[i].classList.add("extra");
      output.children[i].title = "not part of the text (it ended the reply)";
      joined = joined.slice(0, joined.length - list[i].token.length);
    }
  }

  return { fromChat, fromCompletion, append, attachTooltip, markTrailing };
})();
