"""``GET /``: a small playground page (plain HTML and JS, no build step).

The query string pre-fills the form (``?prompt=...&size=32x32&steps=4&seed=3``) and
``&run=1`` starts a generation on load, so a link can share a request.
"""

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>omni-serve playground</title>
<style>
body{font-family:sans-serif;max-width:44rem;margin:2rem auto;padding:0 1rem}
textarea,input{width:100%;box-sizing:border-box;margin:.2rem 0 .6rem}
progress{width:100%} #out img{max-width:100%;margin-top:1rem} #err{color:#b00}
</style></head><body>
<h1>omni-serve</h1>
<label>Prompt<textarea id="prompt" rows="3">a red fox in the snow</textarea></label>
<label>Size<input id="size" placeholder="the server's default, e.g. 512x512"></label>
<label>Steps<input id="steps" type="number" min="1" max="100" value="4"></label>
<label>Seed<input id="seed" type="number" min="0" placeholder="random"></label>
<label>API key<input id="key" type="password" placeholder="(none)"></label>
<button id="go">Generate</button>
<progress id="bar" value="0" max="1"></progress>
<div id="status"></div><div id="err"></div><div id="out"></div>
<script>
const $ = (id) => document.getElementById(id);
const query = new URLSearchParams(location.search);
for (const [name, id] of [["prompt", "prompt"], ["size", "size"], ["steps", "steps"], ["seed", "seed"]]) {
  if (query.has(name)) $(id).value = query.get(name);
}
$("go").onclick = async () => {
  $("err").textContent = ""; $("out").innerHTML = ""; $("bar").value = 0;
  $("status").textContent = "queued";
  const body = {prompt: $("prompt").value, num_inference_steps: Number($("steps").value),
                stream: true};
  if ($("size").value !== "") body.size = $("size").value;
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  const headers = {"Content-Type": "application/json"};
  if ($("key").value) headers["Authorization"] = "Bearer " + $("key").value;
  let resp;
  try {
    resp = await fetch("/v1/images/generations", {method: "POST", headers, body: JSON.stringify(body)});
  } catch (e) { $("err").textContent = String(e); return; }
  if (!resp.ok) {
    const j = await resp.json().catch(() => ({}));
    $("err").textContent = (j.error && j.error.message) || resp.statusText; return;
  }
  const reader = resp.body.getReader(); const dec = new TextDecoder(); let buf = "";
  for (;;) {
    const {value, done} = await reader.read(); if (done) break;
    buf += dec.decode(value, {stream: true});
    let i;
    while ((i = buf.indexOf("\\n\\n")) >= 0) {
      const chunk = buf.slice(0, i); buf = buf.slice(i + 2);
      const line = chunk.split("\\n").find((l) => l.startsWith("data: "));
      if (!line || line === "data: [DONE]") continue;
      const ev = JSON.parse(line.slice(6));
      if (ev.type === "progress") {
        $("bar").max = ev.total || 1; $("bar").value = ev.step;
        $("status").textContent = "step " + ev.step + " / " + (ev.total || "?");
      } else if (ev.type === "image_generation.completed") {
        $("status").textContent = "done";
        const img = document.createElement("img");
        img.src = ev.url || ("data:image/png;base64," + ev.b64_json);
        $("out").appendChild(img);
      } else if (ev.error) { $("err").textContent = ev.error.message; }
    }
  }
};
if (query.get("run") === "1") $("go").click();
</script></body></html>
"""
