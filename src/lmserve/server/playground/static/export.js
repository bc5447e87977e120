// Export the current request as code that runs as shown: curl, Python (the openai client) and
// JavaScript (fetch). The key is never written into the code: it is read from $LMSERVE_API_KEY.
"use strict";

const Export = (() => {
  // Fields the openai Python client takes as keyword arguments; the rest go in extra_body.
  const OPENAI_KWARGS = {
    chat: ["model", "messages", "temperature", "top_p", "max_tokens", "stop", "seed", "presence_penalty",
           "frequency_penalty", "response_format"],
    completion: ["model", "prompt", "temperature", "top_p", "max_tokens", "stop", "seed", "presence_penalty",
                 "frequency_penalty"],
  };

  function shellQuote(text) {
    return "'" + text.replace(/'/g, "'\\''") + "'";
  }

  function curl(req) {
    const lines = [`curl ${req.origin}${req.path}`, "  -H 'Content-Type: application/json'"];
    if (req.needsKey) lines.push('  -H "Authorization: Bearer $LMSERVE_API_KEY"');
    lines.push(`  -d ${shellQuote(JSON.stringify(req.body, null, 2))}`);
    return lines.join(" \\\n");
  }

  // A JSON value as a Python literal. JSON's string escapes are valid in Python strings.
  function py(value, indent) {
    const pad = "    ".repeat(indent + 1), end = "    ".repeat(indent);
    if (value === null) return "None";
    if (value === true) return "True";
    if (value === false) return "False";
    if (Array.isArray(value)) {
      if (!value.length) return "[]";
      return "[\n" + value.map((v) => pad + py(v, indent + 1) + ",\n").join("") + end + "]";
    }
    if (typeof value === "object") {
      const keys = Object.keys(value);
      if (!keys.length) return "{}";
      return "{\n" + keys.map((k) => `${pad}${JSON.stringify(k)}: ${py(value[k], indent + 1)},\n`).join("") + end + "}";
    }
    return JSON.stringify(value);
  }

  function python(req) {
    const named = OPENAI_KWARGS[req.mode];
    const args = Object.keys(req.body).filter((k) => named.includes(k)).map((k) => `    ${k}=${py(req.body[k], 1)},`);
    const extra = Object.fromEntries(Object.entries(req.body).filter(([k]) => !named.includes(k)));
    if (Object.keys(extra).length) args.push(`    extra_body=${py(extra, 1)},`);
    const call = req.mode === "chat" ? "client.chat.completions.create" : "client.completions.create";
    const answer = req.mode === "chat" ? "response.choices[0].message.content" : "response.choices[0].text";
    return [
      "import os",
      "",
      "from openai import OpenAI",
      "",
      `client = OpenAI(base_url=${JSON.stringify(req.origin + "/v1")}, api_key=os.environ.get("LMSERVE_API_KEY", "unused"))`,
      `response = ${call}(`,
      ...args,
      ")",
      `print(${answer})`,
    ].join("\n");
  }

  function javascript(req) {
    const headers = ['"Content-Type": "application/json"'];
    if (req.needsKey) headers.push("Authorization: `Bearer ${process.env.LMSERVE_API_KEY}`");
    const answer = req.mode === "chat" ? "body.choices[0].message.content" : "body.choices[0].text";
    const body = JSON.stringify(req.body, null, 2).replace(/\n/g, "\n  ");
    return [
      req.needsKey ? "// Node 18 or later (the key is read from $LMSERVE_API_KEY)." : "// Node 18 or later, or a browser console.",
      `fetch(${JSON.stringify(req.origin + req.path)}, {`,
      '  method: "POST",',
      `  headers: { ${headers.join(", ")} },`,
      `  body: JSON.stringify(${body}),`,
      "})",
      "  .then((response) => response.json())",
      `  .then((body) => console.log(${answer}));`,
    ].join("\n");
  }

  const LANGUAGES = { curl, python, js: javascript };

  // req: {origin, path, mode: "chat"|"completion", body, needsKey}
  function render(lang, req) {
    return LANGUAGES[lang](req);
  }

  return { render };
})();
